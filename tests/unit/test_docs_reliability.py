"""docs/reliability.md stays true: every test it cites exists, and it lists at least 40 cases."""

import re
from pathlib import Path

DOC = Path("docs/reliability.md")


def test_every_cited_test_exists_and_the_catalogue_has_40_cases():
    text = DOC.read_text(encoding="utf-8")
    cases = re.findall(r"^\| (\d+) \|", text, re.M)
    assert len(cases) >= 40 and [int(c) for c in cases] == list(range(1, len(cases) + 1))
    cited = 0
    for row in text.splitlines():
        current = None
        for m in re.finditer(r"`(?:(unit|integration)/(test_\w+\.py))?::(test_\w+)`", row):
            if m.group(1):
                current = Path("tests") / m.group(1) / m.group(2)
            assert current is not None, f"{m.group(0)} names no file: {row[:80]}"
            assert re.search(rf"^(async )?def {m.group(3)}\(", current.read_text(encoding="utf-8"), re.M), \
                f"{current}::{m.group(3)} does not exist"
            cited += 1
    assert cited >= 60
