"""Where real data lives: one data root, chosen explicitly, by environment, or by the repository layout.

Order: an explicit argument (``--data-root``) > ``$MEMAGENT_DATA`` > ``<repo>/../shared/data`` when that folder
exists. Data is read in place and never copied into the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

from memagent.errors import DataError

ENV_VAR = "MEMAGENT_DATA"

#: Files under the data root, by role (relative paths; see the READMEs in the data root).
HOTPOTQA_DEV = "hotpotqa/hotpot_dev_distractor_subset.jsonl"
HOTPOTQA_TRAIN = "hotpotqa/hotpot_train_distractor_subset.jsonl"
SQUAD_DEV = "squad/squad_v2_dev_half_cs224n.json"
SQUAD_EXTRA_PARAGRAPHS = "squad/squad_v2_extra_paragraphs_cs224n_test_half.jsonl"
PG_ESSAYS = "paul_graham_essays/PaulGrahamEssays.json"
GUTENBERG_DIR = "gutenberg_nltk"


def _repo_default() -> Path:
    # src/memagent/data/paths.py -> parents[3] is the repository root in a source checkout
    return Path(__file__).resolve().parents[3].parent / "shared" / "data"


def data_root(explicit: str | os.PathLike | None = None) -> Path:
    """The data root folder.

    Args:
        explicit: a folder given by the user (``--data-root``); wins over everything else.

    Returns:
        An existing folder.

    Raises:
        DataError: the chosen folder does not exist, or none was given and no default exists (the message
            says how to set one).
    """
    if explicit is not None:
        p = Path(explicit).expanduser()
        if not p.is_dir():
            raise DataError(f"data root {str(p)!r} (given by --data-root or a config's data_root) is not a folder")
        return p
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise DataError(f"data root {str(p)!r} (from ${ENV_VAR}) is not a folder")
        return p
    p = _repo_default()
    if p.is_dir():
        return p
    raise DataError(
        "no data root found: pass --data-root DIR, or set the environment variable "
        f"{ENV_VAR}=DIR, or place the data at {str(p)!r} (the folder holding hotpotqa/, squad/, "
        "paul_graham_essays/, gutenberg_nltk/)"
    )


def data_file(relative: str, root: str | os.PathLike | None = None) -> Path:
    """An existing file under the data root.

    Args:
        relative: path relative to the data root (e.g. :data:`HOTPOTQA_DEV`).
        root: explicit data root (see :func:`data_root`).

    Raises:
        DataError: no data root, or the file is missing under it.
    """
    base = data_root(root)
    p = base / relative
    if not p.exists():
        raise DataError(f"data file {relative!r} not found under the data root {str(base)!r}")
    return p
