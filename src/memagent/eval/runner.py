"""Run an evaluation grid (methods x tasks x lengths), one JSONL row per sample, resumable.

Run folder layout::

    manifest.json        provenance: config, per-method hash, prompt hashes, backend/model, tokenizer, seeds,
                         package version, git commit; ``task_settings`` keeps the data settings of every
                         task that has rows or data here, and ``config.methods``, ``method_hashes`` and
                         ``prompt_hashes`` the entries of every method that has rows here, also those a
                         later config leaves out
    results.jsonl        one row per (method, task, length, sample id), appended and fsync'ed as each
                         sample finishes
    data/                the samples of every (task, length) cell, built once and reused on resume
    traces/              memory-agent turn traces per (method, task, length)
    .lock                locked (``flock``) by the process running into the folder, released when it ends

Guarantees:

- Every sample gets a row. A request that fails gives a row with ``status="error"`` and the error message;
  summaries count it (score 0, ``n_error``), so the denominator never shrinks (the reference drops failed
  samples and retries them later; reference doc section 6 item 11).
- Resume: rows already in ``results.jsonl`` are skipped by key, so a killed run continues where it stopped and
  never counts a sample twice; a torn last line (killed mid-write) is cut off. Rows written under a different
  method configuration (a different ``method_hash``) make the runner stop instead of mixing results. Before a
  cell's trace file is appended to, the turns of samples without a row (killed between turns and row) or run
  again (``--retry-errors``) and a torn line are dropped, so each sample's turns appear once, those of its row.
- Every selected cell's data is built or read before the first model call, so a bad length or file stops the
  run at once instead of hours in.
- One writer at a time: a second ``memagent eval`` into a folder that a running one holds is refused at once
  (:func:`run_lock`), so two processes never write the same rows and trace turns twice.
- Cells are independent: a sample's data depends only on (data seed, task, length, sample id), and sampling
  seeds only on (seed, sample id, turn), not on which cells ran before.

Methods: ``memory_agent`` runs :class:`memagent.agent.loop.MemoryAgent`. ``direct`` is the long-context
baseline (:mod:`memagent.eval.direct`). A method whose ``backend:`` overrides grid-level backend settings runs
on a backend of its own, built once per distinct merged setting and closed at the end of the run.

Rows, traces, the manifest and the lock are written through :mod:`memagent.runfiles`; the folder's resume
checks live in :mod:`memagent.eval.folder`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memagent.errors import ConfigError, DataError, MemagentError
from memagent.eval.direct import DIRECT_TEMPLATE, DirectMethod, direct_template_hash  # noqa: F401 - re-exported
from memagent.eval.folder import RunFolder
from memagent.eval.grid import EvalConfig, MethodConfig, TaskConfig
from memagent.runfiles import (NOT_RUN, Outcome, ResultWriter, first_missing, folder_problem, prune_trace, remove_created, result_row,
                               run_lock, write_trace)
from memagent.runfiles import read_manifest, row_key  # noqa: F401 - re-exported (their home is memagent.runfiles)
from memagent.types import Sample, Trajectory

Log = Callable[[str], None]


class EvalRunner(RunFolder):
    """Runs an :class:`EvalConfig`.

    Args:
        config: the grid.
        backend: a ready backend for the grid's ``backend:`` settings (default: built from them); methods that
            override backend settings get their own, built from the merged settings.
        tokenizer: the model's tokenizer (default: ``config.tokenizer``, else the backend's).
        log: receives one progress line per cell (default: silent).
        retry_errors: re-run samples whose earlier row is an error (the new row supersedes it in summaries).
        progress: show the agent's progress bars.
    """

    def __init__(self, config: EvalConfig, backend=None, tokenizer=None, log: Log | None = None, retry_errors: bool = False, progress: bool = False):
        self.config = config
        self.run_dir = Path(config.output)
        self.log = log or (lambda _msg: None)
        self.retry_errors = retry_errors
        self.progress = progress
        if tokenizer is None and config.tokenizer:
            from memagent.tokenization import load_tokenizer

            tokenizer = load_tokenizer(config.tokenizer)
        self._given_tokenizer = tokenizer
        self._backends: dict[str, Any] = {}  # merged backend settings (as JSON) -> backend
        self._owned: list[Any] = []  # backends this runner built (and closes)
        self.backend = backend if backend is not None else self._open(config.backend)
        self._backends[_key(config.backend)] = self.backend
        self.tokenizer = tokenizer or getattr(self.backend, "tokenizer", None)
        if self.tokenizer is None:
            raise ConfigError(f"backend {self.backend.name!r} has no tokenizer: set `tokenizer:` in the eval config or pass --tokenizer")

    # -------------------------------------------------------------------------------------- backends
    def _open(self, settings: dict[str, Any]):
        from memagent.backends.factory import open_backend

        backend, _ = open_backend(settings, self._given_tokenizer)
        self._owned.append(backend)
        return backend

    def backend_of(self, method: MethodConfig):
        """The backend ``method`` runs on: the grid's, or one built (once) for its merged backend settings."""
        settings = self.config.backend_for(method)
        key = _key(settings)
        if key not in self._backends:
            self._backends[key] = self._open(settings)
        return self._backends[key]

    def _backends_in_use(self, only_methods: Sequence[str] | None) -> list[Any]:
        out = []
        for m in self.config.methods:
            b = self.backend_of(m)
            if (only_methods is None or m.name in only_methods) and all(b is not x for x in out):
                out.append(b)
        return out

    def close(self) -> None:
        """Close the backends this runner built for method overrides (a backend passed in stays open, and so
        does the grid's own, which :attr:`backend` exposes)."""
        for b in self._owned:
            if b is not self.backend:
                b.close()
        self._owned = [b for b in self._owned if b is self.backend]
        self._backends = {k: b for k, b in self._backends.items() if b is self.backend}

    # ------------------------------------------------------------------------------------------ data
    def cell_samples(self, task: TaskConfig, length: int) -> list[Sample]:
        """The samples of one (task, length) cell: from ``task.files``, else built once into ``data/``."""
        from memagent.data.io import read_samples, write_samples

        if length in task.files:
            try:
                samples = read_samples(task.files[length], limit=task.samples)
            except DataError as e:
                raise DataError(f"task {task.name!r}, file for length {length}: {e}") from None
            if not samples:
                raise DataError(f"task {task.name!r}: the file for length {length} ({task.files[length]}) holds no samples")
            return samples
        if task.files:
            raise ConfigError(f"task {task.name!r}: no file given for length {length} (files: {sorted(task.files)})")
        path = self.run_dir / "data" / f"{task.name}_{length}.jsonl"
        if path.exists():
            samples = read_samples(path)
            if len(samples) >= task.samples:
                return samples[: task.samples]
        try:
            samples = self._build(task, length)
        except DataError as e:
            raise DataError(f"task {task.name!r} at length {length} ({task.length_unit}): {e}") from None
        write_samples(path, samples)
        return samples

    def _build(self, task: TaskConfig, length: int) -> list[Sample]:
        from memagent.data.documents import build_all

        root = self.config.data_root
        if task.name == "hotpotqa":
            from memagent.data import paths
            from memagent.data.hotpotqa import build_pool, build_sample, load_hotpotqa, select_records

            records = load_hotpotqa(paths.data_file(paths.HOTPOTQA_DEV, root))
            pool = build_pool(records, name="hotpotqa-dev")
            seed = self.config.data_seed_for(task)
            kw = {"num_docs": length} if task.length_unit == "docs" else {"target_tokens": length}
            chosen = select_records(records, task.samples, keep_incomplete=task.keep_incomplete)
            return build_all(chosen, lambda r: build_sample(r, pool, self.tokenizer, seed, **kw),
                             lambda r: f"question {r.id}", f"{length} {task.length_unit}")
        from memagent.data.ruler import build_ruler_sample

        seed = self.config.data_seed_for(task)
        return build_all(range(task.samples),
                         lambda i: build_ruler_sample(task.name, length, i, self.tokenizer, seed, data_root=root),
                         lambda i: f"sample {i}", f"{length} tokens")

    # ------------------------------------------------------------------------------------------- run
    def run(self, only: Sequence[tuple[str, int | None]] | None = None,
            only_methods: Sequence[str] | None = None) -> Path:
        """Run every cell not yet complete; returns the path of ``results.jsonl``.

        Args:
            only: restrict this call to these ``(task, length)`` cells (``length=None``: every length of the
                task), run in the grid's order; the other cells are left for a later call. Lets a long grid be
                run in pieces, in any order, into one run folder.
            only_methods: restrict this call to these of the grid's methods (by name), e.g. the cheap direct
                baseline first; the others' rows are left for a later call.

        Raises:
            ConfigError: the run folder holds rows of a differently configured method of the same name, or
                ``only`` names a task or length not in the grid, or ``only_methods`` a method not in it, or
                another process is running into the same folder (see :func:`run_lock`).
            DataError: a cell's data cannot be built or read (raised before any cell runs).
        """
        problem = folder_problem(self.run_dir)
        if problem:
            raise ConfigError(f"run folder {str(self.run_dir)!r} {problem}: give a folder with --output")
        selected = self._select(only)
        names = [m.name for m in self.config.methods]
        if isinstance(only_methods, str):  # one method's name, not a list of its letters
            only_methods = [only_methods]
        if only_methods is not None:
            unknown = [m for m in only_methods if m not in names]
            if unknown or not only_methods:
                what = f"{', '.join(map(repr, unknown))} is not a method of the grid" if unknown else "name at least one method"
                raise ConfigError(f"--only-methods: {what} (the grid's methods, by name: {', '.join(names)})")
        created = first_missing(self.run_dir)  # the folders this call adds (None: the run folder exists)
        with run_lock(self.run_dir, self.log):  # before anything in the folder is read or repaired
            try:
                return self._run_locked(selected, only_methods)
            except MemagentError:  # removed while the lock is held, so no other run can be in the folder
                if created is not None:
                    _remove_if_untouched(self.run_dir, created)
                raise

    def _run_locked(self, selected: set[tuple[str, int]] | None, only_methods: Sequence[str] | None) -> Path:
        writer = ResultWriter(self.run_dir / "results.jsonl")
        try:
            for m in self.config.methods:
                old = writer.hashes.get(m.name, set()) - {self.config.method_hash(m)}
                if old:
                    raise ConfigError(
                        f"{self.run_dir}/results.jsonl holds rows of method {m.name!r} made with other settings "
                        f"(hash {sorted(old)[0]}: {self._method_changes(m)}); use a new --output folder or rename "
                        "the method"
                    )
            self._check_names_against_rows(writer)
            self.check_method_files(writer)
            self.check_methods()
            self.check_resume(writer)
            manifest, data = self.run_dir / "manifest.json", self.run_dir / "data"
            before = manifest.read_bytes() if manifest.is_file() else None
            built = set(data.glob("*.jsonl"))
            self.write_manifest(writer)
            cells = [(t, n) for t in self.config.tasks for n in t.lengths if selected is None or (t.name, n) in selected]
            try:
                self.prepare(cells, writer)
            except MemagentError:  # refused before any row (a missing file, a changed sample): the folder is left
                for p in set(data.glob("*.jsonl")) - built:  # as it was, so undoing the mistake resumes it
                    p.unlink()
                if before is None:
                    manifest.unlink(missing_ok=True)
                else:
                    manifest.write_bytes(before)
                raise
            for b in self._backends_in_use(only_methods) if cells else ():  # a server: fail before any row
                if callable(getattr(b, "check_reachable", None)):
                    b.check_reachable()
            for task, length in cells:
                samples = self.cell_samples(task, length)
                for method in self.config.methods:
                    if only_methods is not None and method.name not in only_methods:
                        continue
                    todo = [s for s in samples if self._needs_run(writer, method, task, length, s)]
                    self.log(f"[{method.name} | {task.name} | {length}] {len(samples) - len(todo)} done, {len(todo)} to run")
                    if todo:
                        self._run_cell(writer, method, task, length, todo)
        finally:
            writer.close()
            self._log_endpoints()
            self.close()
        return self.run_dir / "results.jsonl"

    def _check_names_against_rows(self, writer: ResultWriter) -> None:
        """Refuse a method or task named like one with rows in the folder up to :func:`memagent.eval.grid.name_key`
        (``RL`` after ``rl``): on macOS or Windows the two would share a trace folder.

        Raises:
            ConfigError: naming both names.
        """
        from memagent.eval.grid import name_key, same_name_text

        for kind, names, done in (("method", [m.name for m in self.config.methods], writer.hashes),
                                  ("task", [t.name for t in self.config.tasks], writer.tasks)):
            by_key = {name_key(d): d for d in done}
            for n in names:
                old = by_key.get(name_key(n))
                if old is not None and old != n:
                    raise ConfigError(f"{self.run_dir} holds rows of a {kind} named like this grid's: "
                                      f"{same_name_text(old, n)} would share one trace or data file on macOS or "
                                      f"Windows; use the name {old!r}, or a new --output folder")

    def _method_changes(self, method: MethodConfig) -> str:
        """What differs between ``method`` and the manifest's record of the method of that name (its settings and
        the grid-wide ones a method's hash covers), for the refusal message."""
        from memagent.runfiles import describe, setting_changes

        old_cfg = read_manifest(self.run_dir / "manifest.json").get("config") or {}
        new_cfg = self.config.to_dict()
        keys = ("backend", "tokenizer", "temperature", "top_p", "seed")
        old = {k: old_cfg.get(k) for k in keys if k in old_cfg}
        new = {k: new_cfg.get(k) for k in keys if k in old_cfg}
        old_m = next((m for m in old_cfg.get("methods", []) if isinstance(m, dict) and m.get("name") == method.name), None)
        new_m = next(m for m in new_cfg["methods"] if m.get("name") == method.name)
        if old_m is not None:
            old, new = {**old, "method": old_m}, {**new, "method": new_m}
        changes = setting_changes(old, new)
        if changes:
            return describe(changes)
        if old_m is None:
            return "the manifest does not record that method"
        return "its settings read the same, so a file they name (LoRA adapter, prompt file) has other contents"

    def _log_endpoints(self) -> None:
        """Per server backend in use: how its servers shared the requests (part of the run's summary)."""
        from memagent.backends.endpoints import describe_stats

        for b in self._backends.values():
            if callable(getattr(b, "endpoint_stats", None)):
                self.log(f"{b.name}: {describe_stats(b.endpoint_stats())}")

    def prepare(self, cells: Sequence[tuple[TaskConfig, int]], writer: ResultWriter | None = None) -> None:
        """Build or read the data of every cell before any model call, so that an impossible length, a missing
        or empty file, samples without gold answers, a sample file changed under the rows made from it, or a
        missing data root stops the run before hours of work; warns when a file holds fewer samples than asked.

        Args:
            cells: the (task, length) cells about to run.
            writer: the open results file, whose rows' ``sample_sha256`` the cells' samples must match.

        Raises:
            ConfigError, DataError: from :meth:`cell_samples`, naming the task and length; DataError when a
                cell's samples have no gold answers (every score would be 0) or differ from those a row was made
                from (a ``files:`` sample file edited or rebuilt).
        """
        for task, length in cells:
            samples = self.cell_samples(task, length)
            if writer is not None:
                self._check_unchanged(writer, task, length, samples)
            n = len(samples)
            unanswered = [s.id for s in samples if not s.has_gold_answer]
            if unanswered:
                where = f" ({task.files[length]})" if length in task.files else ""
                raise DataError(f"task {task.name!r} length {length}{where}: {len(unanswered)} of {n} samples have no "
                                f"gold answers (e.g. sample {unanswered[0]!r}), so every score would be 0; give each "
                                "sample an 'answers' list with a non-blank answer (use `memagent run` for predictions "
                                "without scoring)")
            if n < task.samples:
                self.log(f"warning: task {task.name!r} length {length}: {n} samples, fewer than samples: {task.samples}")
            if length in task.files:
                self._check_label(task, length, samples)
            empty = [s.id for s in samples if isinstance(s.context, str) and not s.context.strip()]
            if empty:  # scored all the same (as `memagent run` answers them), but worth knowing
                shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
                self.log(f"warning: task {task.name!r} length {length}: {len(empty)} sample(s) have an empty context "
                         f"({shown}): their answers come from no document at all")

    def _check_label(self, task: TaskConfig, length: int, samples: list[Sample]) -> None:
        """Warn when a ``files:`` cell's samples say they were built for another size than its key (memagent's
        builders record ``num_docs`` and ``target_tokens``): the summary and plot would show them at the key."""
        key = "num_docs" if task.length_unit == "docs" else "target_tokens"
        built = sorted({v for s in samples if isinstance(v := s.metadata.get(key), int) and not isinstance(v, bool)})
        if built and built != [length]:
            unit = "documents" if key == "num_docs" else "tokens"
            self.log(f"warning: task {task.name!r} length {length}: the samples of {task.files[length]} were built "
                     f"for {key} {', '.join(map(str, built))}, so the summary labels them {length} {unit} while they "
                     f"are not; give the file under the length it was built for")

    def _check_unchanged(self, writer: ResultWriter, task: TaskConfig, length: int, samples: list[Sample]) -> None:
        """Refuse a cell whose sample now reads differently from the one a row was made from."""
        from memagent.runfiles.rows import sample_sha256

        for s in samples:
            digest = sample_sha256(s)
            for m in self.config.methods:
                old = writer.inputs.get((m.name, task.name, length, s.id))
                if old is not None and digest is not None and old != digest:
                    where = task.files.get(length) or f"{self.run_dir}/data/{task.name}_{length}.jsonl"
                    raise DataError(
                        f"task {task.name!r} length {length}: sample {s.id!r} in {where} is not the one method "
                        f"{m.name!r}'s row was made from (its question, document or gold answers changed); a "
                        "resumed run would mix rows of two datasets: restore the file, or use a new --output folder")

    def check_methods(self) -> None:
        """Refuse, before any row is written, a method that cannot fit its backend's context window whatever the
        sample (agent: chunk + memory + caps; direct: prompt cap + answer cap).

        Raises:
            ConfigError: naming the method, the sum that does not fit and the settings to change.
        """
        for m in self.config.methods:
            if m.kind == "memory_agent":
                try:
                    self._make_agent(m).check_budget("", "(even with an empty question)")
                except ConfigError as e:
                    raise ConfigError(f"method {m.name!r}: {e}") from None
            else:
                self._direct(m).check()

    def _make_agent(self, method: MethodConfig):
        from memagent.agent.loop import MemoryAgent

        return MemoryAgent(self.backend_of(method), self.config.agent_for(method), tokenizer=self.tokenizer,
                           keep_token_ids=False)

    def _direct(self, method: MethodConfig) -> DirectMethod:
        return DirectMethod(method, self.config.agent_for(method), self.backend_of(method), self.tokenizer)

    def _select(self, only: Sequence[tuple[str, int | None]] | None) -> set[tuple[str, int]] | None:
        if only is None:
            return None
        grid = {t.name: t.lengths for t in self.config.tasks}
        out: set[tuple[str, int]] = set()
        for name, length in only:
            if name not in grid:
                raise ConfigError(f"--only: task {name!r} is not in the grid (tasks: {', '.join(grid)})")
            if length is not None and length not in grid[name]:
                raise ConfigError(f"--only: task {name!r} has no length {length} (lengths: {list(grid[name])})")
            out.update((name, n) for n in grid[name] if length is None or n == length)
        return out

    def _needs_run(self, writer: ResultWriter, method: MethodConfig, task: TaskConfig, length: int, s: Sample) -> bool:
        status = writer.done.get((method.name, task.name, length, s.id))
        return status is None or (self.retry_errors and status == "error")

    def _run_cell(self, writer: ResultWriter, method: MethodConfig, task: TaskConfig, length: int, samples: list[Sample]) -> None:
        cell = {"method": method.name, "task": task.name, "length": length, "length_unit": task.length_unit,
                "method_hash": self.config.method_hash(method)}
        metrics = task.metric_names()
        if method.kind == "memory_agent":
            self._run_agent(writer, method, samples, cell, metrics, f"{task.name}_{length}")
        else:
            self._direct(method).run(samples, lambda s, o: writer.write(result_row(s, o, cell=cell, metrics=metrics)))

    def _run_agent(self, writer, method: MethodConfig, samples, cell, metrics, name: str) -> None:
        agent = self._make_agent(method)
        trace_rel = f"traces/{method.name}/{name}.jsonl"
        trace = self.run_dir / trace_rel
        trace.parent.mkdir(parents=True, exist_ok=True)
        # resume: keep only the turns of samples that have a row and are not run again now (a kill between a
        # sample's turns and its row, or an error row retried, leaves turns of an attempt that no row records),
        # and drop a line torn by a kill, so that each sample's turns appear once
        rerun = {s.id for s in samples}
        keep = {k[3] for k in writer.done if k[:3] == (cell["method"], cell["task"], cell["length"])} - rerun
        try:
            prune_trace(trace, keep)
        except OSError as e:
            raise DataError(f"cannot rewrite the trace file {trace} before resuming ({e.strerror or e})") from None
        runnable = []
        for s in samples:  # a question too long for the window is one bad sample, not a crashed run
            try:
                agent.check_budget(s.question, s.id)
                runnable.append(s)
            except ConfigError as e:
                writer.write(result_row(s, Outcome(error=f"{NOT_RUN}{e}"), cell=cell, metrics=metrics))

        def on_result(s: Sample, traj: Trajectory) -> None:
            write_trace(trace, [traj], append=True)
            writer.write(result_row(s, Outcome.of_trajectory(traj), cell=cell, metrics=metrics, trace=trace_rel))

        agent.run(runnable, on_result=on_result, progress=self.progress)


def _key(settings: dict[str, Any]) -> str:
    """A backend's settings as a cache key (objects that are not JSON, such as a model, by identity)."""
    return json.dumps(settings, sort_keys=True, default=lambda o: f"<{type(o).__name__} {id(o)}>")


def _remove_if_untouched(run_dir: Path, created: Path) -> None:
    """Remove a run folder this call created when the run was refused before any result row was written (a
    method that cannot fit, a missing data file, a bad data root): everything in it (lock, manifest, data built
    so far) is this call's own, and a corrected config must start afresh rather than meet the refused one's
    manifest."""
    import shutil

    results = run_dir / "results.jsonl"
    try:
        if results.exists() and results.stat().st_size > 0:
            return
    except OSError:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    if created != run_dir:  # the folders made on the way to it, where empty
        remove_created(run_dir.parent, created)
