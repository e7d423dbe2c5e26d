"""Reports from result files only: Markdown and CSV tables, and accuracy-vs-length plots.

``write_report(run_dirs, out_dir)`` reads each run's ``results.jsonl`` (and ``manifest.json`` for labels),
never a model, so reports can be redone at any time. With several runs, methods are labelled
``<run name>/<method>`` and compared in one table. Scores are shown in percent.

Outputs in ``out_dir``: ``summary.csv`` (one row per run/method/task/length with every count and metric),
``summary.md`` (per task: lengths down, with their unit, methods across, ``mean ± stderr`` plus error/empty
counts, and the ``n`` of a cell with fewer samples than its grid asked for), ``accuracy.png`` (one panel per
task and length unit: accuracy against length on a log axis, one line per method, in the manner of the paper's
Figure 1) and ``report.html`` (self-contained: the plot, the diagnostics table and a per-sample memory timeline,
:mod:`memagent.eval.html`). Every table carries the memory diagnostics of
:mod:`memagent.eval.diagnostics` (capture, retention, outcome classes, memory health), read from the runs'
traces and data; a number that cannot be measured (no trace, say) is empty in the CSV and ``n/a`` elsewhere.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from memagent.errors import DataError
from memagent.eval.metrics import CellSummary, length_label, length_with_unit, read_results, summarize
from memagent.eval.runner import read_manifest


def _warn_torn(path: Path) -> Callable[[int], None]:
    """What ``read_results`` calls for a torn last line of ``path``: a warning on stderr (the row is left out,
    its cell shows a smaller n; running the same ``memagent eval`` again repairs the file and reruns it)."""
    import sys

    def warn(line: int) -> None:
        sys.stderr.write(f"warning: {path}:{line}: the last row was torn by a kill and is left out of the report; "
                         "running the same memagent eval again repairs it and reruns that sample\n")

    return warn


def load_runs(run_dirs: Sequence[str | os.PathLike]) -> list[tuple[str, list[CellSummary], dict]]:
    """``(label, summaries, manifest)`` per run folder (label: the manifest's name, else the folder name); each
    summary's ``n_asked`` is the samples per cell the manifest's grid asked for its task (:func:`asked_samples`).

    Raises:
        DataError: a folder has no ``results.jsonl``, an unreadable row or manifest, a score that is not a fraction
            in [0, 1], or a cell that mixes rows of different settings (:func:`memagent.eval.metrics.summarize`).
    """
    from dataclasses import replace

    runs = []
    for d in run_dirs:
        p = Path(d)
        manifest = read_manifest(p / "manifest.json")
        rows = read_results(p / "results.jsonl", on_torn=_warn_torn(p / "results.jsonl"))
        asked = asked_samples(manifest)
        cells = [replace(c, n_asked=asked.get(c.task)) for c in summarize(rows, str(p / "results.jsonl"))]
        runs.append((manifest.get("name") or p.name, cells, manifest))
    labels = [r[0] for r in runs]
    if len(set(labels)) != len(labels):  # two runs with one name: the shortest distinct folder path endings
        labels = _distinct_labels([Path(d).resolve() for d in run_dirs])
        runs = [(label, s, m) for label, (_, s, m) in zip(labels, runs)]
    return runs


def asked_samples(manifest: dict) -> dict[str, int]:
    """Task -> the samples per cell its grid asked for: the manifest's ``task_settings`` (the largest count any
    run into the folder asked for), else its config's tasks; tasks that record none are left out."""
    out: dict[str, int] = {}
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}  # a hand-edited manifest:
    tasks = config.get("tasks") if isinstance(config.get("tasks"), list) else []  # no counts, not a crash
    settings = manifest.get("task_settings") if isinstance(manifest.get("task_settings"), dict) else {}
    for t in tasks:
        if isinstance(t, dict) and isinstance(t.get("samples"), int) and isinstance(t.get("name"), str):
            out[t["name"]] = t["samples"]
    for name, t in settings.items():
        if isinstance(t, dict) and isinstance(t.get("samples"), int):
            out[name] = t["samples"]
    return out


def _distinct_labels(paths: list[Path]) -> list[str]:
    """``[a/x/s, b/x/s]`` -> ``["a/x/s", "b/x/s"]``: the fewest trailing path parts that tell runs apart."""
    depth = max(len(p.parts) for p in paths)
    for k in range(1, depth + 1):
        labels = ["/".join(p.parts[-k:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{p.name}#{i + 1}" for i, p in enumerate(paths)]  # the same folder given twice


def _series(runs) -> list[tuple[str, CellSummary]]:
    multi = len(runs) > 1
    return [(f"{label}/{c.method}" if multi else c.method, c) for label, cells, _ in runs for c in cells]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _short(c: CellSummary, full: int) -> bool:
    """Whether a cell has fewer samples than its grid asked for, or than the fullest cell of its task (a cell
    still running, a grid resumed in pieces): its ``n`` is shown beside it."""
    return c.n < max(full, c.n_asked or 0)


def write_csv(path: Path, series: list[tuple[str, CellSummary]], diagnostics=None) -> None:
    """``summary.csv``: one row per series and cell; with ``diagnostics`` (a
    :class:`memagent.eval.run_diagnostics.RunsDiagnosis`), the diagnostics columns after the metric columns."""
    from memagent.eval.run_diagnostics import CSV_COLUMNS, csv_cells

    metric_names = sorted({k for _, c in series for k in c.means})
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["method", "task", "length", "length_unit", "metric", "mean_pct", "stderr_pct", "n", "n_error", "n_empty",
                    "mean_ok_pct", "mean_context_tokens", "mean_seconds"] + [f"{m}_pct" for m in metric_names]
                   + (list(CSV_COLUMNS) if diagnostics is not None else []))
        for label, c in series:
            ctx = "" if c.mean_context_tokens is None else f"{c.mean_context_tokens:.0f}"
            extra = csv_cells(diagnostics.cell(label, c.task, c.length)) if diagnostics is not None else []
            w.writerow([label, c.task, c.length, c.length_unit, c.metric, _pct(c.mean), _pct(c.stderr), c.n, c.n_error, c.n_empty,
                        _pct(c.mean_ok) if c.mean_ok is not None else "", ctx, f"{c.mean_seconds:.2f}"] + [_pct(c.means[m]) if m in c.means else "" for m in metric_names]
                       + extra)


def markdown_table(series: list[tuple[str, CellSummary]]) -> str:
    """Per task: a table with lengths as rows and methods as columns; cells ``mean ± stderr`` in percent,
    followed by ``(n, errors, empty)`` when any error or empty answer occurred, or by ``(n)`` when the cell
    has fewer samples than its grid asked for (``n_asked``) or than the task's fullest cell (a partial or resumed
    grid); the table's heading says what the mark means. Lengths carry their unit: the column header says
    ``length (tokens)`` when every row counts tokens; in a table that mixes units each row names its own
    (``2K tok``, ``10 docs (~1.4K tok)``)."""
    out = []
    for task in sorted({c.task for _, c in series}):
        cells = [(lab, c) for lab, c in series if c.task == task]
        methods = list(dict.fromkeys(lab for lab, _ in cells))
        lengths = sorted({(c.length, c.length_unit) for _, c in cells})
        metric_of = {lab: c.metric for lab, c in cells}
        ns = {c.n for _, c in cells}
        full = max(ns)
        asked = max((c.n_asked or 0 for _, c in cells), default=0)
        if not any(_short(c, full) for _, c in cells):
            count = f"n per cell = {full}"
        else:
            count = (f"n per cell = {full}" if len(ns) == 1 else f"n per cell up to {full}") + \
                (f" of {asked} asked" if asked > full else "") + "; (n=…) marks a cell with fewer samples than " + \
                ("its grid asked for or than the fullest cell" if asked else "the fullest cell")
        if len(set(metric_of.values())) == 1:
            out.append(f"### {task} ({cells[0][1].metric}, %; {count})\n")
            heads = methods
        else:  # runs that score this task differently: each column names its metric
            out.append(f"### {task} (%, metric per column; {count})\n")
            heads = [f"{m} [{metric_of[m]}]" for m in methods]
        tokens_only = all(unit != "docs" for _, unit in lengths)
        out.append(f"| length{' (tokens)' if tokens_only else ''} | " + " | ".join(heads) + " |")
        out.append("|---|" + "---|" * len(methods))
        index = {(lab, c.length, c.length_unit): c for lab, c in cells}
        for length, unit in lengths:
            row = []
            for m in methods:
                c = index.get((m, length, unit))
                if c is None:
                    row.append("")
                    continue
                txt = f"{_pct(c.mean)} ± {_pct(c.stderr)}"
                if c.n_error or c.n_empty:
                    txt += f" (n={c.n}, err={c.n_error}, empty={c.n_empty})"
                elif _short(c, full):  # a cell still running, or a grid resumed in pieces
                    txt += f" (n={c.n})"
                row.append(txt)
            ctx = next((c.mean_context_tokens for lab, c in cells
                        if c.length == length and c.length_unit == unit and c.mean_context_tokens), None)
            label = (length_label(length, unit) if tokens_only else length_with_unit(length, unit)) + \
                (f" (~{ctx / 1000:.1f}K tok)" if unit == "docs" and ctx else "")
            out.append(f"| {label} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def plot_accuracy(path: Path, series: list[tuple[str, CellSummary]]) -> None:
    """One panel per task and length unit: mean score (%) against length (log x axis), one line per method, stderr
    bars; a cell with fewer samples than its grid asked for or than the panel's fullest cell is labelled with its
    ``n`` (see :func:`accuracy_figure`)."""
    import matplotlib.pyplot as plt

    fig = accuracy_figure(series)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def accuracy_figure(series: list[tuple[str, CellSummary]]):
    """The matplotlib figure of :func:`plot_accuracy`: one axes per (task, length unit), sorted by task name then
    unit (``docs`` before ``tokens``), each x axis labelled with its unit; a task whose runs count lengths in two
    units (documents and tokens) gets two panels, titled ``task (docs)`` and ``task (tokens)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c.task, c.length_unit) for _, c in series})
    mixed = {t for t, _ in panels if sum(t == x for x, _ in panels) > 1}
    style = {lab: k for k, lab in enumerate(dict.fromkeys(lab for lab, _ in series))}  # one look per method, every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (task, unit) in zip(axes[0], panels):
        cells = [(lab, c) for lab, c in series if c.task == task and c.length_unit == unit]
        labels = list(dict.fromkeys(lab for lab, _ in cells))
        full = max(c.n for _, c in cells)
        metric_of = {lab: c.metric for lab, c in cells}
        one_metric = len(set(metric_of.values())) == 1
        for i, lab in enumerate(labels):
            k = style[lab]
            pts = sorted((c.length, c.mean, c.stderr, c.n) for m, c in cells if m == lab)
            shift = 2 ** (0.04 * (i - (len(labels) - 1) / 2))  # equal scores stay visible side by side
            xs = [p[0] * shift for p in pts]
            ys = [100 * p[1] for p in pts]
            ax.errorbar(xs, ys, yerr=[100 * p[2] for p in pts], capsize=3, label=lab if one_metric else f"{lab} [{metric_of[lab]}]",
                        color=f"C{k % 10}", marker="osD^v<>"[k % 7], linestyle=["-", "--", ":", "-."][k % 4])
            short = {c.length for m, c in cells if m == lab and _short(c, full)}
            for x, y, p in zip(xs, ys, pts):
                if p[0] in short:  # a partial cell: its n, so a reader does not take it for a full one
                    ax.annotate(f"n={p[3]}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7,
                                color=f"C{k % 10}")
        ax.set_xscale("log", base=2)
        xs_all = sorted({c.length for _, c in cells})
        ax.set_xticks(xs_all)
        ax.minorticks_off()
        ax.set_xlim(min(xs_all) / 1.6, max(xs_all) * 1.6)
        ax.set_xticklabels([length_label(x, unit).replace(" docs", "") for x in xs_all])
        ax.set_xlabel("documents" if unit == "docs" else "context length (tokens)")
        ax.set_ylabel(f"{cells[0][1].metric} (%)" if one_metric else "score (%, metric per line)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{task} ({unit})" if task in mixed else task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_report(run_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None, plot: bool = True,
                 tokenizer=None, html: bool = True) -> list[Path]:
    """Write ``summary.csv``, ``summary.md``, ``accuracy.png`` and ``report.html`` for one or more runs.

    Args:
        run_dirs: run folders (each with ``results.jsonl``); one folder may be given alone.
        out_dir: where to write (default: the run folder when there is one; required for several, so that a
            comparison never replaces a run's own summary). A folder that holds another eval run (its
            ``results.jsonl`` or ``manifest.json``) is refused unless it is the one run reported.
        plot: also draw the PNG (and put it in the HTML page); without it an ``accuracy.png`` already in the output
            folder (an earlier report's) is removed, with a note on stderr, so no stale plot sits beside the tables.
        tokenizer: the runs' tokenizer, to tell where center truncation cut documents that the rows and traces
            do not record (direct rows; older traces); without it those rows' evidence view is not measured.
        html: also write ``report.html``.

    Returns:
        The files written.

    Raises:
        DataError: no run folders, or a folder without results or with rows :func:`load_runs` refuses (a score
            outside [0, 1], a cell mixing settings), or several runs without ``out_dir`` or with one of them as
            ``out_dir``, an ``out_dir`` that holds another run, or an output folder that cannot be written.
    """
    if isinstance(run_dirs, (str, os.PathLike)):  # one folder, not a list of its characters
        run_dirs = [run_dirs]
    if not run_dirs:
        raise DataError("give at least one run folder")
    if out_dir is None and len(run_dirs) > 1:
        raise DataError(f"comparing {len(run_dirs)} runs: give the output folder with --out (writing into the first "
                        "run folder would replace its own summary)")
    if out_dir is not None and len(run_dirs) > 1:
        same = [str(d) for d in run_dirs if Path(d).resolve() == Path(out_dir).resolve()]
        if same:
            raise DataError(f"--out {str(out_dir)!r} is one of the compared runs ({same[0]}): the comparison would "
                            "replace that run's own summary; give another folder")
    if out_dir is not None:
        _refuse_other_run(Path(out_dir), run_dirs)
    runs = load_runs(run_dirs)
    series = _series(runs)
    if not series:
        raise DataError(f"no result rows in {', '.join(map(str, run_dirs))}")
    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0])
    from memagent.runfiles import folder_problem

    problem = folder_problem(out)
    if problem:
        raise DataError(f"report output {str(out)!r} {problem}: give a folder with --out")
    try:
        return _write(out, runs, series, plot, run_dirs, tokenizer, html)
    except OSError as e:
        raise DataError(f"cannot write the report into {str(out)!r} ({e.strerror or e}); give a writable folder with --out") from None


def _refuse_other_run(out: Path, run_dirs: Sequence[str | os.PathLike]) -> None:
    """Refuse an output folder that is another eval run's folder (the report would replace its own summary). A
    copy of a run reported (its manifest's ``name`` and ``started_at`` are that run's: a committed results folder
    refreshed from its working copy under ``runs/``) is the same run, and allowed.

    Raises:
        DataError: naming the folder and the run file found in it.
    """
    if any(Path(d).resolve() == out.resolve() for d in run_dirs):
        return

    def identity(folder: Path):
        try:
            m = read_manifest(folder / "manifest.json")
        except DataError:
            return None
        return (m.get("name"), m.get("started_at")) if m.get("started_at") else None

    mine = identity(out)
    if mine is not None and any(identity(Path(d)) == mine for d in run_dirs):
        return
    found = [name for name in ("results.jsonl", "manifest.json") if (out / name).is_file()]
    if found:
        raise DataError(f"--out {str(out)!r} is another eval run's folder (it holds {found[0]}), not one of the runs "
                        "reported: the report would replace that run's summary.csv, summary.md, accuracy.png and "
                        "report.html; give a folder that holds no run (or leave --out out to write into the run "
                        "reported)")


def _write(out: Path, runs, series, plot: bool, run_dirs, tokenizer=None, html: bool = True) -> list[Path]:
    from memagent.eval.run_diagnostics import RunsDiagnosis

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.csv", out / "summary.md"]
    diag = RunsDiagnosis(run_dirs, [label for label, _, _ in runs], tokenizer)
    write_csv(written[0], series, diag)
    header = ["# Evaluation summary\n"]
    for label, _, m in runs:
        if m:
            header.append(f"- **{label}**: backend `{m.get('backend')}`, tokenizer `{m.get('tokenizer')}`, seed {m.get('seed')}, "
                          f"prompt hashes {m.get('prompt_hashes')}, memagent {m.get('package_version')} ({(m.get('git_commit') or '')[:10]})")
    header.append("\nScores in %, mean ± standard error over all samples of a cell; failed requests count as 0 "
                  "(err = failed samples, empty = empty extracted answers).\n")
    from memagent.eval.html import diagnostics_markdown, write_html

    cells = [(label, c, diag.cell(label, c.task, c.length)) for label, c in series]
    written[1].write_text("\n".join(header) + "\n" + markdown_table(series) + "\n## Memory diagnostics (docs/diagnostics.md)\n\n"
                          + diagnostics_markdown(cells), encoding="utf-8")
    if plot:
        written.append(out / "accuracy.png")
        plot_accuracy(written[-1], series)
    elif (out / "accuracy.png").is_file():  # an earlier report's plot would no longer match these tables
        import sys

        (out / "accuracy.png").unlink()
        sys.stderr.write(f"removed {out / 'accuracy.png'}: an earlier report's plot, stale beside this summary "
                         "(--no-plot draws none)\n")
    if html:
        written.append(out / "report.html")
        png = (out / "accuracy.png").read_bytes() if plot else None
        write_html(written[-1], [h[2:].replace("**", "").replace("`", "") for h in header[1:-1]], png, cells, diag)
    return written
