"""Where the gold answer got lost, per (method, task, length) cell of a finished eval run.

    python docs/results/embedded/gold_in_view.py runs/embedded configs/eval_embedded.yaml

- direct rows: does every gold answer survive the center truncation into the prompt? (the prompt is rebuilt
  exactly as the runner built it, from the cell's data in RUN_DIR/data/)
- memory-agent rows: does every gold answer appear in the memory written after the last chunk, i.e. the only
  thing the final call sees? (read from RUN_DIR/traces/; rows without a trace are not counted)

Only the RULER tasks are counted: their answers are literal strings of the document; HotpotQA answers often
are not (yes/no, rephrased names).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from memagent.eval.grid import EvalConfig
from memagent.eval.runner import EvalRunner


def main(run_dir: str, config: str) -> None:
    run = Path(run_dir)
    cfg = EvalConfig.from_yaml(config)
    runner = EvalRunner(cfg)
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text(encoding="utf-8").splitlines()]
    tasks = {t.name: t for t in cfg.tasks}
    methods = {m.name: m for m in cfg.methods}
    memories: dict[str, str] = {}  # sample id -> memory after the last chunk
    for path in (run / "traces").glob("*/*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            turn = json.loads(line)
            if turn["kind"] == "update":
                memories[f"{path.parent.name}/{turn['sample_id']}"] = turn["memory"]
    cells: dict[tuple[str, str, int], list[tuple[bool, float]]] = defaultdict(list)
    samples: dict[tuple[str, int], dict] = {}
    for r in rows:
        if r["task"] == "hotpotqa" or r["status"] != "ok":
            continue
        key = (r["task"], r["length"])
        if key not in samples:
            samples[key] = {s.id: s for s in runner.cell_samples(tasks[r["task"]], r["length"])}
        if methods[r["method"]].kind == "direct":
            text, _ = runner._direct_prompt(samples[key][r["sample_id"]], methods[r["method"]].max_input_tokens)
        else:
            text = memories.get(f"{r['method']}/{r['sample_id']}")
            if text is None:
                continue
        cells[(r["method"], r["task"], r["length"])].append((all(a in text for a in r["answers"]), r["score"]))
    print("| method | task | length (tokens) | n | gold in what the answer call sees | score (mean) |")
    print("|---|---|---|---|---|---|")
    for (method, task, length), v in sorted(cells.items()):
        seen = sum(ok for ok, _ in v)
        print(f"| {method} | {task} | {length} | {len(v)} | {seen}/{len(v)} | {sum(s for _, s in v) / len(v):.3f} |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
