"""The one rule for what a resumed run may change.

A resumed run (``memagent run --resume``, ``memagent eval`` into a folder with rows, ``memagent train`` from a
checkpoint) compares what the earlier output was made with against the settings now:

- every setting that decides the outputs must be the same, except those the caller lists as free to change
  (run length, logging, speed and memory knobs);
- a setting the earlier record lacks counts as its default where the caller knows it (settings recorded only
  when off their default, such as extra sampling settings), and is otherwise not compared (the record was made
  before the setting existed, and a setting added later defaults to the old behaviour);
- the differences are reported together, each as ``key: old -> new`` (:func:`describe`).

Where only a hash of the settings is recorded (eval rows), the same rule holds by construction: settings added
after the hash layout was fixed enter the hash only when off their default
(:meth:`memagent.eval.grid.EvalConfig.method_hash`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from typing import Any


def setting_changes(old: Mapping[str, Any], new: Mapping[str, Any], may_change: Collection[str] = (),
                    defaults: Mapping[str, Any] | None = None, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every setting that differs (nested mappings compared key by key).

    Args:
        old: the settings the earlier output was made with.
        new: the settings now.
        may_change: dotted keys a resume may change.
        defaults: dotted key -> default, for settings that count as their default where ``old`` lacks them.
        prefix: dotted prefix of this level (recursion).
    """
    defaults = defaults or {}
    out = []
    for k in sorted(set(old) | set(new)):
        key = prefix + k
        if key in may_change or (k not in old and key not in defaults):
            continue
        a, b = old.get(k, defaults.get(key)), new.get(k, defaults.get(key))
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(setting_changes(a, b, may_change, defaults, key + "."))
        elif a != b:
            out.append((key, a, b))
    return out


def describe(changes: list[tuple[str, Any, Any]], limit: int = 8) -> str:
    """``"key: old -> new; ..."`` for an error message (at most ``limit`` entries)."""
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes[:limit])


def settings_hash(value: Any) -> str:
    """12 hex digits of the SHA-256 of ``value`` as sorted JSON: the identity of a set of settings."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]
