"""Memory diagnostics: containment, repetition, word diffs, capture / retention / outcome classes on hand-built
traces, cell aggregation, and a whole run folder through `memagent report` (CSV columns, missing traces)."""

import csv
import json
import re

import pytest

from memagent.backends.scripted import ScriptedBackend
from memagent.data.io import write_samples
from memagent.data.schema import evidence_item
from memagent.errors import DataError
from memagent.eval.diagnostics import (
    contains,
    diagnose_agent,
    diagnose_direct,
    distractor_answer,
    distractors_before,
    first_distractor_answer,
    format_split,
    early_guess,
    memory_health,
    numbers,
    repeated_ngram_share,
    summarize_diagnostics,
    targets_of,
)
from memagent.eval.html import word_diff
from memagent.eval.grid import EvalConfig
from memagent.eval.runner import EvalRunner
from memagent.types import Sample


def test_contains_is_normalised_and_word_bounded():
    assert contains("The magic number is: 1234567.", "1234567")
    assert not contains("The magic number is 12345678", "1234567")
    # a number is matched whole in the raw text: punctuation bounds it and does not join digits
    assert all(contains(t, "1234567") for t in ("x:1234567", "x=1234567", "1234567/7654321", "(1234567)"))
    assert not any(contains(t, "1234567") for t in ("123-4567", "12345.67", "1234,567", "91234567"))
    assert contains("VAR ABCDE = VAR XYZQW", "abcde") and not contains("VAR ABCDEF", "ABCDE")
    assert contains("Moved to New-York City", "new york city") is False  # the hyphen joins the words
    assert contains("He lives in the U.S.A. now", "usa")
    assert contains("a note", "A") and not contains("an other", "a")  # an articles-only gold keeps its articles
    assert not contains("", "x") and not contains("anything", "")


def test_repeated_ngram_share():
    assert repeated_ngram_share("a b c d a b c d") == pytest.approx(0.2)  # 5 four-grams, 4 distinct
    assert repeated_ngram_share("one two three four five") == 0.0
    assert repeated_ngram_share("too short here") is None
    assert repeated_ngram_share("X y, z w. x Y z W x y z w") == pytest.approx(1 - 4 / 9)  # case and punctuation ignored


def test_word_diff_reconstructs_both_sides():
    old, new = "The key is 123.\nNothing else.", "The key is 123.\nThe value 42 too.\n"
    ops = word_diff(old, new)
    assert "".join(t for op, t in ops if op != "-") == new
    assert "".join(t for op, t in ops if op != "+") == old
    assert ("=", "The key is 123.\n") in ops and ("-", "Nothing else.") in ops
    assert word_diff("", "a b") == [("+", "a b")] and word_diff("same", "same") == [("=", "same")]
    # a word stays kept when only the whitespace after it changes
    assert word_diff("is 3144857.", "is 3144857.\n\nis 3144857.") == [("=", "is 3144857."), ("+", "\n\nis 3144857.")]


def _ctx():
    # 0....:....1....:....2....:....3....:....4....:....5....:....6
    ctx = "filler text. The code for owl is 7654321. more filler text here."
    a = ctx.index("The code")
    b = ctx.index("7654321.") + len("7654321.")
    return ctx, [evidence_item(ctx, a, b, "needle", answer="7654321", key="owl")]


def test_targets_of_stated_alias_and_unmeasurable():
    ctx, ev = _ctx()
    (t,), note = targets_of(ctx, ["7654321"], {"evidence": ev})
    assert (t.label, t.aliases, t.spans, note) == ("7654321", ("7654321",), ((13, 41),), "")
    para = [evidence_item(ctx, 0, 41, "supporting_paragraph")]
    (t,), _ = targets_of(ctx, ["7654321", "seven"], {"evidence": para})  # aliases: the gold answers stated in the paragraph
    assert t.aliases == ("7654321", "seven") and t.spans == ((0, 41),)
    assert targets_of(ctx, ["yes"], {"evidence": para}) == ([], "the gold answer is yes/no or empty: its capture cannot be told by containment")
    assert targets_of(ctx, ["Paris"], {"evidence": para})[1] == "no evidence span states the gold answer literally"
    assert targets_of(ctx, ["x"], {})[1] == "no evidence positions in the sample's metadata"
    with pytest.raises(DataError, match=r"evidence\[0\]\.text is not the context's text at \[0, 4\)"):
        targets_of(ctx, ["x"], {"evidence": [{"start_char": 0, "end_char": 4, "text": "nope"}]})
    with pytest.raises(DataError, match=r"evidence\[0\] needs integer start_char <= end_char within the context \(0\.\.64\)"):
        targets_of(ctx, ["x"], {"evidence": [{"start_char": 5, "end_char": 99}]})


def _turns(memories, chunks, finish=None, tokens=None):
    rows = [{"kind": "update", "chunk_index": k, "chunk_chars": list(c[0]) if len(c) == 1 else None,
             "context_chars": [list(r) for r in c], "memory": m, "finish_reason": (finish or {}).get(k, "stop"),
             "completion_tokens": (tokens or {}).get(k, 5)} for k, (m, c) in enumerate(zip(memories, chunks))]
    return rows + [{"kind": "final", "chunk_index": None, "memory": memories[-1], "finish_reason": "stop"}]


CHUNKS = [[(0, 20)], [(20, 45)], [(45, 64)]]  # the needle [13, 41) ends in chunk 1


def _row(score=0.0, status="ok", answer=None):
    return {"method": "m", "task": "t", "length": 1, "sample_id": "s", "status": status, "score": score, "answer": answer}


@pytest.mark.parametrize("memories, score, outcome, captured, retained, lost_at", [
    (["", "owl 7654321", "owl 7654321 kept"], 1.0, "correct", True, True, None),
    (["", "owl 7654321", "owl 7654321 kept"], 0.0, "retained_wrong", True, True, None),
    (["", "owl is 7654321", "something else"], 0.0, "captured_then_lost", True, False, 2),
    (["", "nothing", "still nothing"], 0.0, "never_captured", False, False, None),
    (["7654321?", "nothing", "7654321 again"], 0.0, "retained_wrong", False, True, None),  # held at the end, not at its chunk
])
def test_agent_outcomes(memories, score, outcome, captured, retained, lost_at):
    ctx, ev = _ctx()
    sample = {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}
    d = diagnose_agent(_row(score), sample, _turns(memories, CHUNKS))
    assert (d.outcome, d.read, d.captured, d.retained, d.lost_at) == (outcome, True, captured, retained, lost_at)
    assert d.targets[0].evidence_chunks == [1]
    assert d.targets[0].captured_at == (1 if captured else None)


@pytest.mark.parametrize("memories, copied", [
    (["owl is 1", "owl is 1", "owl is 1"], True),  # the needle's chunk (1) returned chunk 0's memory word for word
    (["owl is 1", " owl is 1 ", "x"], True),  # the same memory up to surrounding whitespace
    (["owl is 1", "owl is 2", "owl is 2"], False),  # the update rewrote the memory, just not with the needle
    (["owl is 1", "owl is 7654321", "owl is 1"], False),  # captured (then lost): never a copy-over
])
def test_agent_copied_over_evidence(memories, copied):
    ctx, ev = _ctx()
    sample = {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}
    d = diagnose_agent(_row(answer="1"), sample, _turns(memories, CHUNKS))
    assert d.copied_over is copied and d.targets[0].copied_over is copied
    assert diagnose_agent(_row(answer="1"), sample, None).copied_over is None  # no trace: not measured
    # evidence in the first update's chunk: there is no previous memory to copy
    first = [[(0, 45)], [(45, 64)]]
    assert diagnose_agent(_row(answer="1"), sample, _turns(["a", "a"], first)).copied_over is False
    (c,) = summarize_diagnostics([d, diagnose_agent(_row(), sample, _turns(["a", "b", "c"], CHUNKS))])
    assert c.copied_over_pct == (50.0 if copied else 0.0) and c.metrics()["copied_over_pct"] == c.copied_over_pct


def test_numbers_and_early_guess():
    assert numbers("is 1, then 5915962. v2 3.5 and x_7 [12] 12345678") == {"1", "5915962", "3.5", "12", "12345678"}
    assert numbers(None) == set() and numbers("no digits") == set()
    assert early_guess("It is 1.", ["5248280"], ["The number for X is 1."])
    assert not early_guess("It is 1.", ["5248280"], [])  # evidence in the first chunk: nothing held before it
    assert not early_guess("It is 5248280.", ["5248280"], ["is 5248280"])  # the gold value never counts
    assert not early_guess("It is 42.", ["5248280"], ["is 1", "is 7"])  # a number the memory never held
    assert early_guess("7 or 9", ["5"], ["nothing", "maybe 9"])  # any earlier memory


@pytest.mark.parametrize("memories, score, answer, early", [
    (["owl is 1", "owl is 1", "owl is 1"], 0.0, "1", True),  # settled on 1 before chunk 1, never took 7654321
    (["owl is 1", "owl is 7654321", "owl is 1"], 0.0, "1", True),  # captured, lost, and the guess came back
    (["nothing", "owl is 1", "owl is 1"], 0.0, "1", False),  # the 1 came with the evidence chunk, not before it
    (["owl is 1", "owl is 7654321", "owl is 7654321"], 1.0, "7654321", False),  # correct rows never count
    (["owl is 1", "no", "no"], 0.0, None, False),  # no answer extracted
])
def test_agent_early_guess(memories, score, answer, early):
    ctx, ev = _ctx()
    sample = {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}
    d = diagnose_agent(_row(score, answer=answer), sample, _turns(memories, CHUNKS))
    assert d.early_guess is early
    assert diagnose_agent(_row(answer="1"), sample, None).early_guess is None  # no trace: not measured
    (c,) = summarize_diagnostics([d, diagnose_agent(_row(answer="2"), sample, _turns(["a", "b", "c"], CHUNKS))])
    assert c.early_guess_pct == (50.0 if early else 0.0) and c.metrics()["early_guess_pct"] == c.early_guess_pct


def test_distractor_answer():
    doc = "The code for owl is 7654321. One of the codes for cat is: 8041481. Written in 1998."
    assert distractor_answer("It is 8041481.", ["7654321"], doc)  # another key's value
    assert not distractor_answer("It is 7654321.", ["7654321"], doc)  # the gold never counts
    assert not distractor_answer("It is 11.", ["7654321"], doc)  # made up: not in the document
    assert distractor_answer(None, ["7654321"], doc) is False
    assert not distractor_answer("In 1998.", ["7654321"], doc)  # a number of the document, not of the gold's kind
    assert distractor_answer("In 1998.", ["2004"], doc)  # ... unless the gold is a year too
    assert distractor_answer("Paris", ["Rome"], doc) is None  # the gold holds no number: not measured
    # the document's first 7-digit number: the gold itself here, so no answer is a first-distractor answer
    assert not first_distractor_answer("It is 8041481.", ["7654321"], doc)
    later = "One of the codes for cat is: 8041481. Then 5550001. The code for owl is 7654321."
    assert first_distractor_answer("It is 8041481.", ["7654321"], later) is True  # the first needle read
    assert first_distractor_answer("It is 5550001.", ["7654321"], later) is False  # a distractor, not the first
    assert first_distractor_answer("It is 8041481 or 7654321.", ["7654321"], later) is True  # names it
    assert first_distractor_answer("In 1998.", ["7654321"], "In 1998. " + later) is False  # not of the gold's kind
    assert first_distractor_answer(None, ["7654321"], later) is False
    assert first_distractor_answer("Paris", ["Rome"], later) is None
    # per row and per cell: agent and direct alike, errors and unknown samples not measured, correct rows False
    ctx = "filler 8041481. The code for owl is 7654321. more filler text here."
    a = ctx.index("The code")
    sample = {"context": ctx, "answers": ["7654321"],
              "metadata": {"evidence": [evidence_item(ctx, a, ctx.index("here"), "needle", answer="7654321", key="owl")]}}
    wrong, right = _row(answer="8041481"), _row(1.0, answer="7654321")
    assert diagnose_agent(wrong, sample, None).distractor_answer is True  # needs no trace
    assert diagnose_agent(wrong, sample, None).first_distractor_answer is True  # 8041481 comes first in ctx
    assert diagnose_agent(right, sample, None).first_distractor_answer is False
    assert diagnose_agent(_row(status="error"), sample, None).first_distractor_answer is None
    assert diagnose_direct(wrong, sample, [(0, len(ctx))]).distractor_answer is True
    assert diagnose_agent(right, sample, None).distractor_answer is False
    assert diagnose_agent(_row(answer="11"), sample, None).distractor_answer is False
    assert diagnose_agent(_row(status="error"), sample, None).distractor_answer is None
    assert diagnose_agent(wrong, None, None).distractor_answer is None
    assert diagnose_agent(right, dict(sample, answers=["owl"]), None).distractor_answer is None  # not numeric
    ds = [diagnose_agent(r, s, None) for r, s in ((wrong, sample), (right, sample), (_row(answer="11"), sample),
                                                     (_row(status="error"), sample), (wrong, None))]
    (c,) = summarize_diagnostics(ds)
    assert c.distractor_answer_pct == pytest.approx(100.0 / 3) and c.metrics()["distractor_answer_pct"] == c.distractor_answer_pct
    assert c.first_distractor_pct == pytest.approx(100.0 / 3) and c.metrics()["first_distractor_pct"] == c.first_distractor_pct


def test_distractors_before_and_cell_split():
    doc = "a 8041481. b 5550001. In 1998. c 7654321. d 8041481. e 1234567."
    assert distractors_before(["7654321"], doc) == 2  # 8041481 and 5550001; the year is not of the kind
    assert distractors_before(["8041481"], doc) == 0  # comes first
    assert distractors_before(["1234567"], doc) == 3  # repeats count once
    assert distractors_before(["7654321"], "a 7654321. b 7654321.") == 0
    assert distractors_before(["9999999"], doc) is None  # the gold value is not in the document
    assert distractors_before(["owl"], doc) is None  # no number in the gold: not measured
    assert distractors_before(["1998"], doc) == 0  # 4-digit gold: the 7-digit numbers are of another kind

    def sample(asked_last):
        needles = ["One of the codes for cat is: 8041481.", "One of the codes for owl is: 7654321."]
        ctx = " filler ".join(needles[::-1] if not asked_last else needles)
        a = ctx.index("One of the codes for owl")
        ev = [evidence_item(ctx, a, a + len(needles[1]), "needle", answer="7654321", key="owl")]
        return {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}

    right, wrong = _row(1.0, answer="7654321"), _row(answer="8041481")
    ds = [diagnose_agent(right, sample(False), None), diagnose_agent(wrong, sample(True), None),
          diagnose_agent(right, sample(True), None), diagnose_agent(wrong, sample(True), None),
          diagnose_agent(_row(status="error"), sample(True), None),  # counted per row, left out of the split
          diagnose_direct(right, {"context": "x", "answers": ["owl"]}, [(0, 1)])]  # another method: its own cell
    assert [d.distractors_before for d in ds] == [0, 1, 1, 1, 1, None]
    agent, direct = summarize_diagnostics(ds[:5])[0], summarize_diagnostics(ds[5:])[0]
    assert agent.correct_by_distractors_before == {0: (1, 1), 1: (1, 3)}
    assert format_split(agent.correct_by_distractors_before) == "0:1/1 1:1/3"
    assert direct.correct_by_distractors_before == {} and format_split({}) == ""


def test_truncated_evidence_is_not_read_and_traces_without_context_chars():
    ctx, ev = _ctx()
    sample = {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}
    cut = [[(0, 20)], [(50, 64)]]  # center truncation kept [0, 20) and [50, 65): the needle is gone
    d = diagnose_agent(_row(), sample, _turns(["a", "b"], cut))
    assert (d.outcome, d.read, d.captured, d.targets[0].read) == ("not_read", False, None, False)
    # an older trace (chunk_chars only): a whole read document maps one to one; a truncated one needs the view
    old = [{k: v for k, v in t.items() if k != "context_chars"} for t in _turns(["", "owl 7654321", "x"], CHUNKS)]
    assert diagnose_agent(_row(), sample, old).outcome == "captured_then_lost"
    short = [dict(t, chunk_chars=[0, 20]) if t.get("chunk_index") == 0 else dict(t, chunk_chars=[20, 35]) for t in old[:2]]
    d = diagnose_agent(_row(), sample, short)
    assert d.outcome == "unmeasured" and "tokenizer" in d.note
    d = diagnose_agent(_row(), sample, short, view=[(0, 20), (50, 64)])
    assert d.outcome == "not_read"


def test_no_trace_error_and_missing_sample():
    ctx, ev = _ctx()
    sample = {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}
    d = diagnose_agent(_row(), sample, None)
    assert (d.outcome, d.read, d.captured, d.note) == ("unmeasured", None, None, "no trace for this row")
    d = diagnose_agent(_row(), sample, None, view=[(0, 64)])  # no memory to look at, but the whole document was read
    assert (d.outcome, d.read) == ("unmeasured", True)
    assert diagnose_agent(_row(), sample, None, view=[(0, 10)]).outcome == "not_read"
    assert diagnose_agent(_row(1.0, "error"), sample, _turns(["x"], [[(0, 64)]])).outcome == "error"
    d = diagnose_agent(_row(1.0), None, None)
    assert d.outcome == "correct" and "not in the run folder" in d.note


def test_direct_in_view():
    ctx, ev = _ctx()
    sample = {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}
    assert diagnose_direct(_row(), sample, [(0, 45)]).outcome == "in_view_wrong"
    assert diagnose_direct(_row(), sample, [(0, 30), (50, 64)]).outcome == "not_read"
    assert diagnose_direct(dict(_row(), document_chars=[[0, 64]]), sample).read is True
    d = diagnose_direct(_row(), sample)
    assert d.outcome == "unmeasured" and "--tokenizer" in d.note
    assert diagnose_direct(_row(1.0), sample, [(0, 10)]).outcome == "correct"


def test_memory_health_and_cell_summary():
    turns = _turns(["a b c d a b c d", "a b c d a b c d", "", "one two three four"], [[(0, 1)]] * 4,
                   finish={0: "length", 1: "length"}, tokens={0: 64, 1: 64, 2: 1, 3: 7})
    turns.insert(2, {"kind": "update", "chunk_index": 9, "memory": "x", "finish_reason": "error"})  # failed: left out
    h = memory_health(turns)
    assert h.tokens == [64, 64, 1, 7] and h.cap_hits == [True, True, False, False]
    assert h.repetition == [pytest.approx(0.2), pytest.approx(0.2), None, 0.0]
    assert h.empty == [False, False, True, False] and h.unchanged == [True, False, False]

    ctx, ev = _ctx()
    sample = {"context": ctx, "answers": ["7654321"], "metadata": {"evidence": ev}}
    ds = [diagnose_agent(_row(), sample, _turns(m, CHUNKS)) for m in
          (["", "owl 7654321", "owl 7654321"], ["", "7654321", "gone"], ["", "no", "no"], ["", "no", "no"])]
    ds.append(diagnose_agent(_row(), sample, None))  # no trace: counted in n, not in the percentages
    ds.append(diagnose_agent(dict(_row(), status="error"), sample, None))
    (c,) = summarize_diagnostics(ds)
    assert c.n == 6 and c.outcomes == {"correct": 0, "retained_wrong": 1, "captured_then_lost": 1, "never_captured": 2,
                                       "not_read": 0, "in_view_wrong": 0, "unmeasured": 1, "error": 1}
    assert (c.n_read, c.read_pct, c.n_tracked, c.captured_pct, c.retained_pct) == (4, 100.0, 4, 50.0, 25.0)
    # every sample's first memory is empty: 4 of 12 updates
    assert (c.n_updates, c.memory_tokens_mean, c.cap_hit_pct) == (12, 5.0, 0.0)
    assert c.empty_memory_pct == pytest.approx(100 * 4 / 12)
    # unchanged, over each sample's 2nd and 3rd update: only the 3rd of samples 1, 3 and 4 repeats its memory
    assert c.unchanged_memory_pct == pytest.approx(100 * 3 / 8)
    assert c.metrics()["captured_pct"] == 50.0 and c.metrics()["never_captured_pct"] == pytest.approx(100 * 2 / 6)
    assert "read_pct" in c.metrics() and "captured_pct" not in summarize_diagnostics(ds[4:])[0].metrics()


# ------------------------------------------------------------------------------------- a whole run folder
FILL = "lorem ipsum dolor. " * 12  # 228 characters
BEHAVIOUR = {"keep": "start", "wrong": "start", "drop": "middle", "blind": "middle"}
_SECTION = re.compile(r"<section>\n(.*?)\n</section>", re.S)
_MEMORY = re.compile(r"<memory>\n(.*?)\n</memory>", re.S)
_CODE = re.compile(r"is (\d{7})")


def _sample(i: int, sid: str) -> Sample:
    code = str(7000000 + 1111 * i)
    needle = f"The code for {sid} is {code}."
    ctx = needle + " " + FILL * 2 if BEHAVIOUR[sid] == "start" else FILL + needle + " " + FILL
    a = ctx.index(needle)
    ev = [evidence_item(ctx, a, a + len(needle), "needle", answer=code, key=sid)]
    return Sample(sid, f"What is the code for {sid}?", ctx, (code,), {"evidence": ev})


def toy_responder(req):
    sid, kind = req.request_id.split("/")
    prompt = req.messages[-1].content
    if kind == "direct":
        code = _CODE.search(prompt)
        return "\\boxed{" + (code.group(1) if code and sid == "keep" else "none") + "}"
    memory = (_MEMORY.search(prompt) or [None, ""])[1]
    if kind == "final":
        code = _CODE.search(memory)
        return "\\boxed{" + (code.group(1) if code and sid == "keep" else "none") + "}"
    found = _CODE.search(_SECTION.search(prompt).group(1))
    if sid == "blind":
        return "nothing to note"
    if sid == "drop":
        return f"the code is {found.group(1)}" if found else "nothing new"
    return f"the code is {found.group(1)}" if found else (memory if _CODE.search(memory) else "nothing yet")


def toy_run(tmp_path):
    """A run folder of 4 samples x 3 methods whose outcomes are known by construction."""
    samples = [_sample(i, sid) for i, sid in enumerate(BEHAVIOUR)]
    write_samples(tmp_path / "toy.jsonl", samples)
    cfg = EvalConfig.from_dict({
        "name": "toy", "output": str(tmp_path / "run"), "backend": {"name": "scripted"},
        "methods": [
            {"name": "memagent", "kind": "memory_agent", "chunk_tokens": 120, "memory_tokens": 64, "final_tokens": 32},
            {"name": "truncated", "kind": "memory_agent", "chunk_tokens": 120, "memory_tokens": 64, "final_tokens": 32,
             "max_context_tokens": 200},
            {"name": "direct", "kind": "direct", "max_input_tokens": 420, "max_new_tokens": 32},
        ],
        "tasks": [{"name": "toy", "lengths": [500], "samples": 4, "files": {500: str(tmp_path / "toy.jsonl")}}],
    })
    runner = EvalRunner(cfg, backend=ScriptedBackend(responder=toy_responder))
    runner.run()
    return tmp_path / "run", runner.tokenizer


def _csv(path):
    return {r["method"]: r for r in csv.DictReader(path.read_text().splitlines())}


def test_run_folder_report_and_missing_traces(tmp_path):
    from memagent.eval.report import write_report

    run, tok = toy_run(tmp_path)
    files = write_report([run], tokenizer=tok)
    assert [f.name for f in files] == ["summary.csv", "summary.md", "accuracy.png", "report.html"]
    rows = _csv(run / "summary.csv")
    m, t, d = rows["memagent"], rows["truncated"], rows["direct"]
    assert (m["n_correct"], m["n_retained_wrong"], m["n_captured_then_lost"], m["n_never_captured"]) == ("1", "1", "1", "1")
    assert (m["read_pct"], m["captured_pct"], m["retained_pct"], m["n_tracked"]) == ("100.0", "75.0", "50.0", "4")
    assert (m["early_guess_pct"], d["early_guess_pct"]) == ("0.0", "")  # the toy's wrong answers name no number
    assert (m["distractor_answer_pct"], d["distractor_answer_pct"]) == ("0.0", "0.0")  # nor a number of the document
    assert (m["first_distractor_pct"], d["first_distractor_pct"]) == ("0.0", "0.0")
    # one needle per document, so every gold value comes first: the split is the score
    assert m["correct_by_distractors_before"] == d["correct_by_distractors_before"] == "0:1/4"
    assert (t["n_not_read"], t["read_pct"], t["n_tracked"]) == ("2", "50.0", "2")  # the middle needles were cut away
    assert (d["n_correct"], d["n_in_view_wrong"], d["n_not_read"], d["read_pct"]) == ("1", "1", "2", "50.0")
    assert d["captured_pct"] == "" and d["cap_hit_pct"] == ""  # no memory: not measured, not zero
    md = (run / "summary.md").read_text()
    assert "## Memory diagnostics" in md and "| direct | toy | 500 tok | 4 | 25.0 | 50.0 | n/a | n/a |" in md
    page = (run / "report.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org", "") and "<link" not in page and "src='data:image/png;base64," in page
    data = json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>', page, re.S).group(1))
    drop = next(s for s in data["samples"] if s["method"] == "memagent" and s["sample_id"] == "drop")
    assert drop["outcome"] == "captured_then_lost" and drop["lost_at"] == drop["targets"][0]["captured_at"] + 1
    ev = [u for u in drop["timeline"] if u["evidence"]]
    assert len(ev) == 1 and ev[0]["holds"] == [drop["gold"][0]] and ev[0]["chunk"] == drop["targets"][0]["captured_at"]

    # without traces the memory is unknown: n/a, never 0
    import shutil

    shutil.rmtree(run / "traces")
    write_report([run], out_dir=tmp_path / "again")  # no tokenizer given: the manifest's ("bytes") is loaded
    rows = _csv(tmp_path / "again" / "summary.csv")
    m, d = rows["memagent"], rows["direct"]
    assert (m["captured_pct"], m["retained_pct"], m["cap_hit_pct"], m["n_updates"]) == ("", "", "", "0")
    assert m["early_guess_pct"] == ""
    assert (m["n_correct"], m["n_unmeasured"], m["read_pct"]) == ("1", "3", "100.0")  # read: nothing truncated
    assert (d["read_pct"], rows["truncated"]["read_pct"], rows["truncated"]["n_not_read"]) == ("50.0", "50.0", "2")
    # a tokenizer that cannot be loaded here: where the agent's truncation cut is unknown too; the direct rows
    # record the ranges their prompts kept, so they need no tokenizer
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": "elsewhere.gguf"}))
    write_report([run], out_dir=tmp_path / "third", plot=False)
    rows = _csv(tmp_path / "third" / "summary.csv")
    assert (rows["direct"]["read_pct"], rows["direct"]["n_unmeasured"]) == ("50.0", "0")
    # rows written before they recorded the ranges: unknown without the tokenizer
    res = run / "results.jsonl"
    old_rows = [{k: v for k, v in json.loads(x).items() if k != "document_chars"} for x in res.read_text().splitlines()]
    res.write_text("".join(json.dumps(r) + "\n" for r in old_rows))
    write_report([run], out_dir=tmp_path / "fourth", plot=False)
    rows = _csv(tmp_path / "fourth" / "summary.csv")
    assert (rows["direct"]["read_pct"], rows["direct"]["n_unmeasured"]) == ("", "3")
    assert (rows["truncated"]["read_pct"], rows["memagent"]["read_pct"]) == ("", "100.0")


def test_copied_run_finds_its_task_file_by_name(tmp_path):
    """A run folder committed away from its data (docs/results/<study>/<run>/val_step_N/) reads the task file
    from a val_data/ folder one or two levels up once the path in its manifest is gone."""
    import shutil

    from memagent.eval.run_diagnostics import validation_metrics

    run, _ = toy_run(tmp_path / "orig")
    want = validation_metrics(run, {500: "val/x1"}, method="memagent")
    study = tmp_path / "study"
    shutil.copytree(run, study / "lr2" / "val_step_8")
    (study / "val_data").mkdir()
    shutil.move(tmp_path / "orig" / "toy.jsonl", study / "val_data" / "toy.jsonl")  # the manifest's path is now gone
    assert validation_metrics(study / "lr2" / "val_step_8", {500: "val/x1"}, method="memagent") == want
    assert want["val/x1/captured_pct"] == 75.0
    (study / "val_data" / "toy.jsonl").rename(study / "elsewhere.jsonl")  # not found: not measured, never 0
    assert "val/x1/captured_pct" not in validation_metrics(study / "lr2" / "val_step_8", {500: "val/x1"}, method="memagent")


def test_validation_metrics_names(tmp_path):
    from memagent.eval.run_diagnostics import validation_metrics

    run, _ = toy_run(tmp_path)
    got = validation_metrics(run, {500: "val/x1"}, method="memagent")
    assert (got["val/x1/captured_pct"], got["val/x1/retained_pct"], got["val/x1/read_pct"]) == (75.0, 50.0, 100.0)
    assert (got["val/x1/never_captured_pct"], got["val/x1/correct_pct"], got["val/x1/error_pct"]) == (25.0, 25.0, 0.0)
    assert got["val/x1/cap_hit_pct"] == 0.0 and "val/x1/memory_tokens_mean" in got and got["val/x1/early_guess_pct"] == 0.0
    assert validation_metrics(run, {999: "val/x9"}) == {}
    assert "val/x1/captured_pct" not in validation_metrics(run, {500: "val/x1"}, method="direct")


# ------------------------------------------------------------------------------ the page in a real browser
def _chromium() -> str:
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no Chromium installed (Debian: apt-get install chromium)")


def _headless(exe, tmp_path, url, *flags) -> str:
    import subprocess

    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}", *flags, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _rendered(dom: str) -> tuple[str, str]:
    """The script-rendered parts of a dumped page: the sample view and the sample list (not the script's source)."""
    listing, view = re.split(r'<div id="sample-view"[^>]*>', dom.split('<div id="sample-list">', 1)[1], maxsplit=1)
    return view.split("<script", 1)[0], listing


@pytest.mark.slow
def test_report_page_in_headless_chromium(tmp_path):
    from memagent.eval.report import write_report

    exe = _chromium()
    run, tok = toy_run(tmp_path)
    write_report([run], tokenizer=tok)
    page = run / "report.html"
    samples = json.loads(re.search(r'<script id="report-data" type="application/json">(.*?)</script>',
                                   page.read_text(), re.S).group(1))["samples"]
    i = next(k for k, s in enumerate(samples) if s["method"] == "memagent" and s["sample_id"] == "drop")
    # opening a sample's link renders its view: outcome, the evidence chunk marked, the diff highlighted
    dom = _headless(exe, tmp_path, f"{page.as_uri()}#sample={i}", "--dump-dom")
    view, listing = _rendered(dom)
    assert view.startswith('<div id="sample-detail" data-sample-id="drop" data-outcome="captured_then_lost">')
    assert '<div id="sample-view" class="open">' in dom  # the view opens as a panel
    assert "captured then lost</span>" in view and f"(dropped at update {samples[i]['lost_at']})" in view
    evidence_rows = re.findall(r'<tr class="evidence" data-chunk="(\d+)">', view)
    assert evidence_rows == [str(samples[i]["targets"][0]["captured_at"])]
    assert "<ins>" in view and "<del>" in view and f"★ evidence: {samples[i]['gold'][0]}" in view
    assert len(re.findall(r'<a href="#sample=\d+"', listing)) == len(samples) == 12
    # one click on a class lists exactly its samples (the filter is in the URL too)
    view, listing = _rendered(_headless(exe, tmp_path, f"{page.as_uri()}#outcome=never_captured", "--dump-dom"))
    listed = {int(k) for k in re.findall(r'<a href="#sample=(\d+)" id="item-', listing)}
    assert listed == {k for k, s in enumerate(samples) if s["outcome"] == "never_captured"} and len(listed) == 1
    assert "sample-detail" not in view
    shot = tmp_path / "shot.png"
    _headless(exe, tmp_path, f"{page.as_uri()}#sample={i}", f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.stat().st_size > 20000  # a rendered page, not a blank one


@pytest.mark.slow
def test_table_counts_link_to_their_samples(tmp_path):
    from memagent.eval.report import write_report

    exe = _chromium()
    run, tok = toy_run(tmp_path)
    write_report([run], tokenizer=tok, plot=False)
    page = (run / "report.html").read_text()
    assert "<a href='#outcome=not_read&amp;cell=truncated%7Ctoy%7C500' class='count'>2</a>" in page
    _, listing = _rendered(_headless(exe, tmp_path, f"{(run / 'report.html').as_uri()}#outcome=not_read&cell=truncated%7Ctoy%7C500",
                                     "--dump-dom"))
    assert len(re.findall(r'<a href="#sample=\d+"', listing)) == 2
    assert re.findall(r"truncated · toy 500 · (\w+) · score", listing) == ["blind", "drop"]  # ids in order


def test_committed_example_run(tmp_path):
    """docs/results/diag_smollm2_2k: a real run of the embedded model with traces; its diagnostics, from the
    committed rows, traces and data, as its README states them."""
    from memagent.eval.run_diagnostics import diagnose_run, run_cell_diagnostics

    run = "docs/results/diag_smollm2_2k"
    cells = {(c.method, c.task): c for c in run_cell_diagnostics(run)}
    niah, vt = cells[("memagent", "niah_single_2")], cells[("memagent", "vt")]
    assert (niah.outcomes["correct"], niah.outcomes["never_captured"], niah.captured_pct, niah.retained_pct) == (3, 1, 75.0, 75.0)
    assert (vt.outcomes["never_captured"], vt.captured_pct, vt.cap_hit_pct, vt.unchanged_memory_pct) == (4, 0.0, 100.0, 100.0)
    assert (niah.n_updates, niah.cap_hit_pct) == (16, 93.75)
    failed = next(d for d in diagnose_run(run) if d.method == "memagent" and d.sample_id == "niah_single_2-2048-2")
    assert failed.targets[0].evidence_chunks == [0] and failed.targets[0].captured is False


def test_committed_example_run_direct_view(gguf_tokenizer):
    from memagent.eval.run_diagnostics import run_cell_diagnostics

    cells = {(c.method, c.task): c for c in run_cell_diagnostics("docs/results/diag_smollm2_2k", gguf_tokenizer)}
    assert cells[("direct", "vt")].read_pct == 100.0 and cells[("direct", "vt")].outcomes["in_view_wrong"] == 4
    assert cells[("direct", "niah_single_2")].outcomes["correct"] == 4
    # the manifest names only the GGUF file (SmolLM2-135M-Instruct.Q4_1.gguf): the embedded vocabulary is loaded
    # for it, so the direct prompts' view is measured without --tokenizer too, with the same numbers
    assert run_cell_diagnostics("docs/results/diag_smollm2_2k") == list(cells.values())


@pytest.mark.parametrize("manifest, spec", [
    ({"tokenizer": "SmolLM2-135M-Instruct.Q4_1.gguf"}, "smollm2"),  # the shipped file
    ({"tokenizer": "SmolLM2-135M-Instruct.F16.gguf"}, "smollm2"),  # its F16 copy (--model smollm2-f16)
    ({"tokenizer": "smollm2-135m-instruct-q8_0.gguf"}, "smollm2"),  # another quantization: the same vocabulary
    ({"tokenizer": "smollm2-f16"}, "smollm2"),
    ({"tokenizer": "bytes"}, "bytes"),
    ({"tokenizer": "SmolLM2-135M-Instruct.Q4_1.gguf", "config": {"tokenizer": "path/tokenizer.json"}}, "path/tokenizer.json"),
    ({"tokenizer": "base-f16.gguf"}, None),  # the trainer's copy of whatever base: not known to be SmolLM2's
    ({"tokenizer": "SmolLM2-360M-Instruct.Q4_1.gguf"}, None),
    ({"tokenizer": "model"}, None), ({}, None),
])
def test_the_tokenizer_a_manifest_records_is_loaded_by_name(manifest, spec):
    from memagent.eval.run_diagnostics import _tokenizer_spec

    assert _tokenizer_spec(manifest) == spec


def test_tokenizer_mismatch_compares_the_spec_the_name_and_the_vocabulary():
    from types import SimpleNamespace

    from memagent.eval.run_diagnostics import tokenizer_mismatch

    q4 = {"tokenizer": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    smollm2 = SimpleNamespace(name="SmolLM2-135M-Instruct.Q4_1.gguf")  # what load_tokenizer("smollm2") names itself
    assert tokenizer_mismatch(q4, "smollm2", smollm2) is None
    assert tokenizer_mismatch({"tokenizer": "SmolLM2-135M-Instruct.F16.gguf"}, "smollm2", smollm2) is None
    assert tokenizer_mismatch(q4, "bytes", SimpleNamespace(name="bytes")) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert tokenizer_mismatch({"tokenizer": "bytes"}, "smollm2", smollm2) == "bytes"
    assert tokenizer_mismatch({"tokenizer": "base-f16.gguf"}, "smollm2", smollm2) == "base-f16.gguf"
    assert tokenizer_mismatch({"tokenizer": "qwen", "config": {"tokenizer": "q/tokenizer.json"}}, "q/tokenizer.json",
                              SimpleNamespace(name="q")) is None  # the grid's own setting
    assert tokenizer_mismatch({}, "bytes", SimpleNamespace(name="bytes")) is None  # nothing recorded: nothing to compare
