"""How much time does the agent loop add on top of the model calls?

Runs the memory agent over a long real document (a Gutenberg novel from the data root) with the embedded
llama.cpp backend, and compares the end-to-end wall time against the sum of the backend's own ``generate``
seconds measured side by side in the same run. Prints both, their ratio (target <= 1.05: chunking,
prompt rendering, budget checks and bookkeeping together cost at most 5 % over the model calls), and
document tokens per second.

    python benchmarks/agent_overhead.py --doc-tokens 20000 --chunk-tokens 2000 --memory-tokens 128
"""

from __future__ import annotations

import argparse
import time

from memagent.agent.loop import AgentConfig, MemoryAgent
from memagent.backends.llamacpp import LlamaCppBackend
from memagent.data.paths import data_file
from memagent.types import Sample


class TimedBackend:
    """Wraps a backend and adds up the wall seconds spent inside ``generate``."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, requests):
        t0 = time.perf_counter()
        try:
            return self.inner.generate(requests)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=20000, help="document length in tokens")
    ap.add_argument("--chunk-tokens", type=int, default=2000)
    ap.add_argument("--memory-tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=2, help="samples run together (batch)")
    ap.add_argument("--data-root", default=None)
    args = ap.parse_args()

    backend = TimedBackend(LlamaCppBackend(n_ctx=8192))
    tok = backend.tokenizer
    text = data_file("gutenberg_nltk/austen-emma.txt", args.data_root).read_text(encoding="utf-8")
    ids, bounds = tok.encode_with_offsets(text[: args.doc_tokens * 8])
    doc = text[: bounds[min(args.doc_tokens, len(ids))]]
    samples = [Sample(str(i), "Who does Emma try to match with Mr. Elton?", doc) for i in range(args.samples)]
    agent = MemoryAgent(backend, AgentConfig(chunk_tokens=args.chunk_tokens, memory_tokens=args.memory_tokens,
                                             final_tokens=64, batch_size=args.samples))
    t0 = time.perf_counter()
    trajs = agent.run(samples)
    total = time.perf_counter() - t0
    doc_tokens = sum(t.document_tokens for t in trajs)
    print(f"document: {trajs[0].document_tokens} tokens x {len(samples)} samples, {len(trajs[0].turns)} turns each")
    print(f"end-to-end seconds:        {total:.2f}")
    print(f"backend generate seconds:  {backend.seconds:.2f} ({backend.calls} batched calls)")
    print(f"ratio end-to-end/backend:  {total / backend.seconds:.4f}  (target <= 1.05)")
    print(f"document tokens per second: {doc_tokens / total:.1f}")
    backend.close()


if __name__ == "__main__":
    main()
