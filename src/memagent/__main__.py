"""``python -m memagent``: the same command line as ``memagent``."""

from memagent.cli import main

main()
