"""``memagent demo --ruler TASK``: one RULER document read by two memory agents side by side.

The untrained model and the same model with a trained adapter (``--lora``: a packaged policy such as
``ruler-niah``, or an adapter file) read the same RULER sample with the same budgets and templates; after
every chunk both memories are shown next to each other, the chunk holding the needle is marked, and each
memory is checked for the gold value (the capture test of :mod:`memagent.eval.diagnostics`).
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memagent.eval.diagnostics import contains
from memagent.types import Sample, Trajectory


@dataclass(frozen=True)
class Column:
    """One agent of the comparison: its label and its trajectory over the sample."""

    label: str
    trajectory: Trajectory


def evidence_chunks(sample: Sample, chunks: Sequence[Any]) -> list[int]:
    """0-based indices of the chunks in which the sample's evidence spans (``metadata.evidence``) start.

    Args:
        sample: a sample with ``metadata.evidence`` (RULER builders record it; none: ``[]``).
        chunks: its chunks, each with ``index``, ``start_char`` and ``end_char`` (characters of the context).
    """
    found = set()
    for ev in sample.metadata.get("evidence") or []:
        at = ev.get("start_char")
        if at is not None:
            found.update(c.index for c in chunks if c.start_char <= at < c.end_char)
    return sorted(found)


def gold_paragraph_chunks(sample: Sample, chunks: Sequence[Any]) -> list[int]:
    """0-based indices of the chunks in which the sample's gold paragraphs (``Document i:`` with i in
    ``metadata.gold_positions``, as the RULER-HotpotQA builder records them) start; ``[]`` without them."""
    found = set()
    for pos in sample.metadata.get("gold_positions") or []:
        at = sample.context.find(f"Document {pos}:\n")
        if at >= 0:
            found.update(c.index for c in chunks if c.start_char <= at < c.end_char)
    return sorted(found)


def column_trajectories(columns: Sequence[Column]) -> list[Trajectory]:
    """The columns' trajectories, each sample id suffixed with its column's label (``<id>@untrained``,
    ``<id>@trained``): both models read the same sample, and one id would make their turns one interleaved
    sample in a trace."""
    return [dataclasses.replace(c.trajectory, sample_id=f"{c.trajectory.sample_id}@{c.label}") for c in columns]


def _cell(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for para in (text or "(empty)").splitlines() or [""]:
        lines.extend(textwrap.wrap(para, width) or [""])
    return lines


def side_by_side(columns: Sequence[Column], answers: Sequence[str], marked: Sequence[int], width: int = 48,
                 echo: Callable[[str], None] = print) -> None:
    """Print each chunk's memories in columns, then each final answer and its verdict.

    Args:
        columns: the agents, each with its trajectory over the same sample (same chunks).
        answers: the gold answers (a memory "holds the answer" when it contains one, normalised).
        marked: 0-based chunk indices to mark as holding the evidence.
        width: characters per column.
        echo: where lines go.
    """
    updates = [[t for t in c.trajectory.turns if t.kind == "update"] for c in columns]
    n = max((len(u) for u in updates), default=0)
    for k in range(n):
        mark = "   <- the needle is in this chunk" if k in marked else ""
        echo(f"--- memory after chunk {k + 1}/{n}{mark}")
        cells = []
        for col, turns in zip(columns, updates):
            memory = turns[k].memory if k < len(turns) else ""
            held = any(contains(memory, a) for a in answers)
            cells.append([f"[{col.label}]" + (" (holds the answer)" if held else "")] + _cell(memory, width))
        for row in range(max(len(c) for c in cells)):
            echo("  ".join((c[row] if row < len(c) else "").ljust(width) for c in cells).rstrip())
    echo("--- final answers")
    for col in columns:
        t = col.trajectory
        ok = any(contains(t.answer or "", a) for a in answers)
        echo(f"[{col.label}] {t.answer!r}: {'correct' if ok else 'wrong'}")
    echo(f"gold: {' | '.join(answers)}")
