"""Diagnostics of a whole run folder: its result rows, memory traces and samples, read from disk only.

``diagnose_run(run_dir)`` pairs every result row with its sample (``data/{task}_{length}.jsonl``, or the
task's files named in ``manifest.json``) and its trace turns (``row["trace"]``), and hands them to
:mod:`memagent.eval.diagnostics`. Whatever is missing (a trace never written or not committed, data not
rebuilt) makes that row's numbers "not measured", never zero.

Where center truncation cut a document and the run recorded no ranges (direct rows; agent traces written
before ``context_chars`` existed), the kept ranges are recomputed with the run's tokenizer when one is given:
the row's ``document_tokens`` (direct) or the method's ``max_context_tokens`` (agent) is the budget the run
cut with, so the cut is the same.

For training validation (``RUN/val/step_NNNNNN/``, written through the eval runner), :func:`validation_metrics`
turns a step's folder into named numbers for the training log.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memagent.eval.diagnostics import (CellDiagnostics, SampleDiagnosis, diagnose_agent, diagnose_direct, format_split,
                                      summarize_diagnostics)
from memagent.runfiles import read_manifest, read_results
from memagent.runfiles.trace import read_trace  # noqa: F401 - the trace reader lives with the trace files


def _task_files(manifest: Mapping[str, Any], task: str) -> dict[int, str]:
    for t in (manifest.get("config") or {}).get("tasks") or []:
        if isinstance(t, dict) and t.get("name") == task:
            return {int(k): str(v) for k, v in (t.get("files") or {}).items()}
    return {}


def _cell_file(run_dir: Path, manifest: Mapping[str, Any], task: str, length: int) -> Path | None:
    built = run_dir / "data" / f"{task}_{length}.jsonl"
    if built.is_file():
        return built
    given = _task_files(manifest, task).get(length)
    if given is None:
        return None
    p = Path(given)
    # a copied folder (a training validation's val_step_N/ committed under docs/) finds its task file by name in a
    # data/ or val_data/ folder beside it or up to two levels above (several runs of a study share one copy)
    near = [base / sub / p.name for base in (run_dir, run_dir.parent, run_dir.parent.parent) for sub in ("data", "val_data")]
    for cand in (p, run_dir / p, *near):
        if cand.is_file():
            return cand
    return None


def read_cell_samples(run_dir: str | os.PathLike, manifest: Mapping[str, Any], task: str, length: int) -> dict[str, dict[str, Any]]:
    """The samples of one cell by id, as dicts (``{}`` when the cell's data is not in the folder).

    Raises:
        DataError: the data file exists but cannot be read (naming it).
    """
    from memagent.data.io import read_samples

    path = _cell_file(Path(run_dir), manifest, task, length)
    if path is None:
        return {}
    return {s.id: s.to_dict() for s in read_samples(path)}


def _methods(manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in (manifest.get("config") or {}).get("methods") or [] if isinstance(m, dict) and "name" in m}


def _is_agent(row: Mapping[str, Any], method: Mapping[str, Any] | None) -> bool:
    if method is not None and "kind" in method:
        return method["kind"] == "memory_agent"
    return row.get("trace") is not None or int(row.get("turns") or 0) != 1


class _Views:
    """Kept character ranges of a context under center truncation, recomputed with a tokenizer (cached).

    Without a tokenizer given, the run's own is loaded on first need when its manifest names a loadable spec
    (:func:`_tokenizer_spec`: the grid's ``tokenizer:`` setting, ``bytes``, or the embedded model's file name);
    else the view stays unknown.
    """

    def __init__(self, tokenizer, manifest: Mapping[str, Any]):
        self.tokenizer = tokenizer
        self._spec = None if tokenizer is not None else _tokenizer_spec(manifest)
        self._cache: dict[tuple[Any, ...], Any] = {}

    def _load(self):
        if self.tokenizer is None and self._spec is not None:
            from memagent.errors import MemagentError
            from memagent.tokenization import load_tokenizer

            spec, self._spec = self._spec, None
            try:
                self.tokenizer = load_tokenizer(spec)
            except (MemagentError, OSError, ImportError):  # not loadable here: the view stays unknown (n/a)
                self.tokenizer = None
        return self.tokenizer

    def get(self, key: tuple[Any, ...], context: str, max_tokens: int | None):
        if max_tokens is None:
            return ((0, len(context)),)
        if self._load() is None:
            return None
        from memagent.chunking import center_truncate_ranges

        k = (*key, max_tokens)
        if k not in self._cache:
            self._cache[k] = center_truncate_ranges(context, self.tokenizer, max_tokens)[0]
        return self._cache[k]


def _tokenizer_spec(manifest: Mapping[str, Any]) -> str | None:
    """The spec that loads the tokenizer a run recorded: the grid's ``tokenizer:`` setting; else, from the
    tokenizer's recorded name, ``bytes``, or ``smollm2`` for a name of the embedded model's vocabulary (its GGUF
    file name, any quantization: :func:`memagent.embedded.is_smollm2_name`); else ``None`` (not loadable)."""
    from memagent.embedded import is_smollm2_name

    spec = (manifest.get("config") or {}).get("tokenizer")
    if isinstance(spec, str) and spec:
        return spec
    name = manifest.get("tokenizer")
    if not isinstance(name, str):
        return None
    return "bytes" if name == "bytes" else "smollm2" if is_smollm2_name(name) else None


def tokenizer_mismatch(manifest: Mapping[str, Any], spec: str, tokenizer) -> str | None:
    """The tokenizer a run's manifest records, when ``--tokenizer spec`` (loaded as ``tokenizer``) is another one;
    ``None`` when the manifest records none or the same one.

    The same: ``spec`` is the grid's ``tokenizer:`` setting; or the loaded tokenizer's ``name`` (a GGUF's file name,
    an HF folder's name, ``bytes``) is the recorded name; or both name the embedded model's vocabulary (``smollm2``
    and a SmolLM2-135M-Instruct GGUF of any quantization, :func:`memagent.embedded.is_smollm2_name`).
    """
    from memagent.embedded import is_smollm2_name

    setting = (manifest.get("config") or {}).get("tokenizer")
    recorded = manifest.get("tokenizer")
    if not isinstance(recorded, str) or not recorded:
        return setting if isinstance(setting, str) and setting and setting != spec else None
    if spec in (setting, recorded) or tokenizer.name == recorded:
        return None
    if is_smollm2_name(recorded) and (is_smollm2_name(spec) or is_smollm2_name(tokenizer.name)):
        return None
    return recorded


def diagnose_rows(run_dir: str | os.PathLike, rows: Sequence[Mapping[str, Any]], manifest: Mapping[str, Any],
                  tokenizer=None) -> list[SampleDiagnosis]:
    """Diagnose result rows of one run folder (see the module docstring).

    Args:
        run_dir: the run folder (traces and data are found relative to it).
        rows: its result rows (:func:`memagent.runfiles.read_results`).
        manifest: its ``manifest.json`` (``{}`` when there is none).
        tokenizer: the run's tokenizer, to recompute truncation cuts the rows do not record (optional; default:
            the one the manifest names, when it names a loadable spec).

    Raises:
        DataError: a cell's data file exists but cannot be read.
    """
    run = Path(run_dir)
    methods = _methods(manifest)
    samples: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    traces: dict[str, dict[str, list[dict[str, Any]]]] = {}
    views = _Views(tokenizer, manifest)
    out = []
    for r in rows:
        cell = (str(r["task"]), int(r["length"]))
        if cell not in samples:
            samples[cell] = read_cell_samples(run, manifest, *cell)
        sample = samples[cell].get(str(r["sample_id"]))
        method = methods.get(str(r["method"]))
        if not _is_agent(r, method):
            view = r.get("document_chars")
            if view is None and sample is not None and r.get("document_tokens") is not None:
                view = views.get((*cell, sample["id"]), sample["context"], int(r["document_tokens"]))
            out.append(diagnose_direct(r, sample, view))
            continue
        turns = None
        if r.get("trace"):
            if r["trace"] not in traces:
                traces[r["trace"]] = read_trace(run / r["trace"])
            turns = traces[r["trace"]].get(str(r["sample_id"]))
        view = None
        if sample is not None and method is not None and "max_context_tokens" in method:
            view = views.get((*cell, sample["id"]), sample["context"], method["max_context_tokens"])
        out.append(diagnose_agent(r, sample, turns, view))
    return out


def diagnose_run(run_dir: str | os.PathLike, tokenizer=None) -> list[SampleDiagnosis]:
    """Diagnose every result row of a run folder (``results.jsonl``, ``manifest.json``, ``traces/``, ``data/``).

    Raises:
        DataError: no readable ``results.jsonl``, or an unreadable manifest or data file.
    """
    run = Path(run_dir)
    return diagnose_rows(run, read_results(run / "results.jsonl"), read_manifest(run / "manifest.json"), tokenizer)


def run_cell_diagnostics(run_dir: str | os.PathLike, tokenizer=None) -> list[CellDiagnostics]:
    """Per (method, task, length) cell of a run folder, its :class:`CellDiagnostics`."""
    return summarize_diagnostics(diagnose_run(run_dir, tokenizer))


def validation_metrics(run_dir: str | os.PathLike, prefixes: Mapping[int, str], method: str | None = None,
                       tokenizer=None) -> dict[str, float]:
    """The diagnostics of a training-validation folder as named numbers for the training log.

    Args:
        run_dir: a validation step's folder (``RUN/val/step_NNNNNN``).
        prefixes: cell length (the validation cell's mean document tokens) -> name prefix, e.g.
            ``{tokens[m]: f"val/x{m}" for m in mults}``.
        method: the method whose rows to read (the trainer's validation has one, ``policy``); ``None``: every
            method (then give a folder with one method, or the names collide).
        tokenizer: only for traces without ``context_chars`` under center truncation.

    Returns:
        ``{f"{prefix}/{name}": value}`` for every measured number of :meth:`CellDiagnostics.metrics`
        (``captured_pct``, ``retained_pct``, ``early_guess_pct``, ``cap_hit_pct``, ``repeat_4gram_pct``,
        ``memory_tokens_mean``, the outcome shares ``never_captured_pct``, ``captured_then_lost_pct``, ...); numbers not measured are left out.

    Raises:
        DataError: the folder has no readable results.
    """
    out: dict[str, float] = {}
    for cell in run_cell_diagnostics(run_dir, tokenizer):
        prefix = prefixes.get(cell.length)
        if prefix is not None and (method is None or cell.method == method):
            out.update({f"{prefix}/{k}": v for k, v in cell.metrics().items()})
    return out


class RunsDiagnosis:
    """Diagnoses of the runs of one report, keyed the way the report labels its series.

    Attributes:
        runs: per run, ``(label, run_dir, rows, diagnoses)``; ``diagnoses[i]`` is that of ``rows[i]``.
        cells: ``(series label, task, length) -> CellDiagnostics``; a series label is the method name, or
            ``<run label>/<method>`` when several runs are compared.
    """

    def __init__(self, run_dirs: Sequence[str | os.PathLike], labels: Sequence[str], tokenizer=None):
        multi = len(run_dirs) > 1
        self.runs: list[tuple[str, Path, list[dict[str, Any]], list[SampleDiagnosis]]] = []
        self.cells: dict[tuple[str, str, int], CellDiagnostics] = {}
        for d, label in zip(run_dirs, labels):
            run = Path(d)
            rows = read_results(run / "results.jsonl")
            diags = diagnose_rows(run, rows, read_manifest(run / "manifest.json"), tokenizer)
            self.runs.append((label, run, rows, diags))
            for c in summarize_diagnostics(diags):
                self.cells[(f"{label}/{c.method}" if multi else c.method, c.task, c.length)] = c

    def cell(self, series_label: str, task: str, length: int) -> CellDiagnostics | None:
        return self.cells.get((series_label, task, int(length)))


#: The diagnostics columns of ``summary.csv`` (see :class:`memagent.eval.diagnostics.CellDiagnostics`).
CSV_COLUMNS = ("n_read", "read_pct", "n_tracked", "captured_pct", "retained_pct", "early_guess_pct", "distractor_answer_pct",
               "first_distractor_pct", "copied_over_pct",
               *(f"n_{k}" for k in ("correct", "retained_wrong", "captured_then_lost", "never_captured", "not_read",
                                    "in_view_wrong", "unmeasured")),
               "n_updates", "memory_tokens_mean", "cap_hit_pct", "repeat_4gram_pct", "empty_memory_pct", "unchanged_memory_pct",
               "correct_by_distractors_before")


def csv_cells(cell: CellDiagnostics | None) -> list[str]:
    """The :data:`CSV_COLUMNS` values of one cell: numbers with one decimal, ``""`` where not measured; the score
    split by distractors before the evidence as ``"0:2/3 3:0/6"`` (:func:`memagent.eval.diagnostics.format_split`)."""
    if cell is None:
        return [""] * len(CSV_COLUMNS)
    out = []
    for col in CSV_COLUMNS:
        v = cell.outcomes.get(col[2:]) if col.startswith("n_") and col[2:] in cell.outcomes else getattr(cell, col)
        if isinstance(v, dict):
            out.append(format_split(v))
            continue
        out.append("" if v is None else str(v) if isinstance(v, int) else f"{v:.1f}")
    return out
