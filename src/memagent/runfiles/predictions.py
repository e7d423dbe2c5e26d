"""``memagent run``'s predictions file and its ``--resume``: which samples are done, and the settings check."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from memagent.errors import DataError, MemagentError
from memagent.runfiles.jsonl import complete_lines, dumps, parse_line, rewrite
from memagent.runfiles.resume import describe, setting_changes
from memagent.runfiles.rows import row_sample_id, sample_sha256
from memagent.types import Sample


def input_sha256(sample: Sample) -> str | None:
    """The sha256 of what a prediction answered: the sample's question and context (text contexts only;
    ``None`` for a document read from a file or stream). Recorded in every ``memagent run`` row as
    ``input_sha256``, so that ``--resume`` does not keep the answer to a question or document since changed."""
    return sample_sha256(sample, with_answers=False)  # a prediction does not depend on the gold answers


def finished_ids(path: str | os.PathLike, sample_ids: Collection[str] | Mapping[str, str | None] | None = None) -> set[str]:
    """Ids of the samples a predictions file already holds with status ``ok`` (a torn last row is not counted).

    Every complete row must be a prediction row (a JSON object with a sample id and a ``status`` of ``ok`` or
    ``error``) and, when ``sample_ids`` is given, a prediction of one of those samples: ``--resume`` rewrites the
    file, so a trace, a samples file or the predictions of other samples are refused before anything is touched.
    When ``sample_ids`` maps ids to :func:`input_sha256`, an ``ok`` row that recorded another hash (its sample's
    question or document changed since) is refused too; rows written before the hash was recorded, and samples
    whose hash is ``None``, are not compared.

    Args:
        path: the predictions file (``--output``).
        sample_ids: the ids of the samples being run (``--input``), or a mapping of them to their input hashes;
            ``None``: not checked.

    Raises:
        DataError: a complete line is not a prediction row of these samples (naming ``file:line`` and why).
    """
    p = Path(path)
    hashes = sample_ids if isinstance(sample_ids, Mapping) else {}
    done: set[str] = set()
    for n, line in complete_lines(p):
        if not line.strip():
            continue
        why = _not_a_prediction(parse_line(line), sample_ids)
        if why:
            raise DataError(f"{p}:{n}: {why}; --resume continues the predictions file of an earlier run over the "
                            "same --input, and leaves any other file untouched (give a new --output)")
        row = parse_line(line)
        sid = row_sample_id(row)
        old, new = row.get("input_sha256"), hashes.get(sid)
        if row.get("status") == "ok" and old is not None and new is not None and old != new:
            raise DataError(f"{p}:{n}: the prediction of sample {sid!r} answered another question or document than "
                            "--input now holds (its input_sha256 differs); --resume keeps only answers to the same "
                            "samples: give a new --output, or delete that row to run the sample again")
        if row.get("status") == "ok":
            done.add(sid)
    return done


def _not_a_prediction(row: Any, sample_ids: Collection[str] | None) -> str | None:
    """Why ``row`` is not a prediction row of the given samples (``None``: it is one)."""
    if row is None:
        return "not JSON"
    if not isinstance(row, dict) or row_sample_id(row) is None or row.get("status") not in ("ok", "error"):
        return "not a predictions row (a row with a sample id and a status of 'ok' or 'error')"
    if sample_ids is not None and row_sample_id(row) not in sample_ids:
        return f"a prediction of sample {row_sample_id(row)!r}, which --input does not hold"
    return None


def resume_predictions(path: str | os.PathLike, settings: dict[str, Any],
                       defaults: dict[str, Any] | None = None,
                       answers: Mapping[str, Sequence[str]] | None = None) -> set[str]:
    """Before ``--resume`` appends to ``path``: refuse rows made with other settings (the rule of
    :mod:`memagent.runfiles.resume`), then keep only the ``ok`` rows (error rows are run again, and a torn last
    row is cut), so each sample ends with one row.

    Args:
        path: the predictions file.
        settings: what a prediction depends on now (recorded in every row).
        defaults: the defaults of settings recorded only when off their default.
        answers: the samples' gold answers now (``--input``): a kept row that copied other ones gets these (a
            prediction does not depend on the gold answers, so it is kept; its row must not show stale ones).

    Returns:
        the ids of the kept rows (the samples that are not run again).

    Raises:
        MemagentError: a row's recorded settings differ (names each difference), or the file cannot be rewritten.
    """
    p = Path(path)
    if not p.exists():
        return set()
    keep, ids = [], set()
    for _, line in complete_lines(p):
        if not line.strip():
            continue
        row = parse_line(line)  # finished_ids has already named any line that is not JSON
        old = row.get("settings") if isinstance(row, dict) else None
        changes = setting_changes(old, settings, defaults=defaults) if isinstance(old, dict) else []
        if changes:
            raise MemagentError(f"--resume: {p} holds rows made with other settings ({describe(changes)}); use the "
                                "same settings, or a new --output file")
        if isinstance(row, dict) and row.get("status") == "ok":
            sid = row_sample_id(row)
            gold = None if answers is None else answers.get(sid)
            if gold is not None and row.get("answers") != list(gold):
                line = dumps({**row, "answers": list(gold)}).rstrip("\n").encode("utf-8")
            keep.append(line + b"\n")
            ids.add(sid)
    try:
        rewrite(p, keep)
    except OSError as e:
        raise MemagentError(f"cannot write --output {p}: {e.strerror}") from None
    return ids
