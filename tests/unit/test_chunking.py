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
    assert [(c.start_token, c.end_token) for c in chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # byte 3 starts 中 (char 2), byte 6 starts 😀 (char 3), byte 9 is inside 😀: the character stays with
    # the chunk in which it starts, so the last chunk holds one token and no text.
    assert [(c.start_char, c.end_char) for c in chunks] == [(0, 2), (2, 3), (3, 4), (4, 4)]
    assert [c.text for c in chunks] == ["aé", "中", "😀", ""]
    assert "".join(c.text for c in chunks) == text


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
    assert len(chunks) == -(-len(ids) // size)
    assert all(c.num_tokens == size for c in chunks[:-1])
    assert sum(c.num_tokens for c in chunks) == len(ids)
    assert [c.start_token for c in chunks] == list(range(0, len(ids), size))


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
    assert "".join(s[a:b] for a, b in ranges) == center_truncate(s, ByteTokenizer(), 6)[0] and n == 6


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
