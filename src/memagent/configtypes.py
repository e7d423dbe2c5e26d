"""Type checks for settings read from YAML or JSON (eval grids, training configs).

YAML gives ``2.5`` or ``hot`` where a whole number is due, or ``1e-5`` as a string; :func:`coerce` turns a value
into its field's annotated type or raises :class:`ConfigError` naming the key. Numbers must be finite
(:func:`finite_number`), and :func:`check_sampling` holds the one rule for temperature and top-p that every
config class and backend applies.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal

from memagent.errors import ConfigError


def coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as the annotation ``tp`` (int, float, str, bool, Optional/unions, Literal, tuple, dict, Any).

    Lists become tuples; ints and numeric strings (YAML 1.1 reads ``1e-5`` as a string) become floats; bools are
    not numbers.

    Raises:
        ConfigError: ``key must be <type>, got <value>``.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        inner = args if len(args) != 2 or args[1] is not Ellipsis else (args[0],) * len(value)
        if len(inner) != len(value):
            raise ConfigError(f"{key} must have {len(inner)} items, got {value!r}")
        return tuple(coerce(v, t, key) for v, t in zip(value, inner))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        return finite_number(value, key)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {coerce(k, args[0], key): coerce(v, args[1], key) for k, v in value.items()} if args else value
    return value


def finite_number(value: Any, key: str) -> float:
    """``value`` as a float, refusing anything that is not a finite real number.

    NaN compares false with everything, so a range check such as ``temperature < 0`` lets it through, and
    infinity passes every lower bound; either would reach a sampler (llama.cpp then samples noise) or a JSON
    encoder (which refuses it mid-run).

    Args:
        value: the setting's value.
        key: the setting's name, used in the error.

    Raises:
        ConfigError: ``key must be a number`` (a bool, a string, None ...) or ``key must be a finite number``
            (NaN, +-inf, an integer too large for a float).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return number


def check_sampling(temperature: Any, top_p: Any, names: tuple[str, str] = ("temperature", "top_p"),
                   where: str = "") -> None:
    """The sampling rule shared by every config class and backend: a finite ``temperature >= 0`` (0 = greedy)
    and a finite ``top_p`` in ``(0, 1]``.

    Args:
        temperature: sampling temperature.
        top_p: nucleus-sampling mass.
        names: how the error names the two settings (e.g. ``("agent.val_temperature", "agent.val_top_p")``).
        where: prefix of the error (e.g. ``"request 'a/0': "``).

    Raises:
        ConfigError: naming the setting, its value and the allowed range.
    """
    t = finite_number(temperature, f"{where}{names[0]}")
    p = finite_number(top_p, f"{where}{names[1]}")
    if t < 0:
        raise ConfigError(f"{where}{names[0]} must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < p <= 1:
        raise ConfigError(f"{where}{names[1]} must be in (0, 1], got {top_p!r}")
