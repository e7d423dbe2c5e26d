"""The GRPO update's row tokens/s with each lever, against one plain forward+backward+AdamW, in one process.

Rows are synthesized (:mod:`memagent.train.synthrows`): real renderings of the chunk-first prompt templates
around needle documents, with memories of ``memory_tokens`` filler tokens, G trajectories per question, so
no rollout engine is needed and every configuration sees the same rows. Row tokens count every prompt and
response token of every row, as if unshared.

Configurations (each one update over all rows, one mini-batch, ending with an AdamW step):

- ``plain``: full fine-tuning in float32, one forward+backward of the policy-gradient loss, no old-policy or
  reference pass: the baseline.
- ``full``: today's general update: old-policy pass, reference pass on a frozen copy, training forward+backward.
- ``lora``: the same passes with LoRA (reference = the adapter switched off).
- ``lora+fused``: no old-policy pass (on-policy: the training forward's own, detached) and the reference
  computed in the micro-batch loop from the same model.
- ``lora+fused+shared``: shared-prefix groups (each group's common prompt prefix computed once).
- ``lora+fused+shared+bf16``: bfloat16 autocast for the matmuls, frozen base stored in bfloat16, float32
  adapters and AdamW state.

Used by ``benchmarks/train_step.py``.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

LEVERS = ("plain", "full", "lora", "lora+fused", "lora+fused+shared", "lora+fused+shared+bf16")


@dataclass(frozen=True)
class Shape:
    """The rows' shape; lengths in tokens of the model's tokenizer."""

    questions: int = 2
    group_size: int = 4
    doc_tokens: int = 1500
    chunk_tokens: int = 512
    memory_tokens: int = 64
    final_tokens: int = 16
    micro_batch_tokens: int = 4096
    min_shared_tokens: int = 32
    lora_rank: int = 8


def build_rows(tokenizer, shape: Shape):
    """``(rows, document tokens per question)`` for ``shape`` with the chunk-first templates."""
    from memagent.backends.hf import ChatTokens
    from memagent.train.synthetic import needle_sample
    from memagent.train.synthrows import chunk_first_templates, synthetic_rows

    chat = ChatTokens(tokenizer, "bench")
    samples, doc = [], []
    for q in range(shape.questions):
        words = max(10, int(shape.doc_tokens * 0.8))
        for _ in range(6):  # adjust the haystack until it is within 5% of doc_tokens
            s = needle_sample(q, words, seed=0, prefix="bench")
            n = len(chat.tokenizer.encode(s.context))
            if abs(n - shape.doc_tokens) <= 0.05 * shape.doc_tokens:
                break
            words = max(10, int(words * shape.doc_tokens / max(n, 1)))
        samples.append(s)
        doc.append(n)
    rows = synthetic_rows(chat, samples, shape.group_size, shape.chunk_tokens, shape.memory_tokens,
                          shape.final_tokens, templates=chunk_first_templates())
    return rows, doc, chat.pad_id


def _policy(base, lever: str, shape: Shape, copy_base: bool = True):
    """A fresh model for ``lever`` from the float32 ``base`` (not modified when ``copy_base``)."""
    import torch

    from memagent.train.lora import LoraSettings, apply_lora

    model = copy.deepcopy(base) if copy_base else base
    if lever.startswith("lora"):
        if lever.endswith("bf16"):
            model = model.to(torch.bfloat16)
        torch.manual_seed(0)
        model = apply_lora(model, LoraSettings(enabled=True, rank=shape.lora_rank, alpha=2.0 * shape.lora_rank))
        with torch.no_grad():  # a trained adapter: the policy differs from the reference
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 1e-3)
    return model.train()


def run_update(base, rows, pad_id: int, lever: str, shape: Shape, model=None) -> dict:
    """One update of ``lever`` over ``rows``; returns seconds and row tokens/s (model building excluded).

    Args:
        base: the float32 model (copied, never modified); may be ``None`` when ``model`` is given for a LoRA
            lever.
        model: the policy already built for ``lever`` (default: built from ``base``).
    """
    import torch

    from memagent.train.batching import TokenLogProbs, row_logprobs
    from memagent.train.lora import adapter_disabled
    from memagent.train.update import LossSettings, mini_batch_backward

    model = model if model is not None else _policy(base, lever, shape)
    ref_model = copy.deepcopy(base).eval().requires_grad_(False) if lever == "full" else None
    compute = "bfloat16" if lever.endswith("bf16") else "float32"
    scorer = TokenLogProbs(model, 512, compute_dtype=compute)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    traj_adv = torch.randn(max(r.traj_index for r in rows) + 1, generator=g)
    adv = traj_adv[torch.tensor([r.traj_index for r in rows])]
    budget = shape.micro_batch_tokens
    t0, c0 = time.perf_counter(), time.process_time()
    old = ref = reference = None
    shared = shape.min_shared_tokens if "shared" in lever else None
    if lever in ("full", "lora"):
        old, _ = row_logprobs(scorer, rows, pad_id, budget)
        if lever == "full":
            ref, _ = row_logprobs(TokenLogProbs(ref_model, 512), rows, pad_id, budget)
        else:
            with adapter_disabled(model):
                ref, _ = row_logprobs(scorer, rows, pad_id, budget)
    elif lever != "plain":
        reference = lambda: adapter_disabled(model)  # noqa: E731
    settings = LossSettings(kl_coef=0.0 if lever == "plain" else 0.001)
    opt.zero_grad(set_to_none=True)
    m = mini_batch_backward(scorer, rows, adv, old, ref, settings, pad_id, budget, min_shared_tokens=shared,
                            reference=reference)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(r.num_tokens for r in rows)
    return {"lever": lever, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "row_tokens": tokens,
            "row_tok_per_s": round(tokens / seconds, 1), "row_tok_per_cpu_s": round(tokens / cpu, 1),
            "loss": m["loss"], "trainable_params": sum(p.numel() for p in params)}


def fwd_bwd_seconds(base, tokens: int, repeats: int = 2) -> list[dict]:
    """CPU seconds of one forward+backward of a ``tokens``-long random sequence (policy-gradient-like loss on
    the last 64 positions), float32 vs bfloat16 autocast, full fine-tuning vs LoRA (bfloat16 base), interleaved
    ``repeats`` times; each configuration's fastest run."""
    import torch

    from memagent.train.batching import TokenLogProbs

    ids = torch.randint(0, base.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    target = torch.zeros(1, tokens - 1)
    target[:, -64:] = 1
    configs = {"full float32": ("plain", "float32"), "full bf16 autocast": ("plain", "bfloat16"),
               "lora float32": ("lora", "float32"), "lora bf16 base + autocast": ("lora+bf16", "bfloat16")}
    models = {k: _policy(base, lever, Shape()) for k, (lever, _) in configs.items()}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeats):
        for k, (_, compute) in configs.items():
            scorer = TokenLogProbs(models[k], 512, compute_dtype=compute)
            c0 = time.process_time()
            logp, _ = scorer(ids, torch.ones_like(ids), False, target)
            c1 = time.process_time()
            (logp * target).sum().backward()
            c2 = time.process_time()
            models[k].zero_grad(set_to_none=True)
            if k not in best or c2 - c0 < sum(best[k]):
                best[k] = (c1 - c0, c2 - c1)
    return [{"config": k, "tokens": tokens, "forward_cpu_s": round(f, 2), "backward_cpu_s": round(b, 2),
             "total_cpu_s": round(f + b, 2)} for k, (f, b) in best.items()]


def shared_tokens(rows, shape: Shape) -> int:
    """Tokens the decoder computes with shared prefixes (prefix once per micro-batch group + suffixes)."""
    from memagent.train.prefix import plan_micro_batches

    total = 0
    lengths = [r.num_tokens for r in rows]
    for mb in plan_micro_batches([r.prompt_ids for r in rows], lengths, shape.micro_batch_tokens,
                                 shape.min_shared_tokens):
        for g in mb.groups:
            total += g.prefix_tokens + sum(lengths[mb.rows[i]] - g.prefix_tokens for i in g.rows)
    return total


def _status_gib(field: str) -> float:
    with open("/proc/self/status", encoding="utf-8") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kib / 2**20


def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory to the current one (Linux ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_memory(model_dir: str, lever: str, shape: Shape, threads: int) -> dict:
    """Peak RSS of one update of ``lever`` in a fresh process (model loaded from ``model_dir``)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model_dir, lever, json.dumps(shape.__dict__),
           str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(model_dir: str, lever: str, shape_json: str, threads: int) -> None:
    import torch

    from memagent.backends.hf import load_hf_model

    torch.set_num_threads(threads)
    base, tok = load_hf_model(model_dir, "float32")
    shape = Shape(**json.loads(shape_json))
    rows, _, pad_id = build_rows(tok, shape)
    # as a run holds them: the policy in place (LoRA: no float32 copy), plus a frozen copy for "full"
    model = _policy(base, lever, shape, copy_base=False)
    if lever != "full":
        base = None
    gc.collect()
    before = _status_gib("VmRSS")
    exact = reset_peak_rss()
    r = run_update(base, rows, pad_id, lever, shape, model=model)
    peak = _status_gib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({**r, "rss_before_step_gib": round(before, 2), "peak_rss_step_gib": round(peak, 2),
                      "peak_is_step_only": exact}))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":  # one measured configuration, started by train_step.py
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        sys.exit("update_levers.py holds the measurements benchmarks/train_step.py runs, each in its own process; "
                 "run: python benchmarks/train_step.py --help")
