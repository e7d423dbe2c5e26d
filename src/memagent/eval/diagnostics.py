"""Where a memory agent lost the answer: capture and retention of the evidence, and memory health.

Pure functions over one sample (its ``metadata.evidence``, see docs/diagnostics.md), its result row and its
trace rows (one per turn, :func:`memagent.agent.loop.trace_rows`); reading a run folder is
:mod:`memagent.eval.run_diagnostics`.

Definitions (docs/diagnostics.md has the full text):

- **Targets**: what the memory must hold. Each evidence span with an ``answer`` (a needle's value, a vt
  variable) is a target; a sample whose evidence states no answer (gold paragraphs) has one target, its gold
  answers as aliases, located at the evidence spans that contain one of them. Yes/no answers and answers not
  stated in any evidence span give no target (capture is then not measured).
- **Contains**: normalised, word-bounded containment: ``normalize_answer(target)`` occurs in
  ``normalize_answer(text)`` between word boundaries (:func:`contains`).
- **Read**: a span is read when it lies wholly inside what the method saw (the chunks after center
  truncation; the direct prompt's document). **Evidence chunk**: the chunk in which a span ends.
- **Captured**: the memory written after an evidence chunk of the target contains it. **Retained**: the final
  memory (what the answer call sees) contains it. A sample is captured / retained when all its targets are.
- **Outcome**: ``correct`` (full score), ``error`` (a failed request), else the first that applies:
  ``unmeasured`` (no trace, no evidence, or no literal target: ``note`` says which), ``not_read`` (a target's
  evidence was cut away by truncation), direct rows ``in_view_wrong``; memory-agent rows ``retained_wrong``
  (every target in the final memory, answer still wrong), ``captured_then_lost`` (a target captured and then
  dropped, at update ``lost_at``), ``never_captured``.
- **Early guess**: a wrong answer that names a number which a memory written before the first evidence chunk
  already held: the memory settled on a value before it saw the evidence, and the answer kept it
  (:func:`early_guess`).
- **Distractor answer**: a wrong answer that names a number of the document, other than a gold answer, with
  as many digits as the gold's: on RULER's numeric needles, another key's value (:func:`distractor_answer`).
  Agent and direct rows alike; not measured where the gold holds no number.
- **First-distractor answer**: a distractor answer naming the document's first number of the gold's kind: the
  first needle read was another key's, and the answer kept it (:func:`first_distractor_answer`).
- **Distractors before the evidence**: how many other numbers of the gold's kind the document states before
  the gold value (:func:`distractors_before`: on niah_multikey_1, the asked needle's place among the needles);
  per cell, the score split by that count tells a memory that keeps the first value it reads from one that
  keeps the last.
- **Copied over the evidence**: a target never captured whose every evidence chunk (after the first update)
  was answered with the previous memory word for word: the update copied the old memory forward over the
  evidence instead of reading it.
- **Memory health** per update turn: completion tokens, cap hit (``finish_reason == "length"``), repeated
  word 4-gram share (:func:`repeated_ngram_share`), empty memory, memory unchanged from the previous update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memagent.errors import DataError
from memagent.eval.evidence import Range, Target, end_chunk, inside, read_evidence, targets_of
from memagent.eval.memory_text import (contains, distractor_answer, distractors_before, early_guess,
                                       first_distractor_answer, numbers, repeated_ngram_share)

__all__ = ["OUTCOMES", "CellDiagnostics", "MemoryHealth", "SampleDiagnosis", "Target", "TargetStatus", "contains",
           "diagnose_agent", "diagnose_direct", "distractor_answer", "distractors_before", "early_guess",
           "first_distractor_answer", "format_split", "memory_health", "numbers", "read_evidence",
           "repeated_ngram_share", "summarize_diagnostics", "targets_of"]

#: Outcome classes, in the order reports list them.
OUTCOMES = ("correct", "retained_wrong", "captured_then_lost", "never_captured", "not_read", "in_view_wrong",
            "unmeasured", "error")



@dataclass
class TargetStatus:
    """What happened to one target. ``None`` means not measured. Chunk numbers are the trace's chunk
    indices."""

    label: str
    aliases: tuple[str, ...] = ()
    read: bool | None = None
    evidence_chunks: list[int] = field(default_factory=list)
    captured: bool | None = None
    captured_at: int | None = None
    retained: bool | None = None
    lost_at: int | None = None
    copied_over: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "aliases": list(self.aliases)}

    def found_in(self, text: str | None) -> bool:
        return any(contains(text, a) for a in self.aliases)


@dataclass
class MemoryHealth:
    """Per update turn (errors left out): completion tokens, cap hit, repeated 4-gram share, empty, unchanged."""

    tokens: list[int] = field(default_factory=list)
    cap_hits: list[bool] = field(default_factory=list)
    repetition: list[float | None] = field(default_factory=list)
    empty: list[bool] = field(default_factory=list)
    unchanged: list[bool] = field(default_factory=list)  # updates after the first only

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def memory_health(turns: Sequence[Mapping[str, Any]]) -> MemoryHealth:
    """Memory health of one sample's update turns (trace rows; final and failed turns left out)."""
    h = MemoryHealth()
    prev = None
    for t in turns:
        if t.get("kind") != "update" or t.get("finish_reason") == "error":
            continue
        mem = (t.get("memory") or "").strip()
        h.tokens.append(int(t.get("completion_tokens") or 0))
        h.cap_hits.append(t.get("finish_reason") == "length")
        h.repetition.append(repeated_ngram_share(mem))
        h.empty.append(not mem)
        if prev is not None:
            h.unchanged.append(mem == prev)
        prev = mem
    return h


def _is_correct(row: Mapping[str, Any]) -> bool:
    return row.get("status") == "ok" and float(row.get("score") or 0.0) >= 1.0 - 1e-9


@dataclass
class SampleDiagnosis:
    """The diagnosis of one result row (see the module docstring for every field's definition).

    Attributes:
        method, task, length, sample_id: the row's key.
        kind: ``memory_agent`` or ``direct``.
        outcome: one of :data:`OUTCOMES`.
        note: why something is not measured ("" when everything is).
        score: the row's primary score.
        targets: per target, read / captured / retained.
        read, captured, retained: all targets read / captured / retained (``None``: not measured; captured and
            retained are for memory-agent rows only).
        early_guess: a wrong answer repeating a number the memory held before the first evidence chunk
            (:func:`early_guess`; ``False`` for correct rows; ``None`` where capture is not measured).
        distractor_answer: a wrong answer naming a number of the document, not a gold answer, with a gold
            number's digit count (:func:`distractor_answer`; ``False`` for correct rows; ``None`` for errors,
            without the sample, or when the gold answer holds no number).
        first_distractor_answer: a distractor answer naming the document's first number of the gold's kind
            (:func:`first_distractor_answer`; ``None`` where ``distractor_answer`` is).
        distractors_before: other numbers of the gold's kind the document states before the gold value
            (:func:`distractors_before`; ``None`` without the sample, for a gold holding no number, or when the
            document does not state the gold value).
        lost_at: chunk index of the update that dropped a captured target for good (``captured_then_lost``).
        copied_over: a target was never captured because each update of its evidence chunks returned the previous
            memory unchanged (``None`` where capture is not measured).
        health: memory health of the update turns (``None`` without a trace).
    """

    method: str
    task: str
    length: int
    sample_id: str
    kind: str
    outcome: str
    note: str = ""
    score: float = 0.0
    targets: list[TargetStatus] = field(default_factory=list)
    read: bool | None = None
    captured: bool | None = None
    retained: bool | None = None
    early_guess: bool | None = None
    distractor_answer: bool | None = None
    first_distractor_answer: bool | None = None
    distractors_before: int | None = None
    lost_at: int | None = None
    copied_over: bool | None = None
    health: MemoryHealth | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["targets"] = [t.to_dict() for t in self.targets]
        d["health"] = self.health.to_dict() if self.health is not None else None
        return d


def _all(xs: Sequence[bool | None]) -> bool | None:
    return None if not xs or any(x is None for x in xs) else all(xs)


def _any(xs: Sequence[bool | None]) -> bool | None:
    return None if not xs or any(x is None for x in xs) else any(xs)


def _base(row: Mapping[str, Any], kind: str) -> SampleDiagnosis:
    return SampleDiagnosis(str(row["method"]), str(row["task"]), int(row["length"]), str(row["sample_id"]), kind,
                           outcome="correct" if _is_correct(row) else "error" if row.get("status") == "error" else "",
                           score=float(row.get("score") or 0.0))


def _flag_distractor(d: SampleDiagnosis, row: Mapping[str, Any], sample: Mapping[str, Any] | None) -> None:
    """Set ``d.distractor_answer`` and ``d.distractors_before`` (any method; need the sample, not the trace)."""
    if sample is None:
        return
    golds = [str(a) for a in sample.get("answers") or ()]
    doc = str(sample.get("context") or "")
    d.distractors_before = distractors_before(golds, doc)
    if row.get("status") != "ok":
        return
    flag = distractor_answer(row.get("answer"), golds, doc)
    d.distractor_answer = None if flag is None else flag and not _is_correct(row)
    first = first_distractor_answer(row.get("answer"), golds, doc)
    d.first_distractor_answer = None if first is None else first and not _is_correct(row)


def _targets_or_note(d: SampleDiagnosis, sample: Mapping[str, Any] | None) -> list[Target]:
    if sample is None:
        d.note = "the sample's data is not in the run folder"
        return []
    try:
        targets, d.note = targets_of(sample["context"], sample.get("answers") or (), sample.get("metadata") or {},
                                     f"sample {d.sample_id}")
    except DataError as e:
        d.note = str(e)
        return []
    return targets


def diagnose_direct(row: Mapping[str, Any], sample: Mapping[str, Any] | None, view: Sequence[Range] | None = None) -> SampleDiagnosis:
    """Diagnose a direct-baseline row: is the evidence inside the (center-truncated) prompt?

    Args:
        row: the result row.
        sample: the sample as a dict (``context``, ``answers``, ``metadata``), ``None`` when unavailable.
        view: the character ranges of the context the prompt kept; default ``row["document_chars"]`` when the
            row has it.
    """
    d = _base(row, "direct")
    _flag_distractor(d, row, sample)
    targets = _targets_or_note(d, sample)
    view = view if view is not None else row.get("document_chars")
    if targets and view is None:
        d.note = "where the prompt was truncated is unknown: report with the run's tokenizer (--tokenizer)"
    if targets and view is not None:
        d.targets = [TargetStatus(t.label, t.aliases, read=any(inside(s, view) for s in t.spans)) for t in targets]
        d.read = _all([t.read for t in d.targets])
    if not d.outcome:
        d.outcome = "unmeasured" if d.read is None else "in_view_wrong" if d.read else "not_read"
    return d


def _chunk_ranges(updates, context_len: int, view: Sequence[Range] | None) -> list[list[Range]] | None:
    """Per update turn, the ranges of the context its chunk covers; ``None`` when the trace cannot tell."""
    from memagent.chunking import source_ranges

    if all(t.get("context_chars") is not None for t in updates):
        return [[tuple(r) for r in t["context_chars"]] for t in updates]
    chars = [t.get("chunk_chars") for t in updates]
    if any(c is None for c in chars):
        return None
    if view is not None:
        return [list(source_ranges(view, c[0], c[1])) for c in chars]
    if not chars or chars[-1][1] == context_len:  # the whole context was read: no truncation
        return [[tuple(c)] for c in chars]
    return None


def _follow(t: Target, st: TargetStatus, chunks: list[list[Range]], memories: list[str], index: list[int]) -> None:
    """Fill captured / retained / lost_at of one read target from the update memories (``memories[p]`` is the
    memory after update ``p``, which read ``chunks[p]``, the trace's chunk ``index[p]``)."""
    seen = [r for c in chunks for r in c]
    ends = {end_chunk(s, chunks) for s in t.spans if inside(s, seen)}
    pos = sorted(p for p in ends if p is not None)
    st.evidence_chunks = [index[p] for p in pos]
    st.retained = bool(memories) and t.found_in(memories[-1])
    hit = next((p for p in pos if t.found_in(memories[p])), None)
    st.captured = hit is not None
    later = [p for p in pos if p > 0]  # the first update has no previous memory to copy
    st.copied_over = (hit is None and bool(later)
                      and all(memories[p].strip() == memories[p - 1].strip() for p in later))
    if hit is None:
        return
    st.captured_at = index[hit]
    if not st.retained:  # the update after the last memory that still held it dropped it for good
        last = max(p for p in range(hit, len(memories)) if t.found_in(memories[p]))
        st.lost_at = index[last + 1]


def diagnose_agent(row: Mapping[str, Any], sample: Mapping[str, Any] | None, turns: Sequence[Mapping[str, Any]] | None,
                   view: Sequence[Range] | None = None) -> SampleDiagnosis:
    """Diagnose a memory-agent row from its trace: evidence chunks, capture, retention, outcome, memory health.

    Args:
        row: the result row.
        sample: the sample as a dict (``context``, ``answers``, ``metadata``), ``None`` when unavailable.
        turns: the sample's trace rows in turn order (``None``: no trace).
        view: the character ranges of the context the agent read (center truncation), needed only for traces
            without ``context_chars`` whose documents were truncated.
    """
    d = _base(row, "memory_agent")
    _flag_distractor(d, row, sample)
    targets = _targets_or_note(d, sample)
    if turns is None:  # what was read is still known from the view; nothing about the memory
        d.note = "no trace for this row" + (f"; {d.note}" if d.note else "")
        if targets and view is not None and sample is not None:
            d.targets = [TargetStatus(t.label, t.aliases, read=any(inside(s, view) for s in t.spans)) for t in targets]
            d.read = _all([t.read for t in d.targets])
        d.outcome = d.outcome or ("not_read" if d.read is False else "unmeasured")
        return d
    d.health = memory_health(turns)
    updates = [t for t in turns if t.get("kind") == "update" and t.get("finish_reason") != "error"]
    chunks = _chunk_ranges(updates, len(sample["context"]), view) if sample is not None and targets else None
    if targets and chunks is None:
        d.note = "the trace does not say which part of the truncated context each chunk holds: report with the run's tokenizer"
    if targets and chunks is not None:
        seen = [r for c in chunks for r in c]
        memories = [(t.get("memory") or "") for t in updates]
        index = [int(t["chunk_index"]) for t in updates]
        for t in targets:
            st = TargetStatus(t.label, t.aliases, read=any(inside(s, seen) for s in t.spans))
            if st.read:
                _follow(t, st, chunks, memories, index)
            d.targets.append(st)
        d.read = _all([t.read for t in d.targets])
        if d.read:
            d.captured = _all([t.captured for t in d.targets])
            d.retained = _all([t.retained for t in d.targets])
            lost = [t.lost_at for t in d.targets if t.lost_at is not None]
            d.lost_at = min(lost) if lost else None
            d.copied_over = _any([t.copied_over for t in d.targets])
            if d.captured is not None:
                first = index.index(min(c for t in d.targets for c in t.evidence_chunks))
                golds = [*(sample.get("answers") or ()), *(a for t in d.targets for a in t.aliases)]
                d.early_guess = (not _is_correct(row) and row.get("status") == "ok"
                                 and early_guess(row.get("answer"), golds, memories[:first]))
    if not d.outcome:
        d.outcome = _agent_outcome(d)
    return d


def _agent_outcome(d: SampleDiagnosis) -> str:
    if d.read is None:
        return "unmeasured"
    if not d.read:
        return "not_read"
    if d.retained:
        return "retained_wrong"
    if d.lost_at is not None:
        return "captured_then_lost"
    return "never_captured"


def _pct(hits: Sequence[bool]) -> float | None:
    return 100.0 * sum(hits) / len(hits) if hits else None


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


@dataclass(frozen=True)
class CellDiagnostics:
    """Diagnostics of one (method, task, length) cell. Percentages are in [0, 100]; ``None`` = not measured.

    Attributes:
        outcomes: samples per outcome class (every class of :data:`OUTCOMES`, zeros included).
        n_read: samples (errors left out) with targets and a known view; ``read_pct`` is over these.
        n_tracked: memory-agent samples (errors left out) whose evidence was read and traced; ``captured_pct``,
            ``retained_pct`` and ``early_guess_pct`` (wrong answers repeating a number the memory held before the
            evidence, :func:`early_guess`) are over these; ``distractor_answer_pct`` (wrong answers naming another
            number of the document, :func:`distractor_answer`) and ``first_distractor_pct`` (those naming the
            document's first such number, :func:`first_distractor_answer`) are over the non-error samples whose
            data is known; ``copied_over_pct`` (samples whose evidence chunks were answered with the previous
            memory unchanged, so the evidence never reached it) is over the tracked samples.
        n_updates: update turns with a trace (errors left out); the memory-health numbers are over these
            (``repeat_4gram_pct`` over those of at least 4 words, ``unchanged_memory_pct`` over all but each
            sample's first).
        correct_by_distractors_before: ``{count: (correct, samples)}`` over the non-error samples whose
            :func:`distractors_before` is measured, by that count in increasing order (``{}`` when none is).
    """

    method: str
    task: str
    length: int
    n: int
    outcomes: dict[str, int]
    n_read: int
    read_pct: float | None
    n_tracked: int
    captured_pct: float | None
    retained_pct: float | None
    early_guess_pct: float | None
    distractor_answer_pct: float | None
    first_distractor_pct: float | None
    copied_over_pct: float | None
    n_updates: int
    memory_tokens_mean: float | None
    cap_hit_pct: float | None
    repeat_4gram_pct: float | None
    empty_memory_pct: float | None
    unchanged_memory_pct: float | None
    correct_by_distractors_before: dict[int, tuple[int, int]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The measured numbers by name (what a training log records); unmeasured ones are left out."""
        keys = ("read_pct", "captured_pct", "retained_pct", "early_guess_pct", "distractor_answer_pct",
                "first_distractor_pct", "copied_over_pct", "memory_tokens_mean", "cap_hit_pct",
                "repeat_4gram_pct", "empty_memory_pct", "unchanged_memory_pct")
        out = {k: float(getattr(self, k)) for k in keys if getattr(self, k) is not None}
        out.update({f"{k}_pct": 100.0 * v / self.n for k, v in self.outcomes.items()} if self.n else {})
        return out


def _split_by_distractors_before(ds: Sequence[SampleDiagnosis]) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for d in ds:
        if d.distractors_before is not None:
            hit, n = out.get(d.distractors_before, (0, 0))
            out[d.distractors_before] = (hit + (d.outcome == "correct"), n + 1)
    return dict(sorted(out.items()))


def format_split(split: Mapping[int, tuple[int, int]]) -> str:
    """``{0: (2, 3), 3: (0, 6)}`` -> ``"0:2/3 3:0/6"`` (count: correct / samples); ``""`` for an empty split."""
    return " ".join(f"{k}:{hit}/{n}" for k, (hit, n) in split.items())


def summarize_diagnostics(diagnoses: Sequence[SampleDiagnosis]) -> list[CellDiagnostics]:
    """One :class:`CellDiagnostics` per (method, task, length), sorted by task, length, method."""
    cells: dict[tuple[str, str, int], list[SampleDiagnosis]] = {}
    for d in diagnoses:
        cells.setdefault((d.method, d.task, d.length), []).append(d)
    out = []
    for (method, task, length), ds in cells.items():
        ok = [d for d in ds if d.outcome != "error"]
        read = [d.read for d in ok if d.read is not None]
        tracked = [d for d in ok if d.kind == "memory_agent" and d.read and d.captured is not None]
        hs = [d.health for d in ds if d.health is not None]
        tokens = [x for h in hs for x in h.tokens]
        out.append(CellDiagnostics(
            method=method, task=task, length=length, n=len(ds),
            outcomes={k: sum(d.outcome == k for d in ds) for k in OUTCOMES},
            n_read=len(read), read_pct=_pct(read),
            n_tracked=len(tracked), captured_pct=_pct([bool(d.captured) for d in tracked]),
            retained_pct=_pct([bool(d.retained) for d in tracked]),
            early_guess_pct=_pct([bool(d.early_guess) for d in tracked]),
            distractor_answer_pct=_pct([d.distractor_answer for d in ok if d.distractor_answer is not None]),
            first_distractor_pct=_pct([d.first_distractor_answer for d in ok if d.first_distractor_answer is not None]),
            copied_over_pct=_pct([bool(d.copied_over) for d in tracked]),
            n_updates=len(tokens), memory_tokens_mean=_mean(tokens),
            cap_hit_pct=_pct([x for h in hs for x in h.cap_hits]),
            repeat_4gram_pct=None if (r := _mean([x for h in hs for x in h.repetition])) is None else 100.0 * r,
            empty_memory_pct=_pct([x for h in hs for x in h.empty]),
            unchanged_memory_pct=_pct([x for h in hs for x in h.unchanged]),
            correct_by_distractors_before=_split_by_distractors_before(ok),
        ))
    return sorted(out, key=lambda c: (c.task, c.length, c.method))
