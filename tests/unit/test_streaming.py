"""Streaming reading (issue 16): a document is tokenized block by block with the whole text's tokens, and its
chunks are cut as it is read, identical to the chunks of the whole text."""

from __future__ import annotations

import bisect
import io
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memagent.chunking import ChunkStream, chunk_document, chunk_offsets, kept_ranges
from memagent.data.sources import FileText, IterText, StreamText, document_source
from memagent.errors import DataError
from memagent.stitching import FORCE_AFTER_BLOCKS, string_pieces, text_blocks, token_blocks
from memagent.tokenization import ByteTokenizer, HFTokenizer

SCALE = float(os.environ.get("MEMAGENT_HYPOTHESIS_EXAMPLES", "1"))
EMMA = Path(os.environ.get("MEMAGENT_DATA", Path(__file__).resolve().parents[3] / "shared" / "data")) / \
    "gutenberg_nltk" / "austen-emma.txt"


def _settings(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# words and separators that stress the stitching rules: runs of spaces and newlines, CRLF, tabs, digits,
# contractions, punctuation, combining marks, CJK, emoji, control bytes some vocabularies lack
_WORDS = ["the", "Emma's", "12345", "3.14", "--", '."', "e\u0301t\u00e9", "中文字符", "日本語。", "😀🎉", "👩\u200d👧",
          "<|im_start|>", "\x04", "x\x1dy", "ÄÖÜ", "مرحبا", "ok!", "(a)", "_under_"]
_SEPS = [" ", " ", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \n", "\n ", ""]
TEXT = st.lists(st.tuples(st.sampled_from(_WORDS), st.sampled_from(_SEPS)), max_size=40).map(
    lambda xs: "".join(w + s for w, s in xs))


def _reference_chunks(text, tok, size, max_tokens=None):
    """The chunks of the whole text tokenized in one call (the rule :class:`ChunkStream` must reproduce)."""
    ids, bounds = tok.encode_with_offsets(text)
    n = len(ids)
    if max_tokens is None or n <= max_tokens:
        return chunk_offsets(text, ids, bounds, size), n
    # the cuts of center_truncate_ranges: a character straddling a cut is left out, so fewer tokens may be kept
    ((_, cut), (resume, _)), kept = kept_ranges(bounds, len(text), max_tokens)
    head = bisect.bisect_right(bounds, cut) - 1
    tail = n - (bisect.bisect_right(bounds, resume) - 1)
    short = text[:cut] + text[resume:]
    sb = list(bounds[: head + 1]) + [b - (resume - cut) for b in bounds[n - tail + 1:]]
    sb[-1] = len(short)
    return chunk_offsets(short, list(ids[:head]) + list(ids[n - tail:]), sb, size), kept


def _block_ids(tok, text, block_chars, piece_chars=7):
    return [t for b in token_blocks(tok, string_pieces(text, piece_chars), block_chars) for t in tok.encode(b.text)]


@pytest.fixture(scope="module")
def tiny_hf():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(_WORDS) * 5, "the Emma's 12345\n\n ok!  (a)"] * 4, trainer)
    return HFTokenizer(tok, name="tiny")


def test_blocks_cut_only_at_safe_positions_and_join_to_the_text():
    text = "aa bb\n\ncc  dd\nee ff"
    blocks = list(text_blocks(string_pieces(text, 3), 4))
    assert "".join(b for _, b in blocks) == text
    # the last safe cut at or before each multiple of 4: 2 (" bb": a single space between visible characters);
    # none in (2, 12] (never inside "\n\n" or "  ", whose tokens depend on what follows), so the block grows;
    # in (2, 16] the cuts are 14 (after one newline that follows a visible character) and 16, the last
    assert blocks == [(0, "aa"), (2, " bb\n\ncc  dd\nee"), (16, " ff")]
    assert [b for _, b in text_blocks(string_pieces(text, 1), 15)] == ["aa bb\n\ncc  dd\n", "ee ff"]


@_settings(300)
@given(buf=st.text(st.sampled_from(list("ab \n\t\r\x04\x7f中\u3000")), max_size=40), end=st.integers(0, 45))
def test_backward_search_finds_the_last_safe_cut_of_the_pattern(buf, end):
    from memagent.stitching import _SAFE_CUT, _last_cut, _last_match

    assert _last_cut(buf, end) == _last_match(buf, end, _SAFE_CUT)


@_settings(120)
@given(text=TEXT, block_chars=st.integers(16, 48), size=st.integers(1, 9))
def test_gguf_blocks_give_the_whole_texts_tokens_and_chunks(gguf_tokenizer, text, block_chars, size):
    assert _block_ids(gguf_tokenizer, text, block_chars) == gguf_tokenizer.encode(text)
    ref, n = _reference_chunks(text, gguf_tokenizer, size)
    stream = ChunkStream(text, gguf_tokenizer, size, block_chars=block_chars)
    assert list(stream) == ref and stream.document_tokens == n and stream.kept == ((0, len(text)),)


@_settings(120)
@given(text=TEXT, block_chars=st.integers(16, 48), size=st.integers(1, 9))
def test_hf_blocks_give_the_whole_texts_tokens_and_chunks(tiny_hf, text, block_chars, size):
    assert _block_ids(tiny_hf, text, block_chars) == tiny_hf.encode(text)
    assert list(ChunkStream(text, tiny_hf, size, block_chars=block_chars)) == _reference_chunks(text, tiny_hf, size)[0]


@_settings(150)
@given(text=TEXT, block_chars=st.integers(16, 48), size=st.integers(1, 9), budget=st.integers(2, 60))
def test_truncated_stream_matches_whole_text_truncation(gguf_tokenizer, text, block_chars, size, budget):
    ref, n = _reference_chunks(text, gguf_tokenizer, size, budget)
    stream = ChunkStream(IterText(string_pieces(text, 5)), gguf_tokenizer, size, budget, block_chars=block_chars)
    assert list(stream) == ref and stream.document_tokens == n
    kept = stream.kept
    assert "".join(text[a:b] for a, b in kept) == "".join(c.text for c in ref)


@pytest.mark.skipif(not EMMA.is_file(), reason="the Gutenberg data is not here")
def test_a_novel_streams_with_the_whole_texts_tokens(gguf_tokenizer):
    text = EMMA.read_text(encoding="utf-8")[:200_000]
    ids = gguf_tokenizer.encode(text)
    assert _block_ids(gguf_tokenizer, text, 4096, piece_chars=1000) == ids
    ref, _ = _reference_chunks(text, gguf_tokenizer, 500, 20_001)
    assert list(ChunkStream(text, gguf_tokenizer, 500, 20_001, block_chars=4096)) == ref
    assert len(ref) == 41 and sum(c.num_tokens for c in ref) == 20_001


def test_text_without_a_safe_cut_is_forced_and_still_joins():
    text = "中文字符日本語" * 200  # 1400 characters, no space or newline
    blocks = list(text_blocks(string_pieces(text, 50), 16, tokenizer=ByteTokenizer()))
    assert "".join(b for _, b in blocks) == text and len(blocks) > 1
    assert all(len(b) <= FORCE_AFTER_BLOCKS * 16 + 1 for _, b in blocks)
    chunks = list(ChunkStream(text, ByteTokenizer(), 7, block_chars=16))
    assert "".join(c.text for c in chunks) == text and all(c.text for c in chunks)


def test_chunks_are_cut_while_the_document_is_read():
    read = []

    def pieces():
        for k in range(1000):  # 1000 pieces of 90 characters
            read.append(k)
            yield f"word{k:04d} " * 10

    stream = iter(ChunkStream(IterText(pieces()), ByteTokenizer(), 300, block_chars=1024))
    first = next(stream)
    assert first.text == ("".join(f"word{k:04d} " * 10 for k in range(4)))[:300]
    assert len(read) <= 15  # a block or two, not the 1000 pieces
    rest = list(stream)
    assert len(read) == 1000 and sum(c.num_tokens for c in [first, *rest]) == 90_000 and len(rest) == 299


def test_chunk_document_is_the_stream_gathered(gguf_tokenizer):
    text = "One two three.\nFour five six seven. " * 40
    chunks, n, kept = chunk_document(text, gguf_tokenizer, 17, 101)
    ref, n_ref = _reference_chunks(text, gguf_tokenizer, 17, 101)
    assert chunks == ref and n == n_ref == 101
    assert kept[0][0] == 0 and kept[1][1] == len(text) and kept[0][1] < kept[1][0]


# ------------------------------------------------------------------------------------------- sources
def _text(source) -> str:
    return "".join(source.pieces())


def test_file_source_decodes_like_read_document_text(tmp_path):
    from memagent.data.io import read_document_text

    body = "Grüße, 世界! 😀 " * 9000  # about 150 KiB: several reads, characters split across them
    for codec, bom in (("utf-8", b""), ("utf-8", b"\xef\xbb\xbf"), ("utf-16-le", b"\xff\xfe"), ("utf-32-be", b"\x00\x00\xfe\xff")):
        p = tmp_path / f"doc-{codec}-{len(bom)}.txt"
        p.write_bytes(bom + body.encode(codec))
        assert _text(FileText(p)) == body == read_document_text(p)


def test_file_source_warns_on_bad_bytes_and_refuses_binary(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 au lait " * 10)
    warnings = []
    src = FileText(bad, warn=warnings.append)
    assert _text(src) == "caf\ufffd au lait " * 10 and _text(src) == "caf\ufffd au lait " * 10
    assert len(warnings) == 1 and "not valid UTF-8 (invalid continuation byte at byte 3)" in warnings[0]
    binary = tmp_path / "x.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match="looks like a binary file.*--allow-binary"):
        FileText(binary)
    late_nul = tmp_path / "late.txt"
    late_nul.write_bytes(b"text " * 20000 + b"\x00")
    with pytest.raises(DataError, match="NUL bytes \\(the first at byte 100000\\)"):
        _text(FileText(late_nul))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b" \n")
    seen = []
    FileText(empty, warn=seen.append)
    assert seen == [f"the document ({empty}) is empty or whitespace only: the memory learns nothing from it, the answer rests on the question alone"]
    with pytest.raises(DataError, match="is not a file"):
        FileText(tmp_path / "missing.txt")


def test_stream_and_iterator_sources_are_read_once():
    s = StreamText(io.BytesIO("première ligne\n".encode() * 9000), "stdin")
    assert _text(s) == "première ligne\n" * 9000
    with pytest.raises(DataError, match="stdin was read already"):
        _text(s)
    it = IterText(iter(["a ", "b"]))
    assert _text(it) == "a b"
    with pytest.raises(DataError, match="piece 1 is of type int"):
        _text(IterText(["a", 3]))
    assert document_source("plain") == "plain" and document_source(None) is None
    for not_text in ({"a": 1}, {"a", "b"}, 3):  # a mapping's keys or a set's order are no document
        assert document_source(not_text) is not_text  # left for the agent to refuse by its type


def test_agent_answers_the_same_from_a_string_a_path_a_stream_and_an_iterator(tmp_path):
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.scripted import ScriptedBackend

    doc = "".join(f"Line {k}: the key is {k * 7}.\n" for k in range(400))
    p = tmp_path / "doc.txt"
    p.write_text(doc, encoding="utf-8")
    agent = MemoryAgent(ScriptedBackend(), AgentConfig(chunk_tokens=500, memory_tokens=400, max_context_tokens=3001))
    base = agent.answer("What is the key?", doc)
    for document in (p, open(p, "rb"), iter(string_pieces(doc, 333)), open(p, encoding="utf-8"), io.StringIO(doc)):
        got = agent.answer("What is the key?", document)
        assert got.answer == base.answer and got.document_tokens == base.document_tokens == 3001
        assert [t.context_chars for t in got.turns] == [t.context_chars for t in base.turns]
    spans = [t.context_chars for t in base.turns if t.kind == "update"]
    assert len(spans) == 7 and len(spans[3]) == 2  # the fourth chunk spans the cut: two ranges of the document


def test_token_ids_are_kept_only_when_asked():
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.scripted import ScriptedBackend

    doc = "alpha beta gamma " * 20
    kept = MemoryAgent(ScriptedBackend(), AgentConfig(chunk_tokens=100)).answer("q?", doc)
    dropped = MemoryAgent(ScriptedBackend(), AgentConfig(chunk_tokens=100), keep_token_ids=False).answer("q?", doc)
    assert len(kept.turns[0].prompt_token_ids) == kept.turns[0].prompt_tokens > 100  # the chunk's 100 bytes and more
    assert all(t.prompt_token_ids is None and t.response_token_ids is None for t in dropped.turns)
    assert [t.memory for t in kept.turns] == [t.memory for t in dropped.turns] and len(dropped.turns) == 5
