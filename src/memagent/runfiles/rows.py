"""Prediction and result rows: one schema for ``memagent run`` and ``memagent eval``.

A row records what one method produced for one sample. Every row holds the core fields; where it was written
adds its own:

=================  ==========================================================================================
written by         fields, in order
=================  ==========================================================================================
``eval`` (cell)    ``method, task, length, length_unit, method_hash`` first, ``sample_sha256`` last (the hash of
                   the sample's question, context and gold answers: a resumed run refuses a sample file that
                   changed under rows already made from it)
every row          ``sample_id, status, error, question, answers, response, answer, extraction``
``eval`` (scored)  ``metric, score, scores, context_tokens``
every row          ``document_tokens, prompt_tokens, completion_tokens, turns, seconds, trace``
direct (eval)      ``document_chars``: the character ranges of the context its prompt kept (center truncation),
                   so the report tells whether the evidence was in view without cutting again
``run``            ``prompt_hash, settings, input_sha256, metadata`` (a predictions file has no manifest, so
                   each row carries what it was made with; ``--resume`` compares ``settings``, and
                   ``input_sha256``, the hash of the sample's question and context)
=================  ==========================================================================================

``status`` is ``ok`` or ``error`` (then ``error`` holds the message and every score is 0). Scores come from
:func:`memagent.scoring.score`. Rows made before this schema by ``memagent run`` named the sample ``id``; the
readers accept both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memagent.errors import DataError
from memagent.runfiles.jsonl import JsonlWriter, repair_tail
from memagent.types import Sample, Trajectory

#: Fields every eval result row must have (what summaries and resume read), with their JSON types.
ROW_FIELDS = {"method": str, "task": str, "length": int, "sample_id": (str, int), "status": str, "score": (int, float),
              "scores": dict}

#: Optional fields that summaries read, with their JSON types (``None`` allowed).
OPTIONAL_ROW_FIELDS = {"context_tokens": (int, float), "seconds": (int, float), "answer": str, "length_unit": str, "metric": str,
                       "document_chars": list}


#: How the error of a row begins when its sample was refused before any model call (a question too long for the
#: method's budget): ``--retry-errors`` alone runs it into the same refusal.
NOT_RUN = "not run: "


@dataclass(frozen=True)
class Outcome:
    """What a method produced for one sample (a memory-agent trajectory or one direct call).

    Attributes:
        response: raw text of the final call ("" on error).
        answer, extraction: the extracted answer and how it was found (:mod:`memagent.answers`).
        error: the error message, or ``None``.
        document_tokens: tokens of the document the method read (after truncation), when known.
        document_chars: the direct method: the ``(start, end)`` character ranges of the context its prompt kept.
        prompt_tokens, completion_tokens: summed over the method's calls.
        turns: number of calls.
        seconds: model time.
    """

    response: str = ""
    answer: str = ""
    extraction: str = "empty"
    error: str | None = None
    document_tokens: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    turns: int = 0
    seconds: float = 0.0
    document_chars: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def of_trajectory(cls, traj: Trajectory) -> Outcome:
        """The outcome of a memory-agent trajectory (token counts summed over its turns)."""
        return cls(traj.response, traj.answer, traj.extraction, traj.error, traj.document_tokens,
                   sum(t.prompt_tokens for t in traj.turns), sum(t.completion_tokens for t in traj.turns),
                   len(traj.turns), traj.seconds)


def result_row(sample: Sample, outcome: Outcome, *, cell: Mapping[str, Any] | None = None, metrics: Sequence[str] = (),
               trace: str | None = None, provenance: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One row of the schema above.

    Args:
        sample: the sample answered.
        outcome: what the method produced.
        cell: eval only: ``method, task, length, length_unit, method_hash``.
        metrics: verifier names, primary first; empty: an unscored row (``memagent run``).
        trace: where the sample's turns are (a path relative to the run folder, or the ``--trace`` file).
        provenance: ``run`` only: ``prompt_hash``, ``settings`` and ``input_sha256``; the sample's metadata is
            added.
    """
    from memagent.scoring import scores as score_all

    o = outcome
    row: dict[str, Any] = {**(cell or {}), "sample_id": sample.id, "status": "error" if o.error else "ok",
                           "error": o.error, "question": sample.question, "answers": list(sample.answers),
                           "response": o.response, "answer": o.answer, "extraction": o.extraction}
    if metrics:
        got = ({m: 0.0 for m in metrics} if o.error
               else score_all(metrics, o.response, sample.answers, answer=o.answer))
        row.update(metric=metrics[0], score=got[metrics[0]], scores=got, context_tokens=sample.metadata.get("length_tokens"))
    row.update(document_tokens=o.document_tokens, prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens,
               turns=o.turns, seconds=round(o.seconds, 4), trace=trace)
    if o.document_chars is not None:
        row["document_chars"] = [list(r) for r in o.document_chars]
    if provenance is not None:
        row.update(provenance)
        row["metadata"] = sample.metadata
    if cell is not None and (digest := sample_sha256(sample)) is not None:
        row["sample_sha256"] = digest
    return row


def sample_sha256(sample: Sample, with_answers: bool = True) -> str | None:
    """The sha256 of what a row was computed from: the sample's question, context and (``with_answers``: eval rows,
    whose scores depend on them) gold answers; text contexts only, ``None`` for a document read in pieces."""
    import hashlib

    if not isinstance(sample.context, str):
        return None
    parts = [sample.question, sample.context, *([list(sample.answers)] if with_answers else [])]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()


def row_sample_id(row: Mapping[str, Any]) -> str | None:
    """The sample id of a row (``sample_id``; ``id`` in predictions written before the shared schema)."""
    value = row.get("sample_id", row.get("id"))
    return None if value is None else str(value)


def row_key(row: Mapping[str, Any]) -> tuple[str, str, int, str]:
    """The identity of an eval result row: (method, task, length, sample id)."""
    return (row["method"], row["task"], int(row["length"]), str(row["sample_id"]))


def check_row(row: Any, where: str) -> None:
    """Check one parsed eval result row against :data:`ROW_FIELDS` and :data:`OPTIONAL_ROW_FIELDS`; ``score`` and
    every ``scores`` value must be a finite fraction in [0, 1] (a NaN, an infinity or a percentage would be averaged
    into the cell's mean as it is).

    Raises:
        DataError: naming ``where`` (file:line) and the field, with what to do.
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: malformed result row (expected a JSON object, got {type(row).__name__})")
    for key, typ in ROW_FIELDS.items():
        if key not in row:
            raise DataError(f"{where}: malformed result row (no {key!r} field); fix or remove that line")
        if not isinstance(row[key], typ) or isinstance(row[key], bool):
            raise DataError(f"{where}: malformed result row ({key!r} is {row[key]!r}); fix or remove that line")
    if row["status"] not in ("ok", "error"):  # summaries count anything but ok as failed, resume and exit status
        raise DataError(f"{where}: malformed result row (status is {row['status']!r}, not 'ok' or 'error'); fix or "
                        "remove that line")  # only 'error': the three would disagree on that row
    for key, typ in OPTIONAL_ROW_FIELDS.items():
        v = row.get(key)
        if v is not None and (not isinstance(v, typ) or isinstance(v, bool)):
            raise DataError(f"{where}: malformed result row ({key!r} is {v!r}); fix or remove that line")
    chars = row.get("document_chars")
    if chars is not None and not all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                                for x in r) and 0 <= r[0] <= r[1] for r in chars):
        raise DataError(f"{where}: malformed result row ('document_chars' must be [[start, end], ...] with "
                        f"0 <= start <= end, got {chars!r:.80}); fix or remove that line")
    for name, v in row["scores"].items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise DataError(f"{where}: malformed result row (score {name!r} is {v!r}, not a number); fix or remove that line")
    for name, v in [("score", row["score"]), *((f"scores.{k}", x) for k, x in row["scores"].items())]:
        if not 0.0 <= v <= 1.0:  # NaN fails both comparisons
            raise DataError(f"{where}: malformed result row ({name} is {v!r}; a score is a fraction from 0 to 1); "
                            "fix or remove that line (rescore it, or rerun that sample)")


def read_results(path: str | os.PathLike, on_torn: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Rows of a ``results.jsonl`` (a torn last line, the bytes after the last newline, is ignored, as every
    reader and writer of :mod:`memagent.runfiles.jsonl` does, even when they happen to be whole JSON: eval cuts
    and reruns that row; duplicates resolved, last wins).

    Raises:
        DataError: missing file, or a malformed line other than the last.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"results file {str(p)!r} not found")
    lines = p.read_bytes().split(b"\n")
    if lines[-1].strip() and on_torn is not None:
        on_torn(len(lines))  # the torn line's number
    lines = lines[:-1]  # after the last newline: "" for a whole file, the torn line otherwise
    rows: dict[tuple, dict[str, Any]] = {}
    for i, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{p}:{i}: result row is not UTF-8 text; fix or remove that line") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"{p}:{i}: malformed result row") from None
        check_row(row, f"{p}:{i}")
        rows[row_key(row)] = row
    return list(rows.values())


class ResultWriter:
    """Appends rows to an eval ``results.jsonl``, flushing and fsync'ing each one.

    On open, a last line without a newline (a row torn by a kill) is cut off, and the keys and method hashes of
    the complete rows are loaded for resume checks.

    Attributes:
        done: ``row_key -> status`` of every row (of a key written twice, the last).
        hashes: method -> the method hashes its rows carry.
        inputs: ``row_key -> sample_sha256`` of every row that records one (rows made before it was recorded
            are not compared).
        tasks: tasks with rows.
        metrics: task -> the metric lists its rows were scored with.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.done: dict[tuple[str, str, int, str], str] = {}
        self.inputs: dict[tuple[str, str, int, str], str] = {}
        self.hashes: dict[str, set[str]] = {}
        self.tasks: set[str] = set()
        self.metrics: dict[str, set[tuple[str, ...]]] = {}
        if self.path.exists():
            repair_tail(self.path)
            for row in read_results(self.path):
                self._record(row)
        self._out = JsonlWriter(self.path, append=True, fsync=True)

    def _record(self, row: dict[str, Any]) -> None:
        self.done[row_key(row)] = row["status"]
        if isinstance(row.get("sample_sha256"), str):
            self.inputs[row_key(row)] = row["sample_sha256"]
        self.hashes.setdefault(row["method"], set()).add(row.get("method_hash", ""))
        self.tasks.add(row["task"])
        self.metrics.setdefault(row["task"], set()).add(tuple(row["scores"]))

    def write(self, row: dict[str, Any]) -> None:
        self._out.write(row)
        self._record(row)

    def close(self) -> None:
        self._out.close()
