"""How fast are the benchmark data builders?

Measures, with the embedded model's tokenizer (SmolLM2 GGUF vocabulary through llama.cpp):

1. tokenizer throughput: tokens per second of ``encode`` and of ``encode_with_offsets`` on essay text;
2. seconds to build one 128K-token RULER sample for several tasks, first build (includes the one-off
   tokenization of the whole essay haystack, cached per process) and a second build (warm);
3. the baseline for (2): RULER's own way of fitting, a binary search that re-tokenizes the whole prompt at
   every step, on niah_single_1 at 128K; prints the ratio baseline / ours;
4. seconds to build one 3200-document RULER-HotpotQA sample (pool loading separate).

    python benchmarks/data_build.py [--length 131072] [--docs 3200]
"""

from __future__ import annotations

import argparse
import json
import time

from memagent.backends.models import smollm2_gguf_path
from memagent.data import paths
from memagent.data.hotpotqa import build_pool, build_sample, load_hotpotqa
from memagent.data.ruler import build_ruler_sample
from memagent.data.ruler.common import NOISE_LINE, ruler_record
from memagent.data.ruler.niah import _prompt_text, NIAH_TASKS
from memagent.tokenization import LlamaCppTokenizer, count_tokens


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def tokenizer_throughput(tok) -> dict:
    with open(paths.data_file(paths.PG_ESSAYS), encoding="utf-8") as f:
        text = json.load(f)["text"][:1_000_000]
    ids, s_enc = timed(tok.encode, text)
    _, s_off = timed(tok.encode_with_offsets, text)
    return {"chars": len(text), "tokens": len(ids), "encode_tok_per_s": len(ids) / s_enc, "offsets_tok_per_s": len(ids) / s_off}


def naive_niah_single_1(tok, length: int) -> tuple[int, float, int]:
    """RULER-style fitting: binary search over the number of filler lines, re-tokenizing the whole prompt at
    every step. Returns (lines, seconds, full tokenizations)."""
    pre, qline, _, _ = _prompt_text(NIAH_TASKS["niah_single_1"], ["some-key"])
    needle = "One of the special magic numbers for some-key is: 1234567."
    budget = length - 128
    t0 = time.perf_counter()
    lo, hi, steps = 0, budget, 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lines = [NOISE_LINE] * mid
        lines.insert(mid // 2, needle)
        steps += 1
        if count_tokens(tok, f"{pre}\n" + "\n".join(lines) + f"\n{qline}") <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo, time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=131072, help="RULER sample length in tokens")
    ap.add_argument("--docs", type=int, default=3200, help="RULER-HotpotQA documents")
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_3,vt,fwe,cwe,qa_1")
    args = ap.parse_args()

    tok, s_load = timed(LlamaCppTokenizer.from_gguf, smollm2_gguf_path())
    print(f"tokenizer: {tok.name} (loaded in {s_load:.2f} s)")
    tp = tokenizer_throughput(tok)
    print(f"tokenizer throughput on {tp['chars']:,} essay chars ({tp['tokens']:,} tokens): "
          f"encode {tp['encode_tok_per_s']:,.0f} tok/s, encode_with_offsets {tp['offsets_tok_per_s']:,.0f} tok/s")

    print(f"\nRULER, one sample at {args.length:,} tokens (first build / second build, seconds; input tokens):")
    for task in args.tasks.split(","):
        s1, first = timed(build_ruler_sample, task, args.length, 0, tok)
        s2, second = timed(build_ruler_sample, task, args.length, 1, tok)
        n = count_tokens(tok, ruler_record(s2)["input"])
        print(f"  {task:16s} {first:6.2f} / {second:6.2f}   {n:,} tokens (budget {args.length - s2.metadata['tokens_to_generate']:,})")

    ours, s_ours = timed(build_ruler_sample, "niah_single_1", args.length, 2, tok)
    lines, s_naive, steps = naive_niah_single_1(tok, args.length)
    print(f"\nfitting niah_single_1 at {args.length:,} tokens: ours {s_ours:.2f} s ({ours.metadata['haystack_units']} lines), "
          f"RULER-style binary search {s_naive:.2f} s ({lines} lines, {steps} full tokenizations): "
          f"ratio baseline/ours = {s_naive / s_ours:.1f}x")

    records, s_load = timed(load_hotpotqa, paths.data_file(paths.HOTPOTQA_DEV))
    pool, s_pool = timed(build_pool, records, "hotpotqa-dev")
    sample, s_build = timed(build_sample, records[0], pool, tok, 0, num_docs=args.docs)
    print(f"\nRULER-HotpotQA: load {len(records)} records {s_load:.2f} s, pool of {len(pool):,} docs {s_pool:.2f} s; "
          f"one {args.docs}-document sample {s_build:.2f} s ({sample.metadata['length_tokens']:,} tokens, counted)")
    _, s_nocount = timed(build_sample, records[1], pool, None, 0, num_docs=args.docs)
    print(f"  same without counting tokens: {s_nocount:.2f} s")


if __name__ == "__main__":
    main()
