"""The evaluation grid: methods x tasks x lengths, loaded from YAML or built from command-line flags.

YAML layout (see ``configs/eval_*.yaml``)::

    name: smoke                      # label of the run
    output: runs/smoke               # run folder (results.jsonl, manifest.json, data/, traces/)
    seed: 0                          # sampling seed (per request: derived from seed, sample id, turn)
    data_seed: 0                     # seed of the data builders (hotpotqa: 0, RULER: 42 by convention)
    temperature: 0.0
    top_p: 1.0
    backend: {name: llamacpp, n_ctx: 8192}       # any make_backend keyword arguments
    tokenizer: null                  # tokenizer spec; default: the backend's own
    data_root: null
    methods:
      - {name: memagent, kind: memory_agent, chunk_tokens: 5000, memory_tokens: 1024, final_tokens: 1024}
      - {name: direct, kind: direct, max_input_tokens: 7000, max_new_tokens: 256}
    tasks:
      - {name: hotpotqa, lengths: [50, 100, 200], samples: 16}          # lengths in documents
      - {name: niah_single_2, lengths: [8192, 16384], samples: 16}      # lengths in tokens
      - {name: mine, lengths: [1], files: {1: my_samples.jsonl}}       # any sample file (relative to this file)

Unknown keys are errors (with a did-you-mean), so a typo cannot silently fall back to a default; a value of
the wrong type (``samples: 2.5``, ``temperature: hot``) is an error naming the key. Relative ``files`` and
``templates`` paths are read from the config file's folder.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from memagent.agent.config import AgentConfig
from memagent.agent.prompts import BUILTIN_TEMPLATES
from memagent.configtypes import (DuplicateKeyError, build_flat, check_sampling, coerce, coerce_fields, flat, flat_dict,
                                  flat_names, load_yaml, parse_ints)
from memagent.errors import ConfigError, closest
from memagent.policies import adapter_sha256
from memagent.runfiles.resume import settings_hash

MethodKind = Literal["memory_agent", "direct"]

#: Metrics per task family; the first is the primary score ("accuracy" in reports).
HOTPOTQA_METRICS = ("sub_em", "exact_match", "f1", "strict_boxed")


#: Sampling settings the whole grid shares (top-level keys), not set per method.
GRID_SAMPLING = ("temperature", "top_p", "seed")

#: The keys of a method's record (its manifest entry and hash) as they were before the agent's settings were
#: declared in one place; they are always recorded. A setting added since is recorded only when off its
#: default, so a method configured as before keeps its hash and its run folders resume
#: (:mod:`memagent.runfiles.resume`).
RECORD_KEYS = ("name", "kind", "chunk_tokens", "memory_tokens", "final_tokens", "max_context_tokens", "batch_size",
               "templates", "max_input_tokens", "max_new_tokens")

#: Method settings only one kind of method uses (the rest of :class:`AgentConfig`, batch size and sampling, both).
AGENT_ONLY = ("chunk_tokens", "memory_tokens", "final_tokens", "max_context_tokens", "templates", "slack_tokens")
DIRECT_ONLY = ("max_input_tokens", "max_new_tokens")


def agent_only_settings_given(agent: AgentConfig) -> list[str]:
    """The memory-agent-only settings (:data:`AGENT_ONLY`) that ``agent`` sets off their defaults: what a
    ``direct`` method would ignore (one left at its default cannot be told from an unset one, and changes nothing)."""
    default = AgentConfig()
    return [k for k in AGENT_ONLY if getattr(agent, k) != getattr(default, k)]

#: Backend settings that are not part of a method's hash (:meth:`EvalConfig.method_hash`).
#: The scripted backend's ``fail`` (injected failures) is among them: it decides which requests fail, never what a
#: successful one answers, and failed rows are rerun by ``--retry-errors``.
TRANSPORT_KEYS = frozenset({"base_url", "concurrency", "timeout_s", "max_retries", "api_key_env", "n_threads", "fail"})


@dataclass(frozen=True)
class MethodConfig:
    """One method of the grid.

    Attributes:
        name: label in results and reports.
        kind: ``memory_agent`` (MemoryAgent) or ``direct`` (whole document in one prompt).
        agent: the agent's settings (:class:`memagent.agent.config.AgentConfig`), written flat in YAML
            (``chunk_tokens: 5000``); temperature, top-p and seed are the grid's. ``direct`` uses ``batch_size``
            and the extra sampling settings.
        max_input_tokens: direct: the prompt is cut to this many tokens by center-truncating the document
            (default: the backend's window minus ``max_new_tokens``).
        max_new_tokens: direct: answer length cap.
        backend: backend settings of this method, merged over the grid's ``backend:`` (e.g. another
            ``lora_path``); part of the method's hash.
    """

    name: str
    kind: MethodKind = "memory_agent"
    agent: AgentConfig = flat(AgentConfig, exclude=GRID_SAMPLING)
    max_input_tokens: int | None = None
    max_new_tokens: int = 1024
    backend: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("memory_agent", "direct"):
            raise ConfigError(f"method {self.name!r}: kind must be one of 'memory_agent', 'direct', got {self.kind!r}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"method {self.name!r}: max_new_tokens must be >= 1")
        if "name" in self.backend and not isinstance(self.backend["name"], str):
            raise ConfigError(f"method {self.name!r}: backend name must be a string")
        # a setting of the other kind would be ignored, as a typo would: refuse it
        if self.kind == "direct":
            unused = agent_only_settings_given(self.agent)
        else:
            unused = [k for k in DIRECT_ONLY if getattr(self, k) != MethodConfig.__dataclass_fields__[k].default]
        if unused:
            other = "memory_agent" if self.kind == "direct" else "direct"
            raise ConfigError(f"method {self.name!r} (kind {self.kind}): {', '.join(unused)} "
                              f"{'applies' if len(unused) == 1 else 'apply'} to kind {other} only and would be "
                              f"ignored; remove {'it' if len(unused) == 1 else 'them'}, or set kind: {other}")

    def record(self) -> dict[str, Any]:
        """The method as recorded in manifests and hashed: :data:`RECORD_KEYS` always, every other setting
        only when off its default (the grid's sampling settings are recorded at the grid's level)."""
        flat_view = flat_dict(self)
        defaults = flat_dict(MethodConfig(self.name))
        out = {k: flat_view[k] for k in RECORD_KEYS}
        out.update({k: v for k, v in flat_view.items() if k not in out and v != defaults.get(k)})
        return out


@dataclass(frozen=True)
class TaskConfig:
    """One task of the grid.

    Attributes:
        name: ``hotpotqa``, a RULER task name, or any label when ``files`` is given.
        lengths: sizes to evaluate; documents for hotpotqa unless ``unit`` is ``tokens``, tokens otherwise.
        samples: samples per length (the first ``samples`` of the built or given data).
        unit: ``docs`` or ``tokens`` (default: docs for hotpotqa, tokens otherwise; hotpotqa data given by
            ``files`` built with ``memagent data hotpotqa --tokens`` needs ``unit: tokens``).
        files: ``{length: sample file}`` to evaluate existing data instead of building it.
        metrics: verifier names, primary first (default: by task).
        keep_incomplete: hotpotqa only: also keep questions whose context lacks a supporting paragraph
            (skipped by default, see :func:`memagent.data.hotpotqa.select_records`).
    """

    name: str
    lengths: tuple[int, ...]
    samples: int = 16
    unit: str | None = None
    files: dict[int, str] = field(default_factory=dict)
    metrics: tuple[str, ...] = ()
    keep_incomplete: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ConfigError(f"task name must be a string, got {self.name!r}")
        # from Python as from YAML: 8192, "8K", [8192, "16K"] (files keys too); then every field to its type
        docs = self.name == "hotpotqa" and self.unit in ("docs", None)
        given = self.lengths if isinstance(self.lengths, (list, tuple)) else [self.lengths]
        lengths = tuple(n for x in given for n in _lengths(x, f"task {self.name!r}: lengths", suffix=not docs))
        object.__setattr__(self, "lengths", lengths)
        if isinstance(self.metrics, str):
            object.__setattr__(self, "metrics", (self.metrics,))
        if isinstance(self.files, dict):
            files: dict[int, str] = {}
            for k, v in self.files.items():
                n = _lengths(k, f"task {self.name!r}: files", suffix=not docs)[0]
                if n in files:
                    raise ConfigError(f"task {self.name!r}: files: two keys name the length {n}; give each once")
                files[n] = str(v) if isinstance(v, Path) else v
            object.__setattr__(self, "files", files)
        coerce_fields(self, f"task {self.name!r}: ")
        if not self.lengths:
            raise ConfigError(f"task {self.name!r}: give at least one length")
        if len(set(self.lengths)) != len(self.lengths):
            raise ConfigError(f"task {self.name!r}: lengths {list(self.lengths)} name a length twice; give each once")
        if self.samples < 1:
            raise ConfigError(f"task {self.name!r}: samples must be >= 1")
        if self.unit not in (None, "docs", "tokens"):
            raise ConfigError(f"task {self.name!r}: unit must be docs or tokens, got {self.unit!r}")
        if self.unit == "docs" and self.name != "hotpotqa":
            raise ConfigError(f"task {self.name!r}: only hotpotqa lengths can be numbers of documents")
        if self.keep_incomplete and (self.name != "hotpotqa" or self.files):
            raise ConfigError(f"task {self.name!r}: keep_incomplete applies to hotpotqa data built by memagent "
                              "(no files:) only")
        if not self.files and self.name != "hotpotqa":
            from memagent.data.ruler import ALL_TASKS

            if self.name not in ALL_TASKS:
                close = closest(self.name, ("hotpotqa", *ALL_TASKS))
                hint = f"did you mean {close!r}? " if close else ""
                raise ConfigError(f"task {self.name!r}: not a task memagent can build ({hint}known: hotpotqa, "
                                  f"{', '.join(ALL_TASKS)}); for your own data give files: {{length: path}}")
        from memagent.verifiers import VERIFIERS

        for m in self.metrics:
            if m not in VERIFIERS:
                close = closest(m, VERIFIERS.names())
                hint = f"did you mean {close!r}? " if close else ""
                raise ConfigError(f"task {self.name!r}: unknown metric {m!r} ({hint}known: {', '.join(VERIFIERS.names())})")

    @property
    def length_unit(self) -> str:
        if self.unit:
            return self.unit
        return "docs" if self.name == "hotpotqa" else "tokens"

    def metric_names(self) -> tuple[str, ...]:
        if self.metrics:
            return self.metrics
        from memagent.data.ruler import RULER_METRIC

        if self.name in RULER_METRIC:
            return (RULER_METRIC[self.name], "sub_em") if self.name.startswith("qa") else (RULER_METRIC[self.name],)
        return HOTPOTQA_METRICS


@dataclass(frozen=True)
class EvalConfig:
    """The whole grid plus shared settings (see the module docstring)."""

    methods: tuple[MethodConfig, ...]
    tasks: tuple[TaskConfig, ...]
    name: str = "eval"
    output: str = "runs/eval"
    seed: int = 0
    data_seed: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    backend: dict[str, Any] = field(default_factory=lambda: {"name": "llamacpp"})
    tokenizer: str | None = None
    data_root: str | None = None

    def __post_init__(self):
        if not self.methods or not self.tasks:
            raise ConfigError("the eval grid needs at least one method and one task")
        names = [m.name for m in self.methods]
        for kind, name in [*(("method", n) for n in names), *(("task", t.name) for t in self.tasks)]:
            _check_file_name(kind, name)
        dup = _repeated(names)
        if dup:
            raise ConfigError(f"method names must be unique (ignoring case), got {dup} (methods {names}): a "
                              "method's rows and traces are keyed by its name, and a case-insensitive file system "
                              "(macOS, Windows) would merge their trace folders; give each variant its own name")
        tasks = [t.name for t in self.tasks]
        dup = _repeated(tasks)
        if dup:
            raise ConfigError(f"task names must be unique (ignoring case), got {dup}: a task's rows, data "
                              "and settings "
                              "are keyed by its name; give each variant its own name (e.g. hotpotqa_tokens with "
                              "files: built by `memagent data hotpotqa --tokens`)")
        check_sampling(self.temperature, self.top_p)
        if "name" not in self.backend:
            raise ConfigError("backend: give at least {name: llamacpp|openai|hf|scripted}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config", base: str | Path | None = None) -> EvalConfig:
        """Build from plain data; unknown keys raise :class:`ConfigError` naming the closest valid key.

        Args:
            d: the grid (see the module docstring).
            where: how errors name the source (a file path, "command line").
            base: folder that relative ``files`` paths are read from (the config file's folder); ``None``: the
                current directory.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        _check_keys(d, cls, where)
        for key in ("methods", "tasks"):
            if not isinstance(d.get(key) or [], list):
                raise ConfigError(f"{where}: {key} must be a list of mappings (- {{name: ...}}), got {type(d[key]).__name__}")
        methods = []
        for i, m in enumerate(d.get("methods") or []):
            if isinstance(m, dict) and isinstance(m.get("templates"), str) and m["templates"] not in BUILTIN_TEMPLATES:
                m = {**m, "templates": _relative_to(m["templates"], base)}
            methods.append(_build(MethodConfig, m, f"{where}: methods[{i}]"))
        methods = tuple(methods)
        tasks = []
        for i, t in enumerate(d.get("tasks") or []):
            at = f"{where}: tasks[{i}]"
            if not isinstance(t, dict):
                raise ConfigError(f"{at}: expected a mapping like {{name: vt, lengths: [8K]}}, got {t!r}")
            t = dict(t)
            docs = t.get("name") == "hotpotqa" and t.get("unit", "docs") in ("docs", None)
            if "lengths" in t:
                t["lengths"] = _lengths(t["lengths"], f"{at}.lengths", suffix=not docs)
            if "metrics" in t:
                metrics = t["metrics"]
                if isinstance(metrics, str):
                    metrics = [metrics]
                if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
                    raise ConfigError(f"{at}.metrics: give metric names, e.g. [sub_em, f1], got {t['metrics']!r}")
                t["metrics"] = tuple(metrics)
            if "files" in t:
                if not isinstance(t["files"], dict):
                    raise ConfigError(f"{at}.files: give a mapping {{length: path}}, e.g. {{8K: data/mine_8k.jsonl}}, "
                                      f"got {t['files']!r}")
                files, keys = {}, {}
                for k, v in t["files"].items():
                    if not isinstance(v, str) or not v:
                        raise ConfigError(f"{at}.files: the file for length {k!r} must be a path, got {v!r}")
                    if isinstance(k, str) and "," in k:
                        raise ConfigError(f"{at}.files: the key {k!r} holds a comma; give one length per key, without "
                                          f"thousands separators (e.g. {{2048: a.jsonl, 4K: b.jsonl}})")
                    n = _lengths(k, f"{at}.files", suffix=not docs)[0]
                    if n in files:
                        raise ConfigError(f"{at}.files: the keys {keys[n]!r} and {k!r} name one length ({n}), so one "
                                          "file would be left out; give each length once")
                    files[n], keys[n] = _relative_to(v, base), k
                t["files"] = files
            tasks.append(_build(TaskConfig, t, at))
        rest = {k: v for k, v in d.items() if k not in ("methods", "tasks")}
        settings = _check_types(cls, rest, where)
        try:
            return cls(methods=methods, tasks=tuple(tasks), **settings)
        except ConfigError as e:  # the checks across methods and tasks: name the file (or other source) they are in
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> EvalConfig:
        """Load a grid file.

        Raises:
            ConfigError: missing file, invalid YAML, unknown keys or bad values.
        """
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"eval config {str(p)!r} is a folder: give the grid's YAML file (e.g. configs/eval_smoke.yaml)")
        if not p.is_file():
            raise ConfigError(f"eval config {str(p)!r} not found")
        try:
            data = load_yaml(p.read_text(encoding="utf-8"))
        except DuplicateKeyError as e:  # a second methods: or tasks: block: say how to merge them
            hint = " (put every method under one methods: list, every task under one tasks: list)" * (e.key in ("methods", "tasks"))
            raise ConfigError(f"{p}: {e}{hint}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML ({e})") from None
        return cls.from_dict(data, str(p), base=p.parent)

    def to_dict(self) -> dict[str, Any]:
        """The grid as plain data (methods as :meth:`MethodConfig.record`s, the layout YAML grids use)."""
        d = json.loads(json.dumps(asdict(self)))
        d["methods"] = [m.record() for m in self.methods]
        return d

    def data_seed_for(self, task: TaskConfig) -> int | None:
        """The seed ``task``'s data is built with: ``data_seed``, else the convention of its family (hotpotqa 0,
        RULER 42); ``None`` for a task read from ``files`` (no seed enters it)."""
        if task.files:
            return None
        if self.data_seed is not None:
            return self.data_seed
        return 0 if task.name == "hotpotqa" else 42

    def backend_for(self, method: MethodConfig) -> dict[str, Any]:
        """The backend settings ``method`` runs on: its own ``backend:`` merged over the grid's."""
        return {**self.backend, **method.backend}

    def agent_for(self, method: MethodConfig) -> AgentConfig:
        """The agent settings ``method`` runs with: its own, with the grid's temperature, top-p and seed."""
        return dataclasses.replace(method.agent, temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    def method_hash(self, method: MethodConfig) -> str:
        """Hash of what determines a method's outputs (method settings, backend, sampling, seed): rows made
        under another hash must not be mixed into this run. Settings added since a record's layout was fixed
        enter only when off their default (:data:`RECORD_KEYS`), so older run folders keep their hashes.

        A LoRA adapter (backend ``lora_path``: a file or a packaged policy's name) enters by its path and, when
        the file exists, by the sha256 of its bytes: an adapter retrained under the same path or policy name
        makes a new hash, so its rows are never mixed with the old adapter's. An hf backend's model folder enters
        by its files' sha256 too (:func:`memagent.hashing.model_sha256`).

        Transport settings (:data:`TRANSPORT_KEYS`: server URLs, requests in flight, timeouts, retries, the key's
        variable, CPU threads) change how fast answers come, not which, and stay out of the hash: a run resumes
        with more replicas or another concurrency.
        """
        record = {k: v for k, v in method.record().items() if k != "backend"}
        backend = {k: v for k, v in self.backend_for(method).items() if k not in TRANSPORT_KEYS}
        parts: list[Any] = [record, backend, self.tokenizer, self.temperature, self.top_p, self.seed]
        adapter = adapter_sha256(backend.get("lora_path"))
        if adapter is not None:
            parts.append({"lora_sha256": adapter})
        if backend.get("name") == "hf" and isinstance(backend.get("model"), str):  # a folder retrained in place
            from memagent.hashing import model_sha256

            model = model_sha256(backend["model"])
            if model is not None:
                parts.append({"model_sha256": model})
        return settings_hash(parts)


def name_key(name: str) -> str:
    """What a method's or task's name is as a file name on any common file system: Unicode-normalized (NFC, as
    macOS stores ``café`` either way), case-folded (macOS, Windows) and without trailing spaces or dots (which
    Windows drops). Two names with one key would share a trace folder there."""
    import unicodedata

    return unicodedata.normalize("NFC", name).casefold().rstrip(" .")


def same_name_text(first: str, second: str) -> str:
    """``'a' twice``, ``'rl' and 'RL'``: two names with one :func:`name_key`, written with ``ascii()`` where plain
    text would hide the difference (non-ASCII letters, trailing spaces or dots: ``'K' and '\\u212a'``)."""
    if first == second:
        return f"{first!r} twice"
    plain = all(n.isascii() and n == n.rstrip(" .") for n in (first, second))
    show = repr if plain else ascii
    return f"{show(first)} and {show(second)}"


def _repeated(names: list[str]) -> str | None:
    """How the first two names with one :func:`name_key` read (``["a", "b", "a"]`` -> ``"'a' twice"``,
    ``["a", "A"]`` -> ``"'a' and 'A'"``), else None: names become file names, which such names would share."""
    seen: dict[str, str] = {}
    for n in names:
        key = name_key(n)
        if key in seen:
            return same_name_text(seen[key], n)
        seen[key] = n
    return None


def _check_file_name(kind: str, name: Any) -> None:
    """A method's or task's name is part of file names in the run folder (traces, data): refuse one that would
    leave the folder or make a hidden file.

    Raises:
        ConfigError: naming the method or task and the characters allowed.
    """
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise ConfigError(f"{kind} name {name!r}: it becomes part of file names in the run folder, so it must be "
                          "non-empty, must not start with '.' and must not contain '/' or '\\' (e.g. memagent_rl)")


def _lengths(values: Any, where: str, suffix: bool = True) -> tuple[int, ...]:
    """``[8192, "16K"]`` -> ``(8192, 16384)``: whole numbers, or strings with a K/M suffix like the CLI's
    (``suffix=False``: numbers of documents, no suffix)."""
    if not isinstance(values, (list, tuple)):
        values = [values]
    out: list[int] = []
    for x in values:
        if isinstance(x, numbers.Integral) and not isinstance(x, (bool, int)):  # numpy's integers
            x = int(x)
        if isinstance(x, bool) or not isinstance(x, (int, str)):
            raise ConfigError(f"{where}: {x!r} is not a length (use whole numbers like 8192 or 8K)")
        if isinstance(x, str) and "," in x:  # "16,384" is a thousands separator or two lengths: YAML has lists for that
            raise ConfigError(f"{where}: {x!r} holds a comma; give several lengths as a YAML list ([8K, 16K]) and "
                              "write each without thousands separators (16384, not 16,384)")
        out.extend(v for v in parse_ints(str(x), where, suffix=suffix) if v not in out)  # 2K and 2048: one length
    return tuple(out)


def _relative_to(path: str, base: str | Path | None) -> str:
    """``path`` read from the folder ``base`` (kept as given when absolute or when ``base`` is None)."""
    return str(Path(base) / path) if base is not None and not Path(path).is_absolute() else path


def _check_types(cls: type, d: dict[str, Any], where: str) -> dict[str, Any]:
    """``d`` with each value converted to its field's type (:func:`memagent.configtypes.coerce`)."""
    hints = typing.get_type_hints(cls)
    return {k: coerce(v, hints[k], f"{where}: {k}") if k in hints else v for k, v in d.items()}


def _check_keys(d: dict[str, Any], cls: type, where: str) -> None:
    valid = flat_names(cls)
    for k in d:
        if k not in valid:
            close = closest(k, valid)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(f"{where}: unknown key {k!r}{hint} (valid: {', '.join(valid)})")


#: What each required key of a grid entry holds, for the error naming it when it is missing.
_REQUIRED = {("MethodConfig", "name"): "the method's label in results and reports, e.g. name: memagent",
             ("TaskConfig", "name"): "hotpotqa, a RULER task (memagent ls), or a label of your own with files:",
             ("TaskConfig", "lengths"): "the sizes to evaluate, e.g. lengths: [8K, 16K]"}


def _build(cls: type, d: Any, where: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping")
    for key in GRID_SAMPLING:
        if cls is MethodConfig and key in d:
            raise ConfigError(f"{where}: {key} is a setting of the whole grid; set it at the top level (it applies "
                              "to every method)")
    _check_keys(d, cls, where)
    for key in [k for (c, k) in _REQUIRED if c == cls.__name__ and k not in d]:  # not the constructor's TypeError
        files = d.get("files") if key == "lengths" and isinstance(d.get("files"), dict) and d["files"] else None
        hint = f"; with files: the lengths to run among its keys, e.g. lengths: {list(files)}" if files else ""
        raise ConfigError(f"{where}: missing key {key!r} ({_REQUIRED[cls.__name__, key]}{hint})")
    try:
        return build_flat(cls, d, lambda k: f"{where}: {k}")
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:
        if str(e).startswith(where):
            raise
        raise ConfigError(f"{where}: {e}") from None
