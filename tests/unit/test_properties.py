"""Property-based tests (hypothesis) of the invariants that matter most (issue 17, item 11).

Deterministic (``derandomize=True``: the same examples every run) and small (``max_examples`` per test), so
the suite stays quick; raise ``MEMAGENT_HYPOTHESIS_EXAMPLES`` to search harder locally.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memagent.answers import extract_answer, last_boxed, strip_reasoning
from memagent.chunking import center_truncate, chunk_text
from memagent.data.io import read_samples
from memagent.errors import DataError
from memagent.tokenization import ByteTokenizer
from memagent.types import Sample
from memagent.verifiers import VERIFIERS

SCALE = float(os.environ.get("MEMAGENT_HYPOTHESIS_EXAMPLES", "1"))


def _settings(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# Pieces that break naive text handling: combining marks, ZWJ emoji sequences, flags, skin tones, CJK, RTL,
# control characters, CRLF, a BOM, astral characters, a lone surrogate.
_TRICKY = ["e\u0301", "\u0301", "👩\u200d👩\u200d👧", "🇫🇷", "👍🏽", "中文", "日本語", "مرحبا", "\x00", "\x1f", "\r\n", "\t",
           "\ufeff", "\U0001F600", "\U0010FFFF", "<|im_start|>", "\\boxed{", "}", "\ud800", "\udfff", " ", "\n"]
TEXT = st.lists(st.one_of(st.sampled_from(_TRICKY), st.text(st.characters(exclude_categories=()), max_size=8)),
                max_size=24).map("".join)
CLEAN_TEXT = TEXT.map(lambda t: "".join(c for c in t if not 0xD800 <= ord(c) <= 0xDFFF))


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _check_chunks(text: str, chunks, n_tokens: int, size: int) -> None:
    assert "".join(c.text for c in chunks) == text
    assert all(c.text for c in chunks)  # never an empty chunk
    assert [c.index for c in chunks] == list(range(len(chunks)))
    if chunks:
        assert chunks[0].start_token == 0 and chunks[-1].end_token == n_tokens
        assert [c.end_token for c in chunks[:-1]] == [c.start_token for c in chunks[1:]]
        assert [c.end_char for c in chunks[:-1]] == [c.start_char for c in chunks[1:]]
    for c in chunks:
        assert c.start_token % size == 0
        assert min(size, n_tokens - c.start_token) <= c.num_tokens <= size + 3  # + a character's other bytes


@_settings(300)
@given(TEXT, st.integers(1, 40))
def test_byte_chunking_round_trips_any_text(text, size):
    tok = ByteTokenizer()
    if _has_surrogate(text):
        with pytest.raises(DataError, match="lone surrogate"):
            chunk_text(text, tok, size)
        return
    _check_chunks(text, chunk_text(text, tok, size), len(text.encode("utf-8")), size)


@pytest.mark.slow
@_settings(150)
@given(text=CLEAN_TEXT, size=st.integers(1, 12))
def test_gguf_chunking_round_trips_any_text(gguf_tokenizer, text, size):
    ids, _ = gguf_tokenizer.encode_with_offsets(text)
    chunks = chunk_text(text, gguf_tokenizer, size)
    if not ids:  # only bytes the vocabulary has no token for: the model sees nothing, and there is no chunk
        assert chunks == []
        return
    _check_chunks(text, chunks, len(ids), size)


@_settings(200)
@given(CLEAN_TEXT, st.integers(2, 30))
def test_center_truncation_keeps_a_prefix_and_a_suffix(text, budget):
    out, n = center_truncate(text, ByteTokenizer(), budget)
    total = len(text.encode("utf-8"))
    assert n == len(out.encode("utf-8")) <= min(total, budget)  # the count is what is kept, never over the budget
    assert n >= min(total, budget) - 6  # at most one character of up to 4 bytes is left out at each side
    if total <= budget:
        assert out == text
    else:
        head = next(k for k in range(len(out) + 1) if not text.startswith(out[: k + 1]) or k == len(out))
        assert text.startswith(out[:head]) and text.endswith(out[head:])


@_settings(400)
@given(TEXT)
def test_answer_extraction_never_raises(text):
    got = extract_answer(text)
    assert got.method in ("boxed", "answer_is", "raw", "empty")
    assert (got.method == "empty") == (got.answer == "")
    body = strip_reasoning(text)
    assert got.answer in body or got.method == "boxed"  # a \text{} wrapper is removed from a box
    if got.method == "raw":
        assert got.answer == body.strip()
    last_boxed(text)


@_settings(300)
@given(TEXT, st.lists(TEXT, max_size=3))
def test_verifiers_never_raise_and_score_in_0_1(prediction, answers):
    for name in VERIFIERS.names():
        score = VERIFIERS.get(name)(prediction, answers)
        assert isinstance(score, float) and 0.0 <= score <= 1.0, (name, score)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
FIELDS = ["id", "question", "context", "answers", "answer", "metadata", "documents", "input", "outputs", "index",
          "prompt", "reward_model", "extra_info"]
RECORD = st.dictionaries(st.sampled_from(FIELDS), JSON | TEXT, max_size=6)


def _read_or_data_error(path) -> None:
    try:
        samples = read_samples(path)
    except DataError:
        return
    assert all(isinstance(s, Sample) and isinstance(s.question, str) and isinstance(s.context, str) for s in samples)
    assert all(not _has_surrogate(s.context + s.question + s.id) for s in samples)


@_settings(150)
@given(st.binary(max_size=300), st.sampled_from([".jsonl", ".json", ".parquet"]))
def test_sample_readers_never_give_a_traceback_on_random_bytes(tmp_path_factory, data, ext):
    p = tmp_path_factory.mktemp("bytes") / f"s{ext}"
    p.write_bytes(data)
    _read_or_data_error(p)


@_settings(250)
@given(st.lists(RECORD | JSON, max_size=4), st.booleans())
def test_sample_readers_never_give_a_traceback_on_odd_records(tmp_path_factory, records, as_jsonl):
    folder = tmp_path_factory.mktemp("records")
    if as_jsonl:
        p = folder / "s.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in records))  # ensure_ascii: surrogates as \ud800 escapes
    else:
        p = folder / "s.json"
        p.write_text(json.dumps(records))
    _read_or_data_error(p)


@_settings(150)
@given(text=CLEAN_TEXT, size=st.integers(1, 12))
def test_hf_chunking_round_trips_any_text(tiny, text, size):
    from memagent.tokenization import HFTokenizer

    tok = HFTokenizer(tiny[1], name="tiny")
    ids, _ = tok.encode_with_offsets(text)
    chunks = chunk_text(text, tok, size)
    if not ids:
        assert chunks == [] and text == ""
        return
    _check_chunks(text, chunks, len(ids), size)
