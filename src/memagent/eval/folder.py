"""An eval run folder's records: the manifest, and what a resumed run may change in the data settings.

:class:`RunFolder` is the part of :class:`memagent.eval.runner.EvalRunner` that reads and writes the folder's
``manifest.json`` and refuses a resume with other data settings (method settings are checked by method hash).
Files are read and written through :mod:`memagent.runfiles`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memagent.errors import ConfigError
from memagent.runfiles import ResultWriter, read_manifest, setting_changes, write_manifest

#: Per task, the settings that decide its data and scores (what a resumed run may not change).
TASK_SETTINGS = ("unit", "files", "metrics", "samples", "keep_incomplete")


def task_settings(task: dict[str, Any]) -> dict[str, Any]:
    """The data settings of one task (a :class:`memagent.eval.grid.TaskConfig` as plain data); a setting the
    task lacks (a manifest written before the setting existed) is left out, so a resume does not compare it."""
    out = {k: task.get(k) for k in TASK_SETTINGS if k in task}
    # files by name: a run folder that moved (training validation) keeps its data
    out["files"] = {str(k): Path(v).name for k, v in (task.get("files") or {}).items()}
    out["metrics"] = list(task.get("metrics") or [])
    return out


class RunFolder:
    """Manifest and resume checks of an eval run folder (mixed into the runner: it reads ``config``,
    ``run_dir``, ``backend`` and ``tokenizer``)."""

    config: Any
    run_dir: Path

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
        return {t["name"]: task_settings(t) for t in (old.get("config") or {}).get("tasks", []) if isinstance(t, dict)}

    def write_manifest(self, writer: ResultWriter | None = None) -> None:
        """Write ``manifest.json``, keeping the first start time, the settings of tasks that have rows or data but
        are not in this config, and the entries (``config.methods``, ``method_hashes``, ``prompt_hashes``) of
        methods that have rows but are not in this config."""
        prompt_hashes = {m.name: self.prompt_hash(m) for m in self.config.methods}
        model_hashes = {m.name: h for m in self.config.methods if (h := self.model_hash(m)) is not None}
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
            if name in (old.get("model_hashes") or {}):
                model_hashes[name] = old["model_hashes"][name]
        write_manifest(path, {
            "name": self.config.name, "config": config, "method_hashes": method_hashes,
            "prompt_hashes": prompt_hashes, **({"model_hashes": model_hashes} if model_hashes else {}), "backend": self.backend.name, "context_tokens": self.backend.context_tokens,
            "tokenizer": self.tokenizer.name, "seed": self.config.seed, "data_seed": self.config.data_seed,
            "task_settings": self._merged_task_settings(writer),
        })

    def prompt_hash(self, m) -> str:
        """The hash of the prompt text method ``m`` sends: its templates (a built-in set or the file it names, read
        now), or the direct method's template."""
        from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates
        from memagent.eval.direct import direct_template_hash

        if m.kind == "direct":
            return direct_template_hash()
        t = m.agent.templates
        return (PromptTemplates.from_file(t) if t else DEFAULT_TEMPLATES).hash

    def model_hash(self, m) -> str | None:
        """The sha256 of the model file or folder method ``m``'s backend loads (a llama.cpp GGUF, an hf or vllm
        model folder; :func:`memagent.hashing.model_sha256`), ``None`` for a backend that loads no local model (a
        server, the scripted backend)."""
        from memagent.hashing import model_sha256

        path = getattr(self.backend_of(m), "model_path", None)
        settings = self.config.backend_for(m)
        if path is None and settings.get("name") == "vllm":
            path = settings.get("model")
        if not isinstance(path, (str, os.PathLike)):
            return None
        try:
            return model_sha256(path)
        except OSError:
            return None

    def check_method_files(self, writer: ResultWriter) -> None:
        """Refuse to add rows to a method whose rows in the folder were made from other file contents under the
        same settings: a prompt template file edited since (the manifest's ``prompt_hashes``), or another model
        file or folder under the same path (``model_hashes``). A method's hash holds the paths only, so such rows
        would be mixed into one cell silently. A hash the manifest does not record is not compared.

        Raises:
            ConfigError: naming the method, the file and both hashes.
        """
        old = read_manifest(self.run_dir / "manifest.json")
        for m in self.config.methods:
            if m.name not in writer.hashes:
                continue
            was = (old.get("prompt_hashes") or {}).get(m.name) if isinstance(old.get("prompt_hashes"), dict) else None
            now = self.prompt_hash(m)
            if isinstance(was, str) and was != now:
                what = (f"the prompt templates {m.agent.templates!r} read otherwise now" if m.agent.templates
                        else "memagent's built-in prompt templates changed (another memagent version)")
                raise ConfigError(f"{self.run_dir}/results.jsonl holds rows of method {m.name!r} made with other "
                                  f"prompts (prompt hash {was} -> {now}: {what}); restore the templates, or use a new "
                                  "--output folder or rename the method")
            models = old.get("model_hashes") if isinstance(old.get("model_hashes"), dict) else {}
            was, now = models.get(m.name), self.model_hash(m)
            if isinstance(was, str) and now is not None and was != now:
                raise ConfigError(f"{self.run_dir}/results.jsonl holds rows of method {m.name!r} made with another "
                                  f"model under the same path (model sha256 {was[:12]} -> {now[:12]}); restore the "
                                  "model, or use a new --output folder or rename the method")

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
            new = self._task_record(t)
            if t.name in merged:
                new["samples"] = max(new["samples"], merged[t.name].get("samples") or 0)
            merged[t.name] = new
        return merged

    def _task_record(self, t) -> dict[str, Any]:
        """A task's data settings as the manifest records them: :func:`task_settings` and the seed its data is
        built with (:meth:`memagent.eval.grid.EvalConfig.data_seed_for`; ``None`` for ``files``)."""
        return {**task_settings(json.loads(json.dumps(asdict(t)))), "data_seed": self.config.data_seed_for(t)}

    def check_resume(self, writer: ResultWriter | None = None) -> None:
        """Refuse to continue a run folder whose rows or built data came from other data settings.

        A resumed run may add tasks, lengths, methods and samples (a larger ``samples`` builds and runs the
        missing ones). For every task with rows or data in the folder, even one this config leaves out, it may
        not change what existing rows were computed from: the data seed, the task's unit, files, metrics or
        ``keep_incomplete`` (checked against the manifest and against the rows' own scores), or lower ``samples``
        (rows beyond the new count would still be reported). A setting an older manifest lacks is not compared
        (:mod:`memagent.runfiles.resume`). A folder with no rows or data yet (a first attempt that failed) takes
        any settings. Method settings are checked separately, by method hash.

        Args:
            writer: the open results file (its rows' tasks and metrics); ``None`` reads only the manifest and
                ``data/``.

        Raises:
            ConfigError: listing each difference, with the way out (a new ``--output`` folder).
        """
        started = self._started_tasks(writer)
        if not started:
            return
        old_cfg = read_manifest(self.run_dir / "manifest.json").get("config") or {}
        diffs = []
        old_tasks = self._old_task_settings()
        for t in self.config.tasks:
            if t.name not in started:
                continue
            new = self._task_record(t)
            o = old_tasks.get(t.name)
            # the seed each task was built with is recorded per task (a manifest before that: the grid's, which a
            # run of other tasks into the folder may have changed since), compared as built: data_seed 42 stated
            # is RULER's default left unset
            if (o is None or "data_seed" not in o) and "data_seed" in old_cfg:
                was = dataclasses.replace(self.config, data_seed=old_cfg["data_seed"]).data_seed_for(t)
                now = self.config.data_seed_for(t)
                if was != now:
                    diffs.append(f"task {t.name!r} data_seed {was} -> {now}")
            if o is not None:
                diffs += [f"task {t.name!r} {k} {a!r} -> {b!r}" for k, a, b in setting_changes(o, new, may_change={"samples"})]
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
