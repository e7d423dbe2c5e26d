"""Per-cell correct counts of the interpolated adapter beside grid_default's methods (same samples).

    python docs/results/ruler_rl/probe_interp/compare.py [RESULTS.jsonl]

Prints, for every grid cell the probe has rows for, each method's string_match_all count out of the cell's samples
and the per-sample pattern (1 correct, 0 wrong, in sample order), so that two adapters can be compared sample by
sample. RESULTS defaults to this folder's results.jsonl.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRID = HERE.parent / "grid_default" / "results.jsonl"


def scores(path: Path) -> dict[tuple[str, int], dict[str, dict[str, float]]]:
    """(task, length in tokens) -> method -> sample_id -> string_match_all."""
    out: dict[tuple[str, int], dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[(row["task"], row["length"])][row["method"]][row["sample_id"]] = row["scores"]["string_match_all"]
    return out


def main(results: Path) -> None:
    grid, probe = scores(GRID), scores(results)
    for cell in sorted(probe):
        print(f"{cell[0]} {cell[1] // 1024}K")
        methods = {**grid.get(cell, {}), **probe[cell]}
        ids = sorted(methods["memagent_rl"], key=lambda s: int(s.rsplit("-", 1)[1]))
        for name, by_id in methods.items():
            pattern = "".join(str(int(by_id[i])) if i in by_id else "." for i in ids)
            print(f"  {name:16s} {pattern} {int(sum(by_id.values()))}/{len(by_id)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results.jsonl")
