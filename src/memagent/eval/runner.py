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
baseline: the whole document in one prompt (:data:`DIRECT_TEMPLATE`), the document center-truncated so the
prompt fits ``max_input_tokens``; the reference instead truncates the whole rendered prompt, which can cut
into the question (reference doc section 1.7).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memagent.errors import ConfigError, DataError
from memagent.eval.grid import EvalConfig, MethodConfig, TaskConfig
from memagent.types import Message, Request, Sample, Trajectory

#: The direct baseline's prompt (memagent's wording; slots {document}, {question}).
DIRECT_TEMPLATE = (
    "Read the document below and answer the question that follows it.\n\n<document>\n{document}\n</document>\n\n"
    "Question: {question}\n\nAnswer briefly and put the final answer in \\boxed{{}}."
)

Log = Callable[[str], None]


def direct_template_hash() -> str:
    return hashlib.sha256(DIRECT_TEMPLATE.encode()).hexdigest()[:12]


def row_key(row: dict[str, Any]) -> tuple[str, str, int, str]:
    """The identity of a result row: (method, task, length, sample id)."""
    return (row["method"], row["task"], int(row["length"]), str(row["sample_id"]))


class ResultWriter:
    """Appends rows to ``results.jsonl``, flushing and fsync'ing each one.

    On open, a last line without a newline (a row torn by a kill) is cut off, and the keys and method hashes of
    the complete rows are loaded for resume checks.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: dict[tuple[str, str, int, str], str] = {}
        self.hashes: dict[str, set[str]] = {}
        self.tasks: set[str] = set()  # tasks with rows
        self.metrics: dict[str, set[tuple[str, ...]]] = {}  # task -> the metric lists its rows were scored with
        if self.path.exists():
            self._repair_and_load()
        self._f = open(self.path, "a", encoding="utf-8")

    def _repair_and_load(self) -> None:
        from memagent.eval.metrics import read_results

        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
        for row in read_results(self.path):  # checked rows; of a key written twice (--retry-errors), the last
            self._record(row)

    def _record(self, row: dict[str, Any]) -> None:
        self.done[row_key(row)] = row["status"]
        self.hashes.setdefault(row["method"], set()).add(row.get("method_hash", ""))
        self.tasks.add(row["task"])
        self.metrics.setdefault(row["task"], set()).add(tuple(row["scores"]))

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._record(row)

    def close(self) -> None:
        self._f.close()


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike, log: Log | None = None) -> Iterator[None]:
    """Hold an exclusive lock on a run folder (``fcntl.flock`` on ``RUN/.lock``) for the ``with`` block, so that
    two ``memagent eval`` processes never append to one folder at once. The kernel releases the lock when the
    process ends, however it ends, so a killed run never leaves the folder locked; the ``.lock`` file itself
    stays. A no-op where ``fcntl`` does not exist (not POSIX), and, with a warning to ``log``, on a file
    system that refuses locks.

    Raises:
        ConfigError: another process holds the lock (naming the folder).
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    path = Path(run_dir) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+b")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"run folder {str(run_dir)!r} is locked: another memagent eval is writing to it "
                                  f"({path}); wait for it to finish, or use another --output folder") from None
            (log or (lambda _msg: None))(f"warning: cannot lock run folder {str(run_dir)!r} ({e.strerror or e}); "
                                         "running without a lock")
        yield
    finally:
        f.close()  # closing the only descriptor releases the lock


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A run folder's ``manifest.json`` as a dict (``{}`` when the file does not exist).

    Raises:
        DataError: the file is not a JSON object (naming it and what to do).
    """
    p = Path(path)
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{p}: not a readable manifest ({e}); restore it, or move it away to treat the folder as "
                        "unrecorded (its settings are then not checked)") from None
    if not isinstance(data, dict):
        raise DataError(f"{p}: a manifest is a JSON object, got {type(data).__name__}; restore it or move it away")
    return data


#: Per task, the settings that decide its data and scores (what a resumed run may not change).
TASK_SETTINGS = ("unit", "files", "metrics", "samples", "keep_incomplete")


def _task_settings(task: dict[str, Any]) -> dict[str, Any]:
    out = {k: task.get(k) for k in TASK_SETTINGS}
    # files by name: a run folder that moved (training validation) keeps its data
    out["files"] = {str(k): Path(v).name for k, v in (task.get("files") or {}).items()}
    out["metrics"] = list(task.get("metrics") or [])
    return out


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("memagent")
    except Exception:  # not installed: source checkout
        return "unknown"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class EvalRunner:
    """Runs an :class:`EvalConfig`.

    Args:
        config: the grid.
        backend: a ready backend (default: built from ``config.backend``).
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
        if backend is None:
            from memagent.backends import make_backend

            kw = {k: v for k, v in config.backend.items() if k != "name"}
            if config.backend["name"] == "openai" and tokenizer is not None:
                kw.setdefault("tokenizer", tokenizer)  # the server's model, counted locally
            backend = make_backend(config.backend["name"], **kw)
        self.backend = backend
        self.tokenizer = tokenizer or getattr(backend, "tokenizer", None)
        if self.tokenizer is None:
            raise ConfigError(f"backend {backend.name!r} has no tokenizer: set `tokenizer:` in the eval config or pass --tokenizer")

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
        root = self.config.data_root
        if task.name == "hotpotqa":
            from memagent.data import paths
            from memagent.data.hotpotqa import build_pool, build_sample, load_hotpotqa, select_records

            records = load_hotpotqa(paths.data_file(paths.HOTPOTQA_DEV, root))
            pool = build_pool(records, name="hotpotqa-dev")
            seed = self.config.data_seed if self.config.data_seed is not None else 0
            kw = {"num_docs": length} if task.length_unit == "docs" else {"target_tokens": length}
            chosen = select_records(records, task.samples, keep_incomplete=task.keep_incomplete)
            return [build_sample(r, pool, self.tokenizer, seed, **kw) for r in chosen]
        from memagent.data.ruler import build_ruler_sample

        seed = self.config.data_seed if self.config.data_seed is not None else 42
        return [build_ruler_sample(task.name, length, i, self.tokenizer, seed, data_root=root) for i in range(task.samples)]

    # ------------------------------------------------------------------------------------------- run
    def _started_tasks(self, writer: ResultWriter | None) -> set[str]:
        """Tasks that have result rows or built data in the run folder (their settings are fixed)."""
        started = set(writer.tasks) if writer is not None else set()
        data = self.run_dir / "data"
        names = {t.name for t in self.config.tasks} | set(self._old_task_settings())
        for name in names:
            if any(data.glob(f"{name}_*.jsonl")):
                started.add(name)
        return started

    def _old_task_settings(self) -> dict[str, dict[str, Any]]:
        """The data settings recorded for each task by earlier runs into this folder (older manifests: their
        config's tasks)."""
        old = read_manifest(self.run_dir / "manifest.json")
        if "task_settings" in old:
            return dict(old["task_settings"])
        return {t["name"]: _task_settings(t) for t in (old.get("config") or {}).get("tasks", []) if isinstance(t, dict)}

    def write_manifest(self, writer: ResultWriter | None = None) -> None:
        """Write ``manifest.json``, keeping the first start time, the settings of tasks that have rows or data but
        are not in this config, and the entries (``config.methods``, ``method_hashes``, ``prompt_hashes``) of
        methods that have rows but are not in this config."""
        from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates

        prompt_hashes = {}
        for m in self.config.methods:
            if m.kind == "direct":
                prompt_hashes[m.name] = direct_template_hash()
            else:
                prompt_hashes[m.name] = (PromptTemplates.from_file(m.templates) if m.templates else DEFAULT_TEMPLATES).hash
        path = self.run_dir / "manifest.json"
        old = read_manifest(path)
        config = self.config.to_dict()
        method_hashes = {m.name: self.config.method_hash(m) for m in self.config.methods}
        old_methods = {m["name"]: m for m in (old.get("config") or {}).get("methods", []) if isinstance(m, dict) and "name" in m}
        for name in self._earlier_methods(writer, old):  # methods of earlier runs that have rows here
            if name in old_methods:
                config["methods"].append(old_methods[name])
            recorded = (old.get("method_hashes") or {}).get(name)  # else the rows' own (a manifest that lost it)
            found = recorded or (min((h for h in writer.hashes[name] if h), default=None) if writer is not None else None)
            if found:
                method_hashes[name] = found
            if name in (old.get("prompt_hashes") or {}):
                prompt_hashes[name] = old["prompt_hashes"][name]
        manifest = {
            "name": self.config.name,
            "config": config,
            "method_hashes": method_hashes,
            "prompt_hashes": prompt_hashes,
            "backend": self.backend.name,
            "context_tokens": self.backend.context_tokens,
            "tokenizer": self.tokenizer.name,
            "seed": self.config.seed,
            "data_seed": self.config.data_seed,
            "task_settings": self._merged_task_settings(writer),
            "package_version": _package_version(),
            "git_commit": _git_commit(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a resumed run keeps its first start time and lists every resume
            manifest["resumed_at"] = old.get("resumed_at", []) + [manifest["started_at"]]
            manifest["started_at"] = old.get("started_at", manifest["started_at"])
        path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def _earlier_methods(self, writer: ResultWriter | None, old: dict[str, Any]) -> list[str]:
        """Methods that have rows in the folder but are not in this config (their manifest entries are kept):
        in the old manifest's order, then any it does not list (an older manifest that lost them)."""
        with_rows = set(writer.hashes) if writer is not None else set()
        names = {m.name for m in self.config.methods}
        listed = [m.get("name") for m in (old.get("config") or {}).get("methods", []) if isinstance(m, dict)]
        order = list(dict.fromkeys([*listed, *(old.get("method_hashes") or {}), *sorted(with_rows)]))
        return [n for n in order if n in with_rows and n not in names]

    def _merged_task_settings(self, writer: ResultWriter | None) -> dict[str, dict[str, Any]]:
        started = self._started_tasks(writer)
        merged = {k: v for k, v in self._old_task_settings().items() if k in started}
        for t in self.config.tasks:
            new = _task_settings(json.loads(json.dumps(asdict(t))))
            if t.name in merged:
                new["samples"] = max(new["samples"], merged[t.name].get("samples") or 0)
            merged[t.name] = new
        return merged

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
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"run folder {str(self.run_dir)!r} is a file: give a folder with --output")
        selected = self._select(only)
        names = [m.name for m in self.config.methods]
        if only_methods is not None:
            unknown = [m for m in only_methods if m not in names]
            if unknown or not only_methods:
                what = f"{', '.join(map(repr, unknown))} is not a method of the grid" if unknown else "name at least one method"
                raise ConfigError(f"--only-methods: {what} (the grid's methods, by name: {', '.join(names)})")
        with run_lock(self.run_dir, self.log):  # before anything in the folder is read or repaired
            return self._run_locked(selected, only_methods)

    def _run_locked(self, selected: set[tuple[str, int]] | None, only_methods: Sequence[str] | None) -> Path:
        writer = ResultWriter(self.run_dir / "results.jsonl")
        try:
            for m in self.config.methods:
                old = writer.hashes.get(m.name, set()) - {self.config.method_hash(m)}
                if old:
                    raise ConfigError(
                        f"{self.run_dir}/results.jsonl holds rows of method {m.name!r} made with other settings "
                        f"(hash {sorted(old)[0]}); use a new --output folder or rename the method"
                    )
            self.check_methods()
            self.check_resume(writer)
            self.write_manifest(writer)
            cells = [(t, n) for t in self.config.tasks for n in t.lengths if selected is None or (t.name, n) in selected]
            self.prepare(cells)
            reachable = getattr(self.backend, "check_reachable", None)  # a server: fail before any row
            if reachable is not None and cells:
                reachable()
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
        return self.run_dir / "results.jsonl"

    def prepare(self, cells: Sequence[tuple[TaskConfig, int]]) -> None:
        """Build or read the data of every cell before any model call, so that an impossible length, a missing
        or empty file, samples without gold answers, or a missing data root stops the run before hours of work;
        warns when a file holds fewer samples than asked.

        Raises:
            ConfigError, DataError: from :meth:`cell_samples`, naming the task and length; DataError when a
                cell's samples have no gold answers (every score would be 0).
        """
        for task, length in cells:
            samples = self.cell_samples(task, length)
            n = len(samples)
            unanswered = [s.id for s in samples if not s.answers]
            if unanswered:
                where = f" ({task.files[length]})" if length in task.files else ""
                raise DataError(f"task {task.name!r} length {length}{where}: {len(unanswered)} of {n} samples have no "
                                f"gold answers (e.g. sample {unanswered[0]!r}), so every score would be 0; give each "
                                "sample an 'answers' list (use `memagent run` for predictions without scoring)")
            if n < task.samples:
                self.log(f"warning: task {task.name!r} length {length}: {n} samples, fewer than samples: {task.samples}")

    def check_resume(self, writer: ResultWriter | None = None) -> None:
        """Refuse to continue a run folder whose rows or built data came from other data settings.

        A resumed run may add tasks, lengths, methods and samples (a larger ``samples`` builds and runs the
        missing ones). For every task with rows or data in the folder, even one this config leaves out, it may
        not change what existing rows were computed from: the data seed, the task's unit, files, metrics or
        ``keep_incomplete`` (checked against the manifest and against the rows' own scores), or lower ``samples``
        (rows beyond the new count would still be reported). A folder with no rows or data yet (a first attempt
        that failed) takes any settings. Method settings are checked separately, by method hash.

        Args:
            writer: the open results file (its rows' tasks and metrics); ``None`` reads only the manifest and
                ``data/``.

        Raises:
            ConfigError: listing each difference, with the way out (a new ``--output`` folder).
        """
        started = self._started_tasks(writer)
        if not started:
            return
        old = read_manifest(self.run_dir / "manifest.json")
        old_cfg = old.get("config") or {}
        diffs = []
        if "data_seed" in old_cfg and old_cfg["data_seed"] != self.config.data_seed:
            diffs.append(f"data_seed {old_cfg['data_seed']} -> {self.config.data_seed}")
        old_tasks = self._old_task_settings()
        for t in self.config.tasks:
            if t.name not in started:
                continue
            new = _task_settings(json.loads(json.dumps(asdict(t))))
            o = old_tasks.get(t.name)
            if o is not None:
                for key in ("unit", "files", "metrics", "keep_incomplete"):
                    if key == "keep_incomplete" and key not in o:
                        continue  # older manifests lack it (their hotpotqa data predates the gold check)
                    if o.get(key) != new[key]:
                        diffs.append(f"task {t.name!r} {key} {o.get(key)!r} -> {new[key]!r}")
                if new["samples"] < (o.get("samples") or 0):
                    diffs.append(f"task {t.name!r} samples {o['samples']} -> {new['samples']} (samples may grow, not shrink)")
            scored = (writer.metrics.get(t.name) if writer is not None else None) or set()
            other = scored - {tuple(t.metric_names())}
            if other and (o is None or o.get("metrics") == new["metrics"]):  # not already listed above
                diffs.append(f"task {t.name!r} rows scored with {list(sorted(other)[0])}, this config scores "
                             f"{list(t.metric_names())}")
        if diffs:
            raise ConfigError(f"{self.run_dir} was run with other data settings: {'; '.join(diffs)}. Its rows and "
                              "data/ came from the old ones; use a new --output folder (or restore the settings)")

    def check_methods(self) -> None:
        """Refuse, before any row is written, a method that cannot fit the backend's context window whatever the
        sample (agent: chunk + memory + caps; direct: prompt cap + answer cap).

        Raises:
            ConfigError: naming the method, the sum that does not fit and the settings to change.
        """
        window = self.backend.context_tokens
        for m in self.config.methods:
            if m.kind == "memory_agent":
                try:
                    self._make_agent(m).check_budget("", "(even with an empty question)")
                except ConfigError as e:
                    raise ConfigError(f"method {m.name!r}: {e}") from None
            elif m.max_input_tokens is not None:
                if m.max_input_tokens < 1:
                    raise ConfigError(f"method {m.name!r}: max_input_tokens must be >= 1, got {m.max_input_tokens}")
                if window is not None and m.max_input_tokens + m.max_new_tokens > window:
                    raise ConfigError(
                        f"method {m.name!r}: max_input_tokens {m.max_input_tokens} + max_new_tokens {m.max_new_tokens} "
                        f"exceeds the context window of {self.backend.name} ({window} tokens); lower one of them")
            elif window is not None and window - m.max_new_tokens < 1:
                raise ConfigError(f"method {m.name!r}: max_new_tokens {m.max_new_tokens} leaves no room for a prompt in "
                                  f"the context window of {self.backend.name} ({window} tokens)")
            if m.kind == "direct":
                cap = self._direct_cap(m)
                fixed = self._direct_fixed_tokens("")
                if cap is not None and cap - fixed - 2 < 2:
                    raise ConfigError(f"method {m.name!r}: the direct prompt without any document or question is "
                                      f"{fixed} tokens, over the prompt cap of {cap} tokens: raise max_input_tokens")

    def _make_agent(self, method: MethodConfig):
        from memagent.agent.loop import AgentConfig, MemoryAgent
        from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates

        cfg = AgentConfig(
            chunk_tokens=method.chunk_tokens, memory_tokens=method.memory_tokens, final_tokens=method.final_tokens,
            max_context_tokens=method.max_context_tokens, temperature=self.config.temperature, top_p=self.config.top_p,
            seed=self.config.seed, batch_size=method.batch_size,
        )
        templates = PromptTemplates.from_file(method.templates) if method.templates else DEFAULT_TEMPLATES
        return MemoryAgent(self.backend, cfg, templates, tokenizer=self.tokenizer)

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
        base = {"method": method.name, "task": task.name, "length": length, "length_unit": task.length_unit, "method_hash": self.config.method_hash(method)}
        metrics = task.metric_names()
        if method.kind == "memory_agent":
            self._run_agent(writer, method, samples, base, metrics, f"{task.name}_{length}")
        else:
            self._run_direct(writer, method, samples, base, metrics)

    def _run_agent(self, writer, method: MethodConfig, samples, base, metrics, cell: str) -> None:
        from memagent.agent.loop import prune_trace, write_trace

        agent = self._make_agent(method)
        trace_rel = f"traces/{method.name}/{cell}.jsonl"
        (self.run_dir / trace_rel).parent.mkdir(parents=True, exist_ok=True)
        # resume: keep only the turns of samples that have a row and are not run again now (a kill between a
        # sample's turns and its row, or an error row retried, leaves turns of an attempt that no row records),
        # and drop a line torn by a kill, so that each sample's turns appear once
        rerun = {s.id for s in samples}
        keep = {k[3] for k in writer.done if k[:3] == (base["method"], base["task"], base["length"])} - rerun
        try:
            prune_trace(self.run_dir / trace_rel, keep)
        except OSError as e:
            raise DataError(f"cannot rewrite the trace file {self.run_dir / trace_rel} before resuming "
                            f"({e.strerror or e})") from None
        runnable = []
        for s in samples:  # a question too long for the window is one bad sample, not a crashed run
            try:
                agent.check_budget(s.question, s.id)
                runnable.append(s)
            except ConfigError as e:
                writer.write(make_row(base, s, metrics, error=str(e)))

        def on_result(s: Sample, traj: Trajectory) -> None:
            write_trace(self.run_dir / trace_rel, [traj], append=True)
            writer.write(trajectory_row(base, s, traj, metrics, trace_rel))

        agent.run(runnable, on_result=on_result, progress=self.progress)

    def _run_direct(self, writer, method: MethodConfig, samples, base, metrics) -> None:
        from memagent.answers import extract_answer

        budget = self._direct_cap(method)
        if budget is None:
            raise ConfigError(f"method {method.name!r}: set max_input_tokens (the backend's context window is unknown)")
        for i in range(0, len(samples), method.batch_size):
            batch = samples[i : i + method.batch_size]
            prepared: list[tuple[Sample, str, int]] = []  # (sample, prompt, document tokens kept)
            for s in batch:  # a question too long for the cap is one bad sample (an error row), not a crashed run
                try:
                    prepared.append((s, *self._direct_prompt(s, budget)))
                except ConfigError as e:
                    writer.write(make_row(base, s, metrics, error=str(e)))
            if not prepared:
                continue
            requests = [
                Request((Message("user", text),), method.max_new_tokens, self.config.temperature, self.config.top_p, self._seed(s.id), f"{s.id}/direct")
                for s, text, _ in prepared
            ]
            t0 = time.perf_counter()
            comps = self.backend.generate(requests)
            share = (time.perf_counter() - t0) / len(prepared)
            for (s, _, doc_tokens), c in zip(prepared, comps):
                usage = {"prompt_tokens": c.usage.prompt_tokens, "completion_tokens": c.usage.completion_tokens, "turns": 1}
                if c.finish_reason == "error":
                    row = make_row(base, s, metrics, error=c.error or "backend error", document_tokens=doc_tokens, seconds=c.seconds or share, **usage)
                else:
                    ext = extract_answer(c.text)
                    row = make_row(base, s, metrics, response=c.text, answer=ext.answer, extraction=ext.method,
                                   document_tokens=doc_tokens, seconds=c.seconds or share, **usage)
                writer.write(row)

    def _direct_prompt(self, s: Sample, budget: int) -> tuple[str, int]:
        from memagent.chunking import center_truncate

        fixed = self._direct_fixed_tokens(s.question)
        if budget - fixed - 2 < 2:  # center truncation keeps at least one head and one tail token
            raise ConfigError(f"sample {s.id}: the direct prompt without any document is {fixed} tokens, over the "
                              f"prompt cap of {budget} tokens: raise max_input_tokens or shorten the question")
        doc, n = center_truncate(s.context, self.tokenizer, budget - fixed - 2)
        return DIRECT_TEMPLATE.format(document=doc, question=s.question), n

    def _direct_cap(self, method: MethodConfig) -> int | None:
        """The direct prompt's cap in tokens: ``max_input_tokens``, else the window minus the answer cap."""
        if method.max_input_tokens is not None:
            return method.max_input_tokens
        window = self.backend.context_tokens
        return None if window is None else window - method.max_new_tokens

    def _direct_fixed_tokens(self, question: str) -> int:
        """Tokens of the direct prompt with ``question`` and no document (chat template included)."""
        from memagent.backends.base import DEFAULT_CHAT_OVERHEAD_TOKENS
        from memagent.tokenization import count_tokens

        empty = DIRECT_TEMPLATE.format(document="", question=question)
        fixed = self.backend.count_prompt_tokens((Message("user", empty),))
        return fixed if fixed is not None else count_tokens(self.tokenizer, empty) + DEFAULT_CHAT_OVERHEAD_TOKENS

    def _seed(self, sample_id: str) -> int:
        return zlib.crc32(f"{self.config.seed}/{sample_id}/direct".encode()) & 0x7FFFFFFF


def make_row(
    base: dict[str, Any],
    s: Sample,
    metrics: Sequence[str],
    response: str = "",
    answer: str = "",
    extraction: str = "empty",
    error: str | None = None,
    document_tokens: int | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    turns: int = 0,
    seconds: float = 0.0,
    trace: str | None = None,
) -> dict[str, Any]:
    """One result row; scores are computed here (0 for every metric when ``error`` is set).

    Metrics see the extracted answer, except ``strict_boxed*`` which see the raw response (they find the box).
    """
    from memagent.verifiers import get_verifier

    scores = {}
    for name in metrics:
        pred = response if name.startswith("strict_boxed") else answer
        scores[name] = 0.0 if error else float(get_verifier(name)(pred, s.answers))
    return {
        **base,
        "sample_id": s.id,
        "status": "error" if error else "ok",
        "error": error,
        "question": s.question,
        "answers": list(s.answers),
        "response": response,
        "answer": answer,
        "extraction": extraction,
        "metric": metrics[0],
        "score": scores[metrics[0]],
        "scores": scores,
        "context_tokens": s.metadata.get("length_tokens"),
        "document_tokens": document_tokens,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "turns": turns,
        "seconds": round(seconds, 4),
        "trace": trace,
    }


def trajectory_row(base: dict[str, Any], s: Sample, traj: Trajectory, metrics: Sequence[str], trace: str | None) -> dict[str, Any]:
    """A result row from a memory-agent trajectory."""
    return make_row(
        base, s, metrics, response=traj.response, answer=traj.answer, extraction=traj.extraction, error=traj.error,
        document_tokens=traj.document_tokens, prompt_tokens=sum(t.prompt_tokens for t in traj.turns),
        completion_tokens=sum(t.completion_tokens for t in traj.turns), turns=len(traj.turns), seconds=traj.seconds,
        trace=trace,
    )
