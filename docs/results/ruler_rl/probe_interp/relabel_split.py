"""What the packaged policy's memory held just before the asked needle's chunk, and whether it then captured it
(niah_multikey_1, grid samples, n = 16 a cell).

    python docs/results/ruler_rl/probe_interp/relabel_split.py

For each sample, from the committed rows, sample files and memagent_rl traces in ../grid_default/: the memory
after the chunk before the asked needle's chunk is "relabeled" when it names the asked key together with another
key's needle value (the value was copied under the asked key), "other value" when it holds another key's value
without the asked key, else "no value"; "captured" when the memory after the asked needle's chunk holds the
answer. Prints correct/total per (memory before, captured) at 2K-16K (the lengths whose sample files are kept).
"""
from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

GRID = Path(__file__).resolve().parent.parent / "grid_default"
TASK = "niah_multikey_1"
NEEDLE = re.compile(r"One of the special magic numbers for ([\w-]+) is: (\d+)")


def main() -> None:
    scores = {}
    for line in (GRID / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["task"] == TASK and row["method"] == "memagent_rl":
            scores[(row["length"], row["sample_id"])] = row["scores"]["string_match_all"]
    for length in (2048, 4096, 8192, 16384):
        samples = [json.loads(x) for x in (GRID / "data" / f"{TASK}_{length}.jsonl").read_text().splitlines()]
        turns = defaultdict(list)
        for line in (GRID / "traces" / "memagent_rl" / f"{TASK}_{length}.jsonl").read_text().splitlines():
            t = json.loads(line)
            if t["kind"] == "update":
                turns[t["sample_id"]].append(t)
        cells: Counter = Counter()
        right: Counter = Counter()
        for s in samples:
            key = re.search(r"number for ([\w-]+) mentioned", s["question"]).group(1)
            needles = [(m.start(), m.group(1), m.group(2)) for m in NEEDLE.finditer(s["context"])]
            asked = next(p for p, k, _ in needles if k == key)
            seq = turns[s["id"]]
            at = next(i for i, t in enumerate(seq) if t["chunk_chars"][0] <= asked < t["chunk_chars"][1])
            before = seq[at - 1]["memory"] if at else ""
            others = [v for _, k, v in needles if k != key]
            held = any(v in before for v in others)
            state = "relabeled" if held and key in before else "other value" if held else "no value"
            cell = (state, "captured" if s["answers"][0] in seq[at]["memory"] else "not captured")
            cells[cell] += 1
            right[cell] += int(scores[(length, s["id"])])
        shown = "; ".join(f"{a}, {b}: {right[(a, b)]}/{n}" for (a, b), n in sorted(cells.items()))
        print(f"{length} tokens: {shown}")


if __name__ == "__main__":
    main()
