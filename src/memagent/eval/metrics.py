"""Aggregate result rows per (method, task, length): mean, stderr, n, n_error, n_empty.

Counting rules (stated so numbers can be compared across runs):

- ``n`` counts every sample of the cell, errors included; an error row scores 0, so ``mean`` is over all
  ``n`` samples and failures lower it instead of vanishing from the denominator. ``mean_ok`` is over the
  ``n - n_error`` successful samples (``None``, an empty CSV cell, when none succeeded).
- ``n_empty`` counts successful samples whose extracted answer is empty after RULER's clean-up
  (:func:`memagent.verifiers.ruler_clean_prediction`; RULER reports these as null predictions).
- ``stderr`` is the standard error of ``mean``: sample standard deviation (``ddof=1``) / sqrt(n); 0 for n < 2.
- Rows are keyed by (method, task, length, sample id); if a key appears twice (an error row re-run with
  ``--retry-errors``), the last row wins.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from memagent.errors import DataError
from memagent.runfiles.rows import OPTIONAL_ROW_FIELDS, ROW_FIELDS, check_row, read_results  # noqa: F401 - re-exported
from memagent.verifiers import ruler_clean_prediction


@dataclass(frozen=True)
class CellSummary:
    """Summary of one (method, task, length) cell. Scores are fractions in [0, 1]."""

    method: str
    task: str
    length: int
    length_unit: str
    metric: str
    n: int
    n_error: int
    n_empty: int
    mean: float
    stderr: float
    mean_ok: float | None
    means: dict[str, float] = field(default_factory=dict)
    mean_context_tokens: float | None = None
    mean_seconds: float = 0.0
    #: samples per cell the run's grid asked for (its manifest's ``samples``); ``None`` when not recorded.
    n_asked: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stderr(xs: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mu = sum(xs) / n
    var = sum((x - mu) ** 2 for x in xs) / (n - 1)
    return math.sqrt(var / n)


def summarize(rows: Iterable[dict[str, Any]], where: str = "") -> list[CellSummary]:
    """One summary per (method, task, length), sorted by task, length, method.

    Args:
        rows: result rows (:func:`read_results`: each row's fields and scores already checked).
        where: the results file, named in errors.

    Raises:
        DataError: a cell mixes rows scored with different metrics or length units, or rows made with different
            method settings (two ``method_hash`` values, a row without one counting as its own); rows of two
            settings written into one results file, whose mean would mean nothing.
    """
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[(r["method"], r["task"], int(r["length"]))].append(r)
    at = f"{where}: " if where else ""
    out = []
    for (method, task, length), rs in cells.items():
        kinds = {(r.get("metric", ""), tuple(r["scores"]), r.get("length_unit", "tokens")) for r in rs}
        if len(kinds) > 1:
            raise DataError(f"{at}cell ({method}, {task}, {length}) mixes rows of different settings (metric, scores, "
                            f"length unit: {sorted(kinds)}); keep one setting's rows in that results file")
        hashes = sorted({str(r.get("method_hash") or "") for r in rs})
        if len(hashes) > 1:
            shown = ", ".join(repr(h) if h else "none" for h in hashes)
            raise DataError(f"{at}cell ({method}, {task}, {length}) mixes rows made with different method settings "
                            f"(method_hash {shown}): its mean would average two settings; keep one setting's rows in "
                            "that results file (rerun the other setting under another method name or --output)")
        scores = [float(r["score"]) if r["status"] == "ok" else 0.0 for r in rs]
        ok = [r for r in rs if r["status"] == "ok"]
        names = list(rs[0].get("scores", {}))
        means = {k: sum(float(r["scores"].get(k, 0.0)) if r["status"] == "ok" else 0.0 for r in rs) / len(rs) for k in names}
        ctx = [r["context_tokens"] for r in rs if r.get("context_tokens") is not None]
        out.append(
            CellSummary(
                method=method,
                task=task,
                length=length,
                length_unit=rs[0].get("length_unit", "tokens"),
                metric=rs[0].get("metric", ""),
                n=len(rs),
                n_error=len(rs) - len(ok),
                n_empty=sum(1 for r in ok if not ruler_clean_prediction(r.get("answer"))),
                mean=sum(scores) / len(scores),
                stderr=_stderr(scores),
                mean_ok=sum(float(r["score"]) for r in ok) / len(ok) if ok else None,  # no ok row: no mean
                means=means,
                mean_context_tokens=sum(ctx) / len(ctx) if ctx else None,
                mean_seconds=sum(float(r.get("seconds") or 0.0) for r in rs) / len(rs),
            )
        )
    return sorted(out, key=lambda c: (c.task, c.length, c.method))


def length_label(length: int, unit: str) -> str:
    """``50 docs``; a token length as ``2K`` (a multiple of 1024) or ``189``, its unit left to the caller
    (:func:`length_with_unit`, a column header, an axis label)."""
    if unit == "docs":
        return f"{length} docs"
    return f"{length // 1024}K" if length % 1024 == 0 and length >= 1024 else str(length)


def length_with_unit(length: int, unit: str) -> str:
    """A length with its unit: ``50 docs``, ``2K tok``, ``189 tok``."""
    return length_label(length, unit) if unit == "docs" else f"{length_label(length, unit)} tok"
