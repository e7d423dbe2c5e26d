"""The RULER-family training-data builder: fresh draws, another haystack, random starts, exact lengths."""

from __future__ import annotations

import re

import pytest

from memagent.data.ruler import build_ruler_sample
from memagent.data.ruler.common import haystack_text
from memagent.data.ruler.niah import build_niah
from memagent.data.ruler.train import build_training_set
from memagent.errors import DataError


def test_start_word_zero_is_the_evaluation_sample(gguf_tokenizer, data_root):
    a = build_ruler_sample("niah_single_2", 1024, 0, gguf_tokenizer, seed=42, data_root=str(data_root))
    b = build_niah("niah_single_2", 1024, 0, gguf_tokenizer, seed=42, data_root=str(data_root), start_word=0)
    assert a == b and a.context == b.context and a.answers == b.answers


def test_start_word_moves_the_haystack_and_keeps_the_length(gguf_tokenizer, data_root):
    words = haystack_text("gutenberg", str(data_root)).split(" ")
    start = 123_456
    s = build_niah("niah_single_2", 1024, 0, gguf_tokenizer, seed=1, haystack="gutenberg",
                   data_root=str(data_root), start_word=start)
    assert s.context.startswith(" ".join(words[start:start + 5]))
    assert s.metadata["length_tokens"] <= 1024 - 128
    assert s.metadata["length_tokens"] >= 1024 - 128 - 20  # fitted within the builder's tolerance
    # the needle is in the context, the gold value in the needle
    assert f"is: {s.answers[0]}." in s.context
    # a start near the end wraps around to the text's beginning
    w = build_niah("niah_single_2", 1024, 0, gguf_tokenizer, seed=1, haystack="gutenberg",
                   data_root=str(data_root), start_word=len(words) - 10)
    assert w.context.startswith(" ".join(words[-10:-5])) and words[0] in w.context


def test_training_set_is_fresh_mixed_and_deterministic(gguf_tokenizer, data_root):
    train = build_training_set(["niah_single_2", "niah_multikey_1", "vt"], [1024, 1536], 6, gguf_tokenizer,
                               seed=1, data_root=str(data_root))
    assert [s.metadata["task"] for s in train] == ["niah_single_2", "niah_multikey_1", "vt"] * 2
    assert all(s.id.startswith("train-") and s.metadata["split"] == "train" for s in train)
    assert {s.metadata["target_tokens"] for s in train} <= {1024, 1536}
    for s in train:
        budget = s.metadata["target_tokens"] - s.metadata["tokens_to_generate"]
        assert budget - 20 <= s.metadata["length_tokens"] <= budget
    essays = haystack_text("essay", str(data_root))
    for s in train[:2] + train[3:5]:  # niah: Gutenberg prose from a random start, never the essays
        assert s.metadata["haystack"] == "gutenberg" and s.metadata["start_word"] is not None
        assert s.context[:200] not in essays
    assert train[2].metadata["start_word"] is None  # vt keeps its noise haystack
    again = build_training_set(["niah_single_2", "niah_multikey_1", "vt"], [1024, 1536], 6, gguf_tokenizer,
                               seed=1, data_root=str(data_root))
    assert [s.context for s in again] == [s.context for s in train]
    other = build_training_set(["niah_single_2"], [1024], 1, gguf_tokenizer, seed=2, data_root=str(data_root))
    assert other[0].answers != train[0].answers
    evaluation = build_ruler_sample("niah_single_2", 1024, 0, gguf_tokenizer, seed=42, data_root=str(data_root))
    assert evaluation.context != train[0].context


def test_training_set_refuses_other_tasks(gguf_tokenizer):
    with pytest.raises(DataError, match="qa_1"):
        build_training_set(["qa_1"], [1024], 1, gguf_tokenizer)
    with pytest.raises(DataError, match="not RULER task names"):
        build_training_set(["niah_singel_2"], [1024], 1, gguf_tokenizer)
    with pytest.raises(DataError, match="at least one"):
        build_training_set(["vt"], [], 1, gguf_tokenizer)


def test_min_depth_keeps_every_needle_deep(gguf_tokenizer, data_root):
    shallow = build_training_set(["niah_single_2", "niah_multikey_1"], [2048], 8, gguf_tokenizer, seed=1,
                                 data_root=str(data_root))
    deep = build_training_set(["niah_single_2", "niah_multikey_1", "niah_single_1"], [2048], 9, gguf_tokenizer, seed=1,
                              data_root=str(data_root), min_depth=50)
    assert min(e["start_char"] / len(s.context) for s in shallow for e in s.metadata["evidence"]) < 0.3
    for s in deep:
        assert s.metadata["min_depth"] == 50
        needles = [m.start() for m in re.finditer(r"One of the special magic numbers for ", s.context)]
        assert len(needles) == (4 if s.metadata["task"] == "niah_multikey_1" else 1)  # distractor keys too
        # prose: at a sentence boundary at or after 50 % of the words; noise: at or after half of the lines
        assert all(p / len(s.context) > 0.45 for p in needles), (s.id, [p / len(s.context) for p in needles])
        assert f"is: {s.answers[0]}." in s.context[len(s.context) // 2 - 200:]
    with pytest.raises(DataError, match="min_depth applies to the niah tasks only"):
        build_training_set(["vt"], [1024], 1, gguf_tokenizer, min_depth=30)
    with pytest.raises(DataError, match=r"in \[0, 100\]"):
        build_niah("niah_single_2", 1024, 0, gguf_tokenizer, min_depth=101, data_root=str(data_root))
    with pytest.raises(DataError, match="leaves 1 of RULER's depths for 4 needles"):
        build_niah("niah_multikey_1", 1024, 0, gguf_tokenizer, min_depth=100, data_root=str(data_root))


def test_distractors_before_puts_other_keys_needles_first(gguf_tokenizer, data_root):
    def needle_keys(s):  # keys of the needles in context order
        return re.findall(r"One of the special magic numbers for (\S+) is: \d+\.", s.context)

    plain = build_training_set(["niah_multikey_1"], [1024], 12, gguf_tokenizer, seed=1, data_root=str(data_root))
    asked_first = [needle_keys(s).index(s.metadata["evidence"][0]["key"]) == 0 for s in plain]
    assert any(asked_first)  # RULER's order: the asked key is sometimes the first needle
    mixed = build_training_set(["niah_single_2", "niah_multikey_1"], [1024], 24, gguf_tokenizer, seed=1,
                               data_root=str(data_root), distractors_before=2)
    for s in mixed:
        keys = needle_keys(s)
        if s.metadata["task"] == "niah_single_2":  # one key: built as usual
            assert s.metadata["distractors_before"] == 0 and len(keys) == 1
            continue
        asked = s.metadata["evidence"][0]["key"]
        assert s.metadata["distractors_before"] == 2 and len(keys) == 4 and keys.count(asked) == 1
        assert keys.index(asked) >= 2, (s.id, keys, asked)
        assert f"for {asked} is: {s.answers[0]}." in s.context
    # samples whose asked needle was already deep enough keep every draw of RULER's order
    again = build_training_set(["niah_multikey_1"], [1024], 12, gguf_tokenizer, seed=1, data_root=str(data_root),
                               distractors_before=1)
    for a, b in zip(plain, again):
        assert (a.context == b.context) == (needle_keys(a).index(a.metadata["evidence"][0]["key"]) != 0)
    with pytest.raises(DataError, match="none of .*niah_single_2"):
        build_training_set(["niah_single_2"], [1024], 1, gguf_tokenizer, distractors_before=1)
    with pytest.raises(DataError, match="niah_multikey_1 has 4 key"):
        build_niah("niah_multikey_1", 1024, 0, gguf_tokenizer, distractors_before=4, data_root=str(data_root))
    with pytest.raises(DataError, match="niah_multivalue has 1 key"):
        build_niah("niah_multivalue", 1024, 0, gguf_tokenizer, distractors_before=1, data_root=str(data_root))


def test_distractors_after_keeps_other_keys_needles_behind_the_asked_one(gguf_tokenizer, data_root):
    def asked_place(s):  # (index of the asked key's needle, number of needles), in context order
        keys = re.findall(r"One of the special magic numbers for (\S+) is: \d+\.", s.context)
        return keys.index(s.metadata["evidence"][0]["key"]), len(keys)

    before = build_training_set(["niah_multikey_1"], [1024], 16, gguf_tokenizer, seed=3, data_root=str(data_root),
                                distractors_before=1)
    both = build_training_set(["niah_multikey_1"], [1024], 16, gguf_tokenizer, seed=3, data_root=str(data_root),
                              distractors_before=1, distractors_after=1)
    places = [asked_place(s) for s in both]
    assert all(n == 4 and 1 <= at <= 2 for at, n in places), places  # never first, never last of the 4 needles
    assert {at for at, _ in places} == {1, 2}
    assert all(s.metadata["distractors_after"] == 1 and f"is: {s.answers[0]}." in s.context for s in both)
    # samples whose asked needle was already in the middle keep every draw of --distractors-before 1 alone
    for a, b in zip(before, both):
        assert (a.context == b.context) == (asked_place(a)[0] < 3)
    with pytest.raises(DataError, match="more keys than their sum; niah_multikey_1 has 4 key"):
        build_niah("niah_multikey_1", 1024, 0, gguf_tokenizer, distractors_before=2, distractors_after=2,
                   data_root=str(data_root))
    with pytest.raises(DataError, match="distractors_after=1 apply to tasks with distractor keys"):
        build_training_set(["niah_single_2"], [1024], 1, gguf_tokenizer, distractors_after=1)
