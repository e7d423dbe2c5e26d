"""The evidence side of the memory diagnostics: what the memory must hold (targets) and where it sits.

A sample's ``metadata.evidence`` lists character spans of its context (a needle, a gold paragraph); a span with
an ``answer`` is a target of its own, otherwise the gold answers stated in the spans make one target
(docs/diagnostics.md). :mod:`memagent.eval.diagnostics` follows the targets through a trace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memagent.errors import DataError
from memagent.eval.memory_text import contains
from memagent.verifiers import normalize_answer

__all__ = ["Range", "Target", "end_chunk", "inside", "merged", "read_evidence", "targets_of"]

_YES_NO = frozenset({"yes", "no", "noanswer"})
#: A half-open character range ``[start, end)`` of a context.
Range = tuple[int, int]


@dataclass(frozen=True)
class Target:
    """One thing the memory must hold: its aliases (any one counts) and the evidence spans that state it."""

    label: str
    aliases: tuple[str, ...]
    spans: tuple[Range, ...]

    def found_in(self, text: str | None) -> bool:
        return any(contains(text, a) for a in self.aliases)


def read_evidence(context: str, metadata: Mapping[str, Any], where: str = "sample") -> list[dict[str, Any]]:
    """The checked ``metadata["evidence"]`` of a sample (``[]`` when absent).

    Raises:
        DataError: not a list of objects with integer ``0 <= start_char <= end_char <= len(context)``, or a
            ``text`` that differs from ``context[start_char:end_char]`` (names the sample and the entry).
    """
    ev = metadata.get("evidence")
    if ev is None:
        return []
    if not isinstance(ev, list):
        raise DataError(f"{where}: metadata.evidence must be a list of {{start_char, end_char, ...}} objects")
    out = []
    for i, e in enumerate(ev):
        if not isinstance(e, Mapping):
            raise DataError(f"{where}: metadata.evidence[{i}] is not an object")
        a, b = e.get("start_char"), e.get("end_char")
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= len(context)):
            raise DataError(f"{where}: metadata.evidence[{i}] needs integer start_char <= end_char within the context "
                            f"(0..{len(context)}), got {a!r}, {b!r}")
        if "text" in e and e["text"] != context[a:b]:
            raise DataError(f"{where}: metadata.evidence[{i}].text is not the context's text at [{a}, {b}); fix the "
                            "span or drop the text")
        if e.get("answer") is not None and not isinstance(e["answer"], str):
            raise DataError(f"{where}: metadata.evidence[{i}].answer must be a string")
        out.append({**e, "text": context[a:b]})
    return out


def targets_of(context: str, answers: Sequence[str], metadata: Mapping[str, Any], where: str = "sample") -> tuple[list[Target], str]:
    """The targets of a sample and, when there are none, why (see the module docstring).

    Returns:
        ``(targets, note)``; ``note`` is ``""`` when there are targets.

    Raises:
        DataError: malformed evidence (:func:`read_evidence`).
    """
    ev = read_evidence(context, metadata, where)
    if not ev:
        return [], "no evidence positions in the sample's metadata"
    stated = [e for e in ev if e.get("answer")]
    if stated:
        by_answer: dict[str, list[Range]] = {}
        for e in stated:
            by_answer.setdefault(e["answer"], []).append((e["start_char"], e["end_char"]))
        return [Target(a, (a,), tuple(s)) for a, s in by_answer.items()], ""
    aliases = tuple(a for a in answers if normalize_answer(a) and normalize_answer(a) not in _YES_NO)
    if not aliases:
        return [], "the gold answer is yes/no or empty: its capture cannot be told by containment"
    spans = tuple((e["start_char"], e["end_char"]) for e in ev if any(contains(e["text"], a) for a in aliases))
    if not spans:
        return [], "no evidence span states the gold answer literally"
    return [Target(" / ".join(aliases), aliases, spans)], ""


def merged(ranges: Sequence[Range]) -> list[Range]:
    """Sorted ranges with touching or overlapping ones joined (consecutive chunks make one range)."""
    out: list[list[int]] = []
    for s, e in sorted((int(s), int(e)) for s, e in ranges):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def inside(span: Range, view: Sequence[Range]) -> bool:
    """Whether the span lies wholly inside the union of ``view``'s ranges."""
    a, b = span
    return any(s <= a and b <= e for s, e in merged(view))


def end_chunk(span: Range, chunk_ranges: Sequence[Sequence[Range]]) -> int | None:
    """Position in ``chunk_ranges`` of the chunk holding the span's last character."""
    last = max(span[0], span[1] - 1)
    for k, ranges in enumerate(chunk_ranges):
        if any(s <= last < e for s, e in ranges):
            return k
    return None
