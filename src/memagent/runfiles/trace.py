"""Trace files: one JSON line per turn of the memory agent (memory after every chunk, the final answer)."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import Any

from memagent.runfiles.jsonl import JsonlWriter, complete_lines, keep_lines, parse_line
from memagent.types import Trajectory


def trace_rows(trajectory: Trajectory) -> list[dict[str, Any]]:
    """One JSON-ready row per turn: sample id, turn number, kind, chunk index, its character range in the document
    read (``chunk_chars``) and in the sample's context (``context_chars``), prompt and completion tokens, memory
    text, output, finish reason, seconds."""
    return [{"sample_id": trajectory.sample_id, "turn": i, **t.to_dict()} for i, t in enumerate(trajectory.turns)]


def prune_trace(path: str | os.PathLike, keep: Collection[str]) -> int:
    """Before a resumed run appends to a trace file: keep only the turns of the samples in ``keep`` (the ones
    that are not run again), dropping blank lines and lines that are not a JSON object (a line torn by a kill),
    so each sample ends with the turns of exactly one attempt and the next append starts on a line of its own.
    The file is rewritten through a temporary file and replaced at once, and only when something changes.

    Returns:
        the number of lines dropped (0 also when the file does not exist).

    Raises:
        OSError: the file cannot be read or replaced.
    """
    return keep_lines(path, lambda row: isinstance(row, dict) and str(row.get("sample_id")) in keep)


def check_trace_file(path: str | os.PathLike, sample_ids: Collection[str]) -> None:
    """Before ``--resume`` rewrites a trace file (:func:`prune_trace`): every complete line must be a turn
    (a JSON object with ``sample_id``, ``turn`` and ``kind``) of one of ``sample_ids``, so that a file that is
    another run's trace, a predictions or a samples file is refused instead of rewritten. A torn last line and
    blank lines are not checked (the pruning drops them).

    Raises:
        DataError: naming ``file:line`` and what the line is.
    """
    from memagent.errors import DataError

    for n, line in complete_lines(path):
        if not line.strip():
            continue
        row = parse_line(line)
        if not isinstance(row, dict) or not {"sample_id", "turn", "kind"} <= set(row):
            why = "not a trace turn (a JSON object with sample_id, turn and kind)"
        elif str(row["sample_id"]) not in sample_ids:
            why = f"a turn of sample {row['sample_id']!r}, which --input does not hold"
        else:
            continue
        raise DataError(f"{path}:{n}: {why}; --resume continues the trace of an earlier run over the same "
                        "--input, and leaves any other file untouched (give a new --trace)")


def write_trace(path: str | os.PathLike, trajectories: Sequence[Trajectory], append: bool = False) -> None:
    """Write the per-turn trace of every trajectory as JSONL (see :func:`trace_rows`)."""
    with JsonlWriter(path, append=append) as w:
        for traj in trajectories:
            w.write_many(trace_rows(traj))


def read_trace(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """A trace file's turns per sample id, in turn order (``{}`` when the file does not exist).

    Lines that are not a JSON object with a ``sample_id`` (blank, or torn by a kill) are skipped; where a
    sample's turns appear more than once (an attempt re-run), the last attempt (the last run starting at turn 0)
    is kept.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for _, line in complete_lines(path):
        row = parse_line(line)
        if not isinstance(row, dict) or "sample_id" not in row:
            continue
        sid = str(row["sample_id"])
        if row.get("turn") == 0 or sid not in out:
            out[sid] = []
        out[sid].append(row)
    return out
