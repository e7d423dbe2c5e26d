"""niah_multikey_1 correct counts split by the asked needle's depth in the document (grid samples, n = 16 a cell).

    python docs/results/ruler_rl/probe_interp/depth_split.py

Depth = the asked needle's first character over the document's length in characters (the sample's
``metadata.evidence``), "shallow" below 0.5 and "deep" from 0.5. For 2K-16K (the lengths whose sample files are
kept in ../grid_default/data/), prints each method's correct/total for both halves: grid_default's methods
(packaged step 26 as memagent_rl, untrained, direct) and this folder's interpolated adapter.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRID = HERE.parent / "grid_default"
TASK = "niah_multikey_1"


def correct(paths: list[Path], length: int) -> dict[str, dict[str, float]]:
    """method -> sample_id -> string_match_all, for TASK at ``length`` tokens."""
    out: dict[str, dict[str, float]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["task"] == TASK and row["length"] == length:
                out.setdefault(row["method"], {})[row["sample_id"]] = row["scores"]["string_match_all"]
    return out


def main() -> None:
    for length in (2048, 4096, 8192, 16384):
        samples = [json.loads(x) for x in (GRID / "data" / f"{TASK}_{length}.jsonl").read_text().splitlines()]
        depth = {s["id"]: s["metadata"]["evidence"][0]["start_char"] / len(s["context"]) for s in samples}
        halves = {"shallow": [k for k, d in depth.items() if d < 0.5], "deep": [k for k, d in depth.items() if d >= 0.5]}
        scores = correct([GRID / "results.jsonl", HERE / "results.jsonl"], length)
        cells = []
        for method, by_id in sorted(scores.items()):
            parts = [f"{name} {int(sum(by_id.get(k, 0) for k in ids))}/{len(ids)}" for name, ids in halves.items()]
            cells.append(f"{method}: {', '.join(parts)}")
        print(f"{length} tokens: " + "; ".join(cells))


if __name__ == "__main__":
    main()
