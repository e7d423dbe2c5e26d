"""Aggregate result rows per (method, task, length): mean, stderr, n, n_error, n_empty.

Counting rules (stated so numbers can be compared across runs):

- ``n`` counts every sample of the cell, errors included; an error row scores 0, so ``mean`` is over all
  ``n`` samples and failures lower it instead of vanishing from the denominator. ``mean_ok`` is over the
  ``n - n_error`` successful samples.
- ``n_empty`` counts successful samples whose extracted answer is empty after RULER's clean-up
  (:func:`memagent.verifiers.ruler_clean_prediction`; RULER reports these as null predictions).
- ``stderr`` is the standard error of ``mean``: sample standard deviation (``ddof=1``) / sqrt(n); 0 for n < 2.
- Rows are keyed by (method, task, length, sample id); if a key appears twice (an error row re-run with
  ``--retry-errors``), the last row wins.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memagent.errors import DataError
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
    mean_ok: float
    means: dict[str, float] = field(default_factory=dict)
    mean_context_tokens: float | None = None
    mean_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a ``results.jsonl`` (a torn last line is ignored; duplicates resolved, last wins).

    Raises:
        DataError: missing file, or a malformed line other than the last.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"results file {str(p)!r} not found")
    lines = p.read_bytes().split(b"\n")
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
            if i == len(lines):  # torn by a kill while writing
                break
            raise DataError(f"{p}:{i}: malformed result row") from None
        check_row(row, f"{p}:{i}")
        rows[(row["method"], row["task"], int(row["length"]), str(row["sample_id"]))] = row
    return list(rows.values())


#: Fields every result row must have (what summaries and resume read), with their JSON types.
ROW_FIELDS = {"method": str, "task": str, "length": int, "sample_id": (str, int), "status": str, "score": (int, float),
              "scores": dict}


#: Optional fields that summaries read, with their JSON types (``None`` allowed).
OPTIONAL_ROW_FIELDS = {"context_tokens": (int, float), "seconds": (int, float), "answer": str, "length_unit": str, "metric": str}


def check_row(row: Any, where: str) -> None:
    """Check one parsed result row against :data:`ROW_FIELDS` and :data:`OPTIONAL_ROW_FIELDS`.

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
    for key, typ in OPTIONAL_ROW_FIELDS.items():
        v = row.get(key)
        if v is not None and (not isinstance(v, typ) or isinstance(v, bool)):
            raise DataError(f"{where}: malformed result row ({key!r} is {v!r}); fix or remove that line")
    for name, v in row["scores"].items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise DataError(f"{where}: malformed result row (score {name!r} is {v!r}, not a number); fix or remove that line")


def _stderr(xs: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mu = sum(xs) / n
    var = sum((x - mu) ** 2 for x in xs) / (n - 1)
    return math.sqrt(var / n)


def summarize(rows: Iterable[dict[str, Any]]) -> list[CellSummary]:
    """One summary per (method, task, length), sorted by task, length, method.

    Raises:
        DataError: a cell mixes rows scored with different metrics or length units (rows of two different
            settings written into one results file); its mean would mean nothing.
    """
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[(r["method"], r["task"], int(r["length"]))].append(r)
    out = []
    for (method, task, length), rs in cells.items():
        kinds = {(r.get("metric", ""), tuple(r["scores"]), r.get("length_unit", "tokens")) for r in rs}
        if len(kinds) > 1:
            raise DataError(f"cell ({method}, {task}, {length}) mixes rows of different settings (metric, scores, "
                            f"length unit: {sorted(kinds)}); keep one setting's rows in that results file")
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
                mean_ok=sum(float(r["score"]) for r in ok) / len(ok) if ok else 0.0,
                means=means,
                mean_context_tokens=sum(ctx) / len(ctx) if ctx else None,
                mean_seconds=sum(float(r.get("seconds") or 0.0) for r in rs) / len(rs),
            )
        )
    return sorted(out, key=lambda c: (c.task, c.length, c.method))
