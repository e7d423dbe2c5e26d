"""Evidence positions kept at build time (metadata["evidence"]): each span's text is the needle, assignment or
paragraph it names, and recording them left the built contexts, questions and answers byte for byte as before."""

import hashlib
import json
import re

import pytest

from memagent.data.hotpotqa import HotpotRecord, build_pool, build_sample
from memagent.data.ruler import build_ruler_sample
from memagent.data.schema import document_spans, joined_spans, render_documents
from memagent.data.ruler.common import insert_at_fractions, inserted_indices
from memagent.tokenization import ByteTokenizer
from memagent.train.synthetic import needle_sample

NIAH = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multivalue", "niah_multiquery"]

#: sha256 of [id, question, context, answers] of samples built before evidence was recorded (SmolLM2 tokenizer,
#: seed 42, 2048 tokens, sample 0), so the metadata change provably changed nothing the model reads.
GOLDEN = {
    "niah_single_1": "fcde5b55ff8c57da", "niah_single_2": "8732b94de0bfca93", "niah_single_3": "a75fc9a3072d9aa0",
    "niah_multikey_1": "ee8bec21364d8c26", "niah_multikey_2": "a1480e7fdd9ac194", "niah_multikey_3": "9e88f708c0e1ef4d",
    "niah_multivalue": "336e74c939427461", "niah_multiquery": "b73ed5a0ce1c47ec", "vt": "2c234610405e7f70",
    "qa_1": "7fcda4c4a888c92c", "qa_2": "12b44c75cb857b2b", "cwe": "1d7bef05d776a4e0", "fwe": "f235747b3493a766",
}


def _digest(s) -> str:
    return hashlib.sha256(json.dumps([s.id, s.question, s.context, list(s.answers)]).encode()).hexdigest()[:16]


def _check_spans(s):
    for e in s.metadata["evidence"]:
        assert s.context[e["start_char"] : e["end_char"]] == e["text"]
        assert set(e) >= {"start_char", "end_char", "text", "kind"}
    json.dumps(s.metadata)  # JSON-ready


def test_joined_and_document_spans():
    parts = ["ab", "c", "", "def"]
    assert joined_spans(parts, "--", [3, 0, 1]) == [(9, 12), (0, 2), (4, 5)]  # "ab--c----def"
    docs = ["x", "yz"]
    text = render_documents(docs)  # "Document 1:\nx\n\nDocument 2:\nyz"
    assert document_spans(docs) == [(12, 13), (27, 29)]
    assert [text[a:b] for a, b in document_spans(docs)] == docs


def test_inserted_indices_follow_insert_at_fractions():
    items = [f"h{i}" for i in range(10)]
    fractions = [0.75, 0.0, 0.31, 0.31, 1.0]
    out = insert_at_fractions(items, ["A", "B", "C", "D", "E"], fractions)
    idx = inserted_indices(len(items), fractions)
    assert idx == [0, 4, 5, 10, 14]  # sorted positions 0, 3, 3, 7, 10 plus the inserts before each
    assert [out[i] for i in idx] == ["A", "B", "C", "D", "E"]


@pytest.mark.parametrize("task", list(GOLDEN))
def test_contexts_unchanged_and_spans_are_the_evidence(task, gguf_tokenizer, data_root):
    s = build_ruler_sample(task, 2048, 0, gguf_tokenizer, seed=42, data_root=str(data_root))
    assert _digest(s) == GOLDEN[task]
    if task in ("cwe", "fwe"):  # aggregate tasks: no single place holds the answer
        assert "evidence" not in s.metadata
        return
    _check_spans(s)
    ev = s.metadata["evidence"]
    assert [e["start_char"] for e in ev] == sorted(e["start_char"] for e in ev)
    if task in NIAH:
        vtype = "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"
        assert sorted(e["answer"] for e in ev) == sorted(s.answers)  # one needle per gold value, distractors left out
        for e in ev:
            assert e["kind"] == "needle" and e["key"] in s.question
            assert e["text"] == f"One of the special magic {vtype} for {e['key']} is: {e['answer']}."
    elif task == "vt":
        names = s.answers
        value = re.search(r"value (\d{5})", s.question).group(1)
        assert [e["text"] for e in ev] == [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(4)]
        assert [e["answer"] for e in ev] == list(names) and [e["hop"] for e in ev] == [0, 1, 2, 3, 4]
    else:  # qa: gold paragraphs are whole documents
        assert len(ev) == (1 if task == "qa_1" else 2)
        for e in ev:
            assert e["kind"] == "gold_paragraph"
            assert s.context[: e["start_char"]].endswith(f"Document {e['document']}:\n")
            assert s.context[e["end_char"] :][:2] in ("", "\n\n")
        if task == "qa_1":
            assert any(a in ev[0]["text"] for a in s.answers)


def test_hotpotqa_supporting_paragraphs():
    paragraphs = tuple((f"T{k}", f"Text {k} says ans{k}.") for k in range(4))
    rec = HotpotRecord("7", "Q?", "ans2", paragraphs, frozenset({"T0", "T2"}))
    other = HotpotRecord("8", "R?", "x", tuple((f"U{k}", f"Other {k}.") for k in range(30)), frozenset())
    pool = build_pool([rec, other], name="toy")
    s = build_sample(rec, pool, ByteTokenizer(), seed=3, num_docs=12)
    _check_spans(s)
    ev = s.metadata["evidence"]
    assert sorted(e["text"] for e in ev) == ["T0\nText 0 says ans0.", "T2\nText 2 says ans2."]
    assert sorted(e["document"] for e in ev) == s.metadata["gold_positions"]
    assert all(e["kind"] == "supporting_paragraph" and "answer" not in e for e in ev)


def test_real_hotpotqa_unchanged(gguf_tokenizer, data_root):
    from memagent.data import paths
    from memagent.data.hotpotqa import load_hotpotqa, select_records

    recs = load_hotpotqa(paths.data_file(paths.HOTPOTQA_DEV, data_root))
    pool = build_pool(recs, name="hotpotqa-dev")
    r = select_records(recs, 1, keep_incomplete=True)[0]
    a = build_sample(r, pool, gguf_tokenizer, 0, num_docs=20)
    b = build_sample(r, pool, gguf_tokenizer, 0, target_tokens=3000)
    assert (_digest(a), _digest(b)) == ("afd213deed894628", "9038a485ad937059")
    for s in (a, b):
        _check_spans(s)
        assert [e["document"] for e in s.metadata["evidence"]] == s.metadata["gold_positions"]


def test_synthetic_needle_evidence():
    s = needle_sample(0, 200, seed=1, prefix="val1x")
    assert _digest(s) == "9f8fd9412a36410b"
    _check_spans(s)
    (e,) = s.metadata["evidence"]
    assert e["text"] == f"The special magic number for {e['key']} is {s.answers[0]}." and e["answer"] == s.answers[0]
