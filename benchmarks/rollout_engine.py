"""Rollout throughput: the batched, prefix-sharing llama.cpp backend against the single-stream one.

Both backends serve the same GRPO-shaped rollout through memagent's MemoryAgent (requests in lock step, one
batched ``generate`` per step): ``--questions`` needle questions x ``--group-size`` trajectories each, on
documents of about ``--doc-words`` words (~1,500 SmolLM2 tokens by default) read in ``--chunk-tokens``
chunks, memory capped at ``--memory-tokens``, sampled at ``--temperature`` with the template
``chunk_first`` (memagent's layout with the section before the memory, so the G trajectories of a question
share each update prompt up to their memory). Both run in this process, alternately
(``--repeats``), on the same samples and seeds.

Reported per backend: generated tokens, wall and process-CPU seconds, generated tokens per second of each;
for the batched backend also the prompt tokens it evaluated and those it took from a shared prefix. First, the
ceiling: plain decoding of 8 sequences at once against one (no prompt sharing, no stop token).
``--engine-dtype f16`` runs the batched backend on a dequantized F16 copy of the model (what a trainer would
push its LoRA adapter onto; the single-stream baseline stays on the original file). On a shared
machine use ``--threads 1`` and read the CPU figures: the wall clock then mostly measures the neighbours, and
two spinning threads that are rarely scheduled together waste most of their time.

The last line is ``ratio rollout_vs_engine=<batched tok/s / single-stream tok/s>`` (wall clock; the line
before it gives the CPU-time ratio).

    python benchmarks/rollout_engine.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time



def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def ceiling(batched, n_seq: int, new_tokens: int) -> dict[str, float]:
    """Plain decode tokens/s of ``n_seq`` sequences together vs one, on the batched backend's engine."""
    from memagent.backends.llamacpp_engine import Job

    tok = batched.tokenizer
    prompts = [tuple(tok.encode(f"Story {k}: once upon a time, in a town by the sea,")) for k in range(n_seq)]
    never = lambda t: False  # noqa: E731
    eng = batched._engine
    one = [Job(prompts[0], new_tokens)]
    many = [Job(p, new_tokens) for p in prompts]
    _, w1, c1 = _timed(lambda: eng.run(one, never))
    _, wn, cn = _timed(lambda: eng.run(many, never))
    return {"tok_s_1": new_tokens / w1, "tok_s_n": n_seq * new_tokens / wn,
            "cpu_tok_s_1": new_tokens / c1, "cpu_tok_s_n": n_seq * new_tokens / cn}


def rollout(backend, samples, cfg, templates) -> dict[str, float]:
    from memagent.agent.loop import MemoryAgent

    agent = MemoryAgent(backend, cfg, templates)
    trajs, wall, cpu = _timed(lambda: agent.run(samples))
    errors = [t.error for t in trajs if t.error]
    if errors:
        raise SystemExit(f"{backend.name}: {len(errors)} trajectories failed, e.g. {errors[0]}")
    gen = sum(t.completion_tokens for tr in trajs for t in tr.turns)
    prompt = sum(t.prompt_tokens for tr in trajs for t in tr.turns)
    return {"generated": gen, "prompt": prompt, "wall_s": wall, "cpu_s": cpu, "turns": sum(len(t.turns) for t in trajs)}


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (``benchmarks/train_step.py`` reuses it for its rollout half)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat of 2 questions x G=4 (a few minutes)")
    ap.add_argument("--questions", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=1300, help="haystack words per document (~1,500 tokens)")
    ap.add_argument("--chunk-tokens", type=int, default=448)
    ap.add_argument("--memory-tokens", type=int, default=80)
    ap.add_argument("--final-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each backend (--quick: 1)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--n-parallel", type=int, default=8, help="sequences the batched backend decodes together")
    ap.add_argument("--kv-unified", action="store_true", help="batched backend: one KV buffer for all sequences")
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--engine-dtype", default="same", choices=["same", "f16", "f32"],
                    help="batched backend only: run on a dequantized F16/F32 copy of the model (the training base)")
    return ap


def measure(args: argparse.Namespace) -> float:
    """Run the side-by-side rollout measurement; print its lines and return ``rollout_vs_engine`` (wall clock)."""
    repeats = 1 if args.quick else args.repeats

    from memagent.agent.loop import AgentConfig
    from memagent.agent.prompts import PromptTemplates
    from memagent.backends.llamacpp import LlamaCppBackend
    from memagent.backends.llamacpp_batch import BatchedLlamaCppBackend
    from memagent.train.rollout import repeat_samples
    from memagent.train.synthetic import needle_samples

    n_ctx = 2048
    single = LlamaCppBackend(args.model, n_ctx=n_ctx, n_threads=args.threads)
    engine_model, scratch = args.model, None
    if args.engine_dtype != "same":
        from memagent.export.gguf_model import write_dequantized_gguf

        scratch = tempfile.mkdtemp(prefix="memagent_bench_")
        engine_model = write_dequantized_gguf(single.model_path, os.path.join(scratch, f"model-{args.engine_dtype}.gguf"),
                                              args.engine_dtype)
    batched = BatchedLlamaCppBackend(engine_model, n_ctx=n_ctx, n_parallel=args.n_parallel, n_threads=args.threads,
                                     kv_unified=args.kv_unified, keep_stop_token=True)
    templates = PromptTemplates.from_file("chunk_first")
    samples = repeat_samples(needle_samples(args.questions, args.doc_words, seed=0), args.group_size)
    doc_tokens = len(single.tokenizer.encode(samples[0].context))
    cfg = AgentConfig(chunk_tokens=args.chunk_tokens, memory_tokens=args.memory_tokens, final_tokens=args.final_tokens,
                      temperature=args.temperature, seed=0, batch_size=len(samples))
    print(f"model {os.path.basename(single.model_path)} (batched: {os.path.basename(batched.model_path)}), threads {args.threads or os.cpu_count()}; "
          f"{args.questions} questions x G={args.group_size} on {doc_tokens}-token documents, chunks of "
          f"{args.chunk_tokens}, memory <= {args.memory_tokens}, temperature {args.temperature}", flush=True)

    c = ceiling(batched, 8, 48)
    print(f"ceiling: plain decode 8 sequences {c['tok_s_n']:.1f} tok/s vs 1 sequence {c['tok_s_1']:.1f} tok/s "
          f"(x{c['tok_s_n'] / c['tok_s_1']:.2f}); CPU time: {c['cpu_tok_s_n']:.1f} vs {c['cpu_tok_s_1']:.1f} "
          f"(x{c['cpu_tok_s_n'] / c['cpu_tok_s_1']:.2f})", flush=True)

    totals = {"single": {}, "batched": {}}
    before = batched.stats
    for rep in range(repeats):
        for name, backend in (("single", single), ("batched", batched)):
            r = rollout(backend, samples, cfg, templates)
            for k, v in r.items():
                totals[name][k] = totals[name].get(k, 0) + v
            print(f"repeat {rep + 1} {name:8s}: {r['generated']} generated tokens in {r['wall_s']:.1f} s wall "
                  f"({r['generated'] / r['wall_s']:.1f} tok/s), {r['cpu_s']:.1f} s CPU "
                  f"({r['generated'] / r['cpu_s']:.1f} tok/s); {r['turns']} turns, {r['prompt']} prompt tokens", flush=True)
    after = batched.stats
    ev = after["prompt_tokens_evaluated"] - before["prompt_tokens_evaluated"]
    sh = after["prompt_tokens_shared"] - before["prompt_tokens_shared"]
    print(f"batched backend: {ev} prompt tokens evaluated, {sh} taken from shared prefixes "
          f"({sh / max(1, ev + sh):.0%} of its prompt tokens)")
    s, b = totals["single"], totals["batched"]
    wall = (b["generated"] / b["wall_s"]) / (s["generated"] / s["wall_s"])
    cpu = (b["generated"] / b["cpu_s"]) / (s["generated"] / s["cpu_s"])
    single.close()
    batched.close()
    if scratch:
        shutil.rmtree(scratch)
    print(f"ratio (CPU time) rollout_vs_engine_cpu={cpu:.2f}")
    return wall


def main() -> None:
    print(f"ratio rollout_vs_engine={measure(parser().parse_args()):.2f}")


if __name__ == "__main__":
    main()
