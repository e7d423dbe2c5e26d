"""Scale benchmarks (issue 16): any length in bounded memory, the client at the server's speed, many servers.

    python benchmarks/scale.py tokenize --tokens 8000 100000 1000000 3500000   # (a)
    python benchmarks/scale.py fanout --concurrency 1 16 128 256                 # (b)
    python benchmarks/scale.py failover                                          # (c)

(a) The memory agent with a zero-cost model (the scripted backend, constant replies) and the SmolLM2 tokenizer
    over one Gutenberg novel repeated to each length, chunk 5000: its wall time against the raw tokenizer's
    (llama.cpp ``tokenize`` of the same text in one call) measured side by side in the same process, and the
    peak resident memory the agent adds beyond the text (``VmHWM`` reset before the run). Each length runs in
    its own process.
(b) 128 samples of about 15K tokens (chunk 2000, memory 256) against a local fake OpenAI server (loopback, fixed
    latency, unlimited parallelism) at C requests in flight: wall time against the bound (tokenizing every
    document + turns x latency x ceil(samples / C)).
(c) Two fake servers; one is killed mid-run (or, with --hang, stopped: it accepts connections and answers
    nothing): the run must end with every row ok and no row twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MEMAGENT_DATA", REPO.parent / "shared" / "data"))
NOVEL = DATA / "gutenberg_nltk" / "austen-emma.txt"


def _vm(field: str) -> int:
    """A ``/proc/self/status`` memory figure in bytes."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


def _trim() -> None:
    """Give freed heap back to the system, so the baseline is what is really in use."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _text_of(tok, tokens: int) -> str:
    """The novel repeated and cut to about ``tokens`` tokens (at a token boundary of one copy)."""
    one = NOVEL.read_text(encoding="utf-8")
    bounds = tok.boundaries(one)
    per = len(bounds) - 1
    return one * (tokens // per) + one[: int(bounds[tokens % per])]


def tokenize_one(tokens: int, chunk_tokens: int) -> dict:
    """(a) for one length, in this process."""
    import gc

    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.scripted import ScriptedBackend
    from memagent.tokenization import load_tokenizer
    from memagent.types import Sample

    tok = load_tokenizer("smollm2")
    text = _text_of(tok, tokens)
    tok._piece_lengths()  # the vocabulary table, read once per tokenizer (not per document)
    gc.collect()
    _trim()
    base = _vm("VmRSS")
    _reset_peak()
    class Forgetful(ScriptedBackend):
        """The scripted model without its record of every request (which holds every chunk's text)."""

        turns = 0

        def generate(self, requests):
            out = super().generate(requests)
            self.turns += len(self.calls[-1])
            self.calls.clear()
            return out

    backend = Forgetful(responder=lambda r: "Nothing relevant yet.", context_tokens=16384)
    agent = MemoryAgent(backend, AgentConfig(chunk_tokens=chunk_tokens, memory_tokens=256, final_tokens=64),
                        tokenizer=tok, keep_token_ids=False)  # as memagent run and eval keep them
    t0 = time.perf_counter()
    traj = agent.run([Sample("0", "Whom does Emma try to match with Mr. Elton?", text)])[0]
    agent_s = time.perf_counter() - t0
    peak = _vm("VmHWM") - base
    del traj
    gc.collect()
    t0 = time.perf_counter()
    ids = tok._llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    raw_s = time.perf_counter() - t0
    del ids
    from memagent.stitching import string_pieces, text_blocks

    t0 = time.perf_counter()
    n_blocks = 0
    for _, block in text_blocks(string_pieces(text)):  # the same text cut as the agent cuts it, tokens only
        n_blocks += len(tok._llama.tokenize(block.encode("utf-8"), add_bos=False, special=False))
    raw_blocks_s = time.perf_counter() - t0
    ids_n = n_blocks
    return {"raw_blocks_s": round(raw_blocks_s, 2), "ratio_blocks": round(agent_s / raw_blocks_s, 3),"tokens": ids_n, "chars": len(text), "text_mb": round(len(text.encode()) / 2**20, 1),
            "agent_s": round(agent_s, 2), "raw_tokenizer_s": round(raw_s, 2), "ratio": round(agent_s / raw_s, 3),
            "peak_growth_mb": round(peak / 2**20, 1), "turns": backend.turns}


def cmd_tokenize(args) -> None:
    print("| tokens | text MB | agent s | raw tokenizer s (one call) | ratio | raw tokenizer s (blocks) | ratio | "
          "peak growth MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        out = subprocess.run([sys.executable, __file__, "_tokenize_one", str(n), str(args.chunk_tokens)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {r['tokens']:,} | {r['text_mb']} | {r['agent_s']} | {r['raw_tokenizer_s']} | {r['ratio']} | "
              f"{r['raw_blocks_s']} | {r['ratio_blocks']} | {r['peak_growth_mb']} |", flush=True)


# ------------------------------------------------------------------------------------------------ (b), (c)
def start_fake(latency_s: float) -> tuple[subprocess.Popen, str]:
    """A fake server in its own process; returns (process, base URL)."""
    proc = subprocess.Popen([sys.executable, "-m", "memagent.backends.fakeserver", "--latency", str(latency_s)],
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline().split()[-1])
    return proc, f"http://127.0.0.1:{port}/v1"


def fanout_samples(tok, n: int, doc_tokens: int):
    """``n`` documents of ``doc_tokens`` tokens, each a different stretch of the Gutenberg novels."""
    from memagent.types import Sample

    text = "".join(p.read_text(encoding="utf-8") for p in sorted(NOVEL.parent.glob("*.txt")) if p.name != "README.md")
    bounds = tok.boundaries(text[: 200_000])
    chars = int(bounds[min(doc_tokens, len(bounds) - 1)])  # about doc_tokens tokens of such prose
    step = max(1, (len(text) - chars) // max(n, 1))
    return [Sample(str(k), "Which character speaks first?", text[k * step: k * step + chars]) for k in range(n)]


def raw_tokenize_s(tok, samples, threads: int) -> float:
    """Seconds to tokenize every document with the raw tokenizer, ``threads`` documents at a time."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda s: tok._llama.tokenize(s.context.encode(), add_bos=False, special=False), samples))
    return time.perf_counter() - t0


def run_agent(urls, samples, concurrency: int, tok, chunk_tokens=2000, memory_tokens=256, on_result=None):
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.factory import open_backend

    settings = {"name": "openai", "base_url": urls if len(urls) > 1 else urls[0], "model": "fake",
                "concurrency": concurrency, "context_tokens": 8192}
    backend, _ = open_backend(settings, tok, check_reachable=True)
    agent = MemoryAgent(backend, AgentConfig(chunk_tokens=chunk_tokens, memory_tokens=memory_tokens,
                                             final_tokens=64, batch_size=concurrency), tokenizer=tok,
                        keep_token_ids=False)
    t0 = time.perf_counter()
    try:
        trajs = agent.run(samples, on_result=on_result)
    finally:
        backend.close()
    return time.perf_counter() - t0, trajs, backend


def reference_one(repo: str, url: str, n: int, doc_tokens: int, concurrency: int, chunk_tokens: int,
                  memory_tokens: int) -> dict:
    """The reference implementation's own eval client (``taskutils/memory_eval/utils/recurrent.py`` of a
    checkout given by path, imported as it is) over the same samples and fake server, in this process."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    os.environ.update(SERVE_HOST=host, SERVE_PORT=port, RECURRENT_CHUNK_SIZE=str(chunk_tokens),
                      RECURRENT_MAX_NEW=str(memory_tokens), RECURRENT_MAX_CONTEXT_LEN=str(10**9))
    sys.path.insert(0, str(Path(repo) / "taskutils" / "memory_eval"))
    import uvloop
    from utils.aio import async_main  # the reference's own modules
    from utils.recurrent import async_query_llm

    from memagent.tokenization import load_tokenizer

    tok = load_tokenizer("smollm2")  # the same tokenizer object type memagent uses (encode / decode)
    tok._piece_lengths()
    samples = fanout_samples(tok, n, doc_tokens)
    items = [{"_id": k + 1, "context": s.context, "input": s.question} for k, s in enumerate(samples)]  # id 0 prints
    t0 = time.perf_counter()
    out = uvloop.run(async_main([async_query_llm(it, "fake", tok) for it in items], concurrency))
    return {"seconds": time.perf_counter() - t0, "answered": sum(bool(o) for o in out)}


def cmd_fanout(args) -> None:
    from memagent.tokenization import load_tokenizer

    tok = load_tokenizer("smollm2")
    tok._piece_lengths()
    proc, url = start_fake(args.latency)
    try:
        ref = " reference client s | reference / bound |" if args.reference else ""
        print("| C | samples | turns/sample | tokenize s (2 threads) | bound s | memagent s | memagent / bound |" + ref)
        print("|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.reference else ""))
        for c in args.concurrency:
            n = args.samples if c > 1 else args.samples_c1
            samples = fanout_samples(tok, n, args.doc_tokens)
            tok_s = raw_tokenize_s(tok, samples, 2)
            wall, trajs, _ = run_agent([url], samples, c, tok)
            turns = max(len(t.turns) for t in trajs)
            assert all(t.ok for t in trajs), [t.error for t in trajs if not t.ok][:3]
            bound = tok_s + turns * args.latency * -(-n // c)
            row = f"| {c} | {n} | {turns} | {tok_s:.2f} | {bound:.2f} | {wall:.2f} | {wall / bound:.2f} |"
            if args.reference:
                out = subprocess.run([sys.executable, __file__, "_reference_one", args.reference, url, str(n),
                                      str(args.doc_tokens), str(c)], check=True, capture_output=True, text=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                assert r["answered"] == n, r
                row += f" {r['seconds']:.2f} | {r['seconds'] / bound:.2f} |"
            print(row, flush=True)
    finally:
        proc.kill()
        proc.wait()


def cmd_failover(args) -> None:
    """(c): ``memagent run`` over two fake servers; the second is killed once a share of the rows is written."""
    import tempfile

    from memagent.tokenization import load_tokenizer

    tok = load_tokenizer("smollm2")
    samples = fanout_samples(tok, args.samples, args.doc_tokens)
    (a, url_a), (b, url_b) = start_fake(args.latency), start_fake(args.latency)
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        inp.write_text("".join(json.dumps({"id": x.id, "question": x.question, "context": x.context}) + "\n"
                               for x in samples))
        cmd = [sys.executable, "-m", "memagent", "run", "--backend", "openai", "--model", "fake", "--tokenizer",
               "smollm2", "--chunk-tokens", "2000", "--memory-tokens", "256", "--final-tokens", "64", "--concurrency",
               str(args.concurrency), "--base-url", url_a, "--base-url", url_b, "--input", str(inp), "--output", str(out),
               "--timeout", str(args.timeout)]
        t0 = time.perf_counter()
        run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while run.poll() is None and (len(out.read_text().splitlines()) if out.exists() else 0) < args.kill_after:
                time.sleep(0.05)
            killed_at = len(out.read_text().splitlines()) if out.exists() else 0
            if args.hang:
                os.kill(b.pid, signal.SIGSTOP)  # hung: its socket still accepts connections, nothing answers
            else:
                b.kill()
                b.wait()
            _, stderr = run.communicate(timeout=600)
        finally:
            for p in (a, b):
                if args.hang:
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
        rows = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [r["sample_id"] for r in rows]
    summary = next((x for x in stderr.splitlines() if x.startswith("requests per server")), "")
    print(f"exit status {run.returncode}; {len(rows)} rows for {len(samples)} samples, {len(set(ids))} distinct, "
          f"{sum(r['status'] == 'ok' for r in rows)} ok; second server {'stopped (SIGSTOP)' if args.hang else 'killed'} "
          f"after {killed_at} rows; "
          f"{time.perf_counter() - t0:.1f} s")
    print(summary.replace(url_a, "A").replace(url_b, "B"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("tokenize", help="(a) agent vs raw tokenizer, peak memory")
    a.add_argument("--tokens", type=int, nargs="+", default=[8000, 100_000, 1_000_000, 3_500_000])
    a.add_argument("--chunk-tokens", type=int, default=5000)
    b = sub.add_parser("fanout", help="(b) requests in flight against a fake server, against the bound")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 128, 256])
    b.add_argument("--samples", type=int, default=128)
    b.add_argument("--samples-c1", type=int, default=4, help="samples at C=1 (each takes turns x latency)")
    b.add_argument("--doc-tokens", type=int, default=15000)
    b.add_argument("--latency", type=float, default=0.5)
    b.add_argument("--reference", default=None, help="a checkout of the reference implementation: run its eval "
                   "client side by side (needs the bench extra: aiohttp, uvloop)")
    ref = sub.add_parser("_reference_one")
    for name in ("repo", "url"):
        ref.add_argument(name)
    for name in ("n", "doc_tokens", "concurrency"):
        ref.add_argument(name, type=int)
    c = sub.add_parser("failover", help="(c) two servers, one killed mid-run")
    c.add_argument("--samples", type=int, default=64)
    c.add_argument("--doc-tokens", type=int, default=8000)
    c.add_argument("--concurrency", type=int, default=32)
    c.add_argument("--latency", type=float, default=0.2)
    c.add_argument("--kill-after", type=int, default=16, help="rows written before the second server is killed")
    c.add_argument("--hang", action="store_true", help="stop the second server with SIGSTOP instead (it accepts "
                   "connections and answers nothing) and let the read timeout find it")
    c.add_argument("--timeout", type=float, default=3.0, help="memagent run --timeout (seconds per request)")
    one = sub.add_parser("_tokenize_one")
    one.add_argument("tokens", type=int)
    one.add_argument("chunk_tokens", type=int)
    args = ap.parse_args()
    if args.cmd == "tokenize":
        cmd_tokenize(args)
    elif args.cmd == "fanout":
        cmd_fanout(args)
    elif args.cmd == "failover":
        cmd_failover(args)
    elif args.cmd == "_reference_one":
        print(json.dumps(reference_one(args.repo, args.url, args.n, args.doc_tokens, args.concurrency, 2000, 256)))
    elif args.cmd == "_tokenize_one":
        print(json.dumps(tokenize_one(args.tokens, args.chunk_tokens)))


if __name__ == "__main__":
    main()
