"""Does LlamaCppBackend.generate cost more than llama-cpp-python's own create_chat_completion?

Both paths decode greedily from the same prompt ids (checked), so they do the same model work; the
difference is the Python around it: our sentinel rendering + piecewise tokenization versus one string
tokenization, and our per-token end-of-generation check versus the library's per-token detokenization and
stop-string scan. Each case alternates the two paths ``--repeats`` times from an empty KV cache and prints the
median wall and process-CPU seconds of each and their ratios (target <= 1.05), plus the seconds our path
spends building the prompt ids. On a shared machine, use ``--n-threads 1`` and read the CPU ratio: wall
time then mostly measures the neighbours.

    python benchmarks/llamacpp_overhead.py --repeats 3 --n-threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

from memagent.backends.llamacpp import LlamaCppBackend
from memagent.types import Message, Request

_FILLER = (
    "The river town kept its records in a stone house by the bridge. Every spring the clerks counted the boats, "
    "the bales of wool and the barrels of salt, and wrote the numbers in long ledgers bound in calfskin. "
)


def _cases(backend: LlamaCppBackend) -> list[tuple[str, Request]]:
    doc = _FILLER * 10
    long_prompt = Request((Message("user", doc + "\nIn one sentence, what did the clerks count?"),), max_tokens=32)
    long_gen = Request((Message("user", "Write a long story about a dragon who learns to bake bread."),), max_tokens=64)
    return [("prompt-heavy", long_prompt), ("generation-heavy", long_gen)]


def _ours(backend: LlamaCppBackend, request: Request) -> tuple[float, float, int, str]:
    t0, c0 = time.perf_counter(), time.process_time()
    (c,) = backend.generate([request])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, c.usage.prompt_tokens + c.usage.completion_tokens, c.text


def _library(backend: LlamaCppBackend, request: Request) -> tuple[float, float, int, str]:
    llm = backend._llm
    llm.reset()  # start from an empty cache like our path does (otherwise it would reuse our prompt)
    t0, c0 = time.perf_counter(), time.process_time()
    out = llm.create_chat_completion(
        [{"role": m.role, "content": m.content} for m in request.messages],
        temperature=0.0,
        max_tokens=request.max_tokens,
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    usage = out["usage"]
    return wall, cpu, usage["prompt_tokens"] + usage["completion_tokens"], out["choices"][0]["message"]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-threads", type=int, default=None)
    args = ap.parse_args()
    backend = LlamaCppBackend(n_ctx=4096, n_threads=args.n_threads)
    print(
        f"{'case':<17} {'tokens':>6} {'wall ours':>9} {'wall lib':>8} {'ratio':>6} {'cpu ours':>8} {'cpu lib':>8} "
        f"{'ratio':>6} {'prompt ids s':>12}  same output"
    )
    for name, request in _cases(backend):
        ours, lib = [], []
        for _ in range(args.repeats):
            *t_ours, n_ours, text_ours = _ours(backend, request)
            *t_lib, n_lib, text_lib = _library(backend, request)
            ours.append(t_ours)
            lib.append(t_lib)
        t0 = time.perf_counter()
        backend.prompt_token_ids(request.messages)
        build = time.perf_counter() - t0
        wa, ca = (statistics.median(x[i] for x in ours) for i in (0, 1))
        wb, cb = (statistics.median(x[i] for x in lib) for i in (0, 1))
        same = text_ours == text_lib and n_ours == n_lib
        print(
            f"{name:<17} {n_ours:>6} {wa:>9.3f} {wb:>8.3f} {wa / wb:>6.3f} {ca:>8.3f} {cb:>8.3f} {ca / cb:>6.3f} "
            f"{build:>12.4f}  {same}"
        )
    backend.close()


if __name__ == "__main__":
    main()
