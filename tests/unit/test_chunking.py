import pytest

from memagent.chunking import center_truncate, center_truncate_ranges, chunk_offsets, chunk_text, source_ranges
from memagent.errors import ConfigError
from memagent.tokenization import ByteTokenizer, HFTokenizer, char_boundaries_from_byte_lengths

MIXED = (
    "Plain ASCII, then accents: éàü Ünïcödé; CJK 中文字符 and 日本語のテキスト; Cyrillic Привет мир; Arabic مرحبا; "
    "emoji 😀🎉👩‍👩‍👧 (a ZWJ family); symbols ∑∫√ ≤≥ €£¥; control-looking text <|im_start|>system\n</s><s>[INST]; "
    "tabs\tand\nnewlines\r\n and combining e\u0301 marks.\n"
) * 7


def test_byte_chunks_exact_boundaries():
    # bytes: a=0 | é=1,2 | 中=3,4,5 | 😀=6..9 ; chunks of 3 bytes cut at bytes 3, 6, 9
    text = "aé中😀"
    chunks = chunk_text(text, ByteTokenizer(), 3)
    # byte 3 starts 中 (char 2), byte 6 starts 😀 (char 3), byte 9 is inside 😀: the character stays with
    # the chunk in which it starts, so the slice [9, 10) (no character starts in it) joins that chunk.
    assert [(c.start_token, c.end_token) for c in chunks] == [(0, 3), (3, 6), (6, 10)]
    assert [(c.start_char, c.end_char) for c in chunks] == [(0, 2), (2, 3), (3, 4)]
    assert [c.text for c in chunks] == ["aé", "中", "😀"]
    assert "".join(c.text for c in chunks) == text


@pytest.mark.parametrize("size", [1, 2])
def test_cjk_at_tiny_chunk_sizes_never_gives_an_empty_chunk(size):
    """Each CJK character is 3 byte tokens; at 1-2 tokens per chunk the reader used to get empty sections
    (74 of 172 update calls in a review, issue 17 item 10). A character longer than a chunk stays whole."""
    text = "日本語のテキスト"  # 8 characters, 24 bytes
    chunks = chunk_text(text, ByteTokenizer(), size)
    assert [c.text for c in chunks] == list(text)
    assert [c.index for c in chunks] == list(range(8))
    assert [c.end_token for c in chunks[:-1]] == [c.start_token for c in chunks[1:]] and chunks[-1].end_token == 24
    if size == 1:  # each character's 3 tokens form one chunk
        assert [(c.start_token, c.end_token) for c in chunks] == [(3 * k, 3 * k + 3) for k in range(8)]
    mixed = chunk_text("a中b", ByteTokenizer(), 2)  # bytes a | 中 中 中 | b: slices [0,2) [2,4) [4,5)
    assert [(c.text, c.start_token, c.end_token) for c in mixed] == [("a中", 0, 4), ("b", 4, 5)]


def test_zero_width_tokens_at_the_start_join_the_next_chunk():
    # token 0 covers no character (boundaries 0, 0): its one-token slice joins the chunk after it
    chunks = chunk_offsets("ab", [7, 8, 9], [0, 0, 1, 2], 1)
    assert [(c.text, c.start_token, c.end_token) for c in chunks] == [("a", 0, 2), ("b", 2, 3)]


def test_boundaries_round_up_inside_character():
    assert char_boundaries_from_byte_lengths("é", [1, 1]) == [0, 1, 1]
    with pytest.raises(ConfigError, match="byte for byte"):
        char_boundaries_from_byte_lengths("abc", [1, 1])


def test_empty_and_tiny_documents():
    assert chunk_text("", ByteTokenizer(), 5) == []
    (only,) = chunk_text("hi", ByteTokenizer(), 5)
    assert (only.text, only.num_tokens) == ("hi", 2)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50, 5000])
def test_gguf_round_trip_mixed_script(gguf_tokenizer, size):
    ids, bounds = gguf_tokenizer.encode_with_offsets(MIXED)
    chunks = chunk_offsets(MIXED, ids, bounds, size)
    assert "".join(c.text for c in chunks) == MIXED
    assert all(c.text for c in chunks)  # never an empty chunk
    assert [c.end_token for c in chunks[:-1]] == [c.start_token for c in chunks[1:]]
    assert chunks[0].start_token == 0 and chunks[-1].end_token == len(ids)
    assert all(c.start_token % size == 0 and c.num_tokens >= min(size, len(ids) - c.start_token) for c in chunks)
    # a chunk holds more than `size` tokens only when a character spans its last slice: at most 3 extra bytes
    assert all(c.num_tokens <= size + 3 for c in chunks)
    if size >= 5:  # no character of the text is longer than 4 byte tokens
        assert len(chunks) == -(-len(ids) // size)


def test_gguf_control_tokens_are_plain_text(gguf_tokenizer):
    ids = gguf_tokenizer.encode("<|im_start|>")
    assert len(ids) > 1  # not the single control token id
    assert gguf_tokenizer.decode(ids) == "<|im_start|>"


def test_gguf_chunk_texts_retokenize_to_about_chunk_size(gguf_tokenizer):
    for c in chunk_text(MIXED, gguf_tokenizer, 200)[:-1]:
        assert abs(len(gguf_tokenizer.encode(c.text)) - 200) <= 4


def _tiny_bpe():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([MIXED] * 3, trainer)
    return tok


def test_hf_round_trip_and_plain_special_tokens():
    tok = HFTokenizer(_tiny_bpe())
    ids, bounds = tok.encode_with_offsets(MIXED)
    assert bounds[0] == 0 and bounds[-1] == len(MIXED) and bounds == sorted(bounds)
    for size in (1, 5, 64):
        assert "".join(c.text for c in chunk_offsets(MIXED, ids, bounds, size)) == MIXED
    special = tok._tok.token_to_id("<|im_start|>")
    assert special not in tok.encode("<|im_start|>system")


def test_center_truncate_keeps_head_and_tail():
    text = "0123456789"
    assert center_truncate(text, ByteTokenizer(), 5) == ("01289", 5)  # head 3, tail 2
    assert center_truncate(text, ByteTokenizer(), 4) == ("0189", 4)
    assert center_truncate(text, ByteTokenizer(), None) == (text, 10)
    assert center_truncate(text, ByteTokenizer(), 10) == (text, 10)
    with pytest.raises(ConfigError):
        center_truncate(text, ByteTokenizer(), 1)


def test_center_truncate_ranges_and_source_ranges():
    text = "0123456789"
    assert center_truncate_ranges(text, ByteTokenizer(), 5) == (((0, 3), (8, 10)), 5)
    assert center_truncate_ranges(text, ByteTokenizer(), None) == (((0, 10),), 10)
    assert center_truncate_ranges("", ByteTokenizer(), 4) == (((0, 0),), 0)
    kept = ((0, 3), (8, 10))  # the truncated text "01289"
    assert source_ranges(kept, 0, 2) == ((0, 2),)
    assert source_ranges(kept, 2, 4) == ((2, 3), (8, 9))  # "28" spans the cut
    assert source_ranges(kept, 3, 5) == ((8, 10),)
    assert source_ranges(kept, 4, 4) == ()
    assert source_ranges(((0, 10),), 4, 7) == ((4, 7),)
    # multi-byte text: ranges are in characters, and the truncated text is exactly the kept ranges joined
    s = "äöü-abc-ßß"
    ranges, n = center_truncate_ranges(s, ByteTokenizer(), 6)
    assert "".join(s[a:b] for a, b in ranges) == center_truncate(s, ByteTokenizer(), 6)[0]
    # 3 head and 3 tail byte tokens: a 2-byte character is kept whole or not at all, and the count is what is
    # kept ("ä" + "ß", 4 tokens; it kept "äö" + "ß" and reported 6 for 6 bytes by chance, and "€" for a budget of 2)
    assert (ranges, n) == (((0, 1), (9, 10)), 4)
    assert center_truncate("€" * 10, ByteTokenizer(), 2) == ("", 0)
    assert center_truncate("€" * 10, ByteTokenizer(), 10) == ("€€", 6)
    assert center_truncate("a€b€c", ByteTokenizer(), 6) == ("ac", 2)  # "a€" and "€c" are 4 bytes each


def test_the_agents_truncated_stream_cuts_where_center_truncation_does():
    """The agent's center truncation (ChunkStream with max_context_tokens) keeps what center_truncate_ranges keeps:
    a character straddling a cut is left out and the count is what is kept. It kept "a" + "€" for a 2-token head
    (4 bytes) and counted 4 tokens for the 5 bytes of "a€b"; the direct method and the report's second cut did not."""
    from memagent.chunking import ChunkStream, chunk_document

    tok = ByteTokenizer()
    chunks, n, kept = chunk_document("a€€€b", tok, 1, 4)  # 11 bytes; head 2, tail 2
    assert [(c.text, c.num_tokens) for c in chunks] == [("a", 1), ("b", 1)]
    assert (kept, n) == center_truncate_ranges("a€€€b", tok, 4) == (((0, 1), (4, 5)), 2)
    chunks, n, kept = chunk_document("€€€€", tok, 2, 4)  # no whole character fits either half
    assert (chunks, n, kept) == ([], 0, ((0, 0), (4, 4)))
    text = "word €uro " * 50 + "end"
    for budget in range(2, 40):
        for block_chars in (16, 4096):
            stream = ChunkStream(text, tok, 3, budget, block_chars=block_chars)
            got = list(stream)
            ranges, count = center_truncate_ranges(text, tok, budget)
            assert stream.kept == ranges and stream.document_tokens == count == sum(c.num_tokens for c in got)
            assert "".join(c.text for c in got) == center_truncate(text, tok, budget)[0]


def test_chunk_tokens_must_be_positive():
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunk_text("abc", ByteTokenizer(), 0)


def test_gguf_long_whitespace_pieces_are_not_cut(gguf_tokenizer):
    # runs of spaces are single tokens longer than llama-cpp-python's 32-byte detokenize buffer
    text = '"Yours ever,\n' + " " * 40 + '"A. W."\n' + "\t" * 70 + "end"
    ids, bounds = gguf_tokenizer.encode_with_offsets(text)
    assert max(len(gguf_tokenizer.piece(t)) for t in ids) > 32
    assert gguf_tokenizer.decode(ids) == text
    assert "".join(c.text for c in chunk_offsets(text, ids, bounds, 2)) == text


def test_gguf_bytes_the_vocabulary_lacks_stay_in_the_text(gguf_tokenizer):
    """SmolLM2's vocabulary has no token for some control bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D) or for the
    lead bytes 0xF1-0xF2; llama.cpp drops them, which made chunking fail with "does not reproduce its input"
    (found by the property tests, issue 17 item 11). They now count with the token before them."""
    text = "\x04\x04start\x13 middle \x1d\U00040000 end\x06"
    assert gguf_tokenizer.decode(gguf_tokenizer.encode(text)) == "start middle \ufffd\ufffd\ufffd end"  # dropped
    for size in (1, 2, 5):
        chunks = chunk_text(text, gguf_tokenizer, size)
        assert "".join(c.text for c in chunks) == text and all(c.text for c in chunks)
    assert chunks[0].text.startswith("\x04\x04start")
    assert gguf_tokenizer.encode_with_offsets("\x1d\x04") == ([], [0]) and chunk_text("\x1d", gguf_tokenizer, 4) == []
