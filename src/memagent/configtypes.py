"""Settings declared once: type checks, declared bounds, flat embedding, sizes.

YAML gives ``2.5`` or ``hot`` where a whole number is due, or ``1e-5`` as a string; :func:`coerce` turns a value
into its field's annotated type or raises :class:`ConfigError` naming the key; numbers must be finite
(:func:`finite_number`). A settings dataclass declares each field with :func:`setting` (help, flag, lower
bound), so YAML, the command line and the range checks all read one declaration; a class that embeds another
*flat* (:func:`flat`, e.g. an eval method embeds the agent's settings) keeps the embedded keys at its own level
in YAML and in :func:`flat_dict`. :func:`check_sampling` holds the one rule for temperature and top-p that every
config class and backend applies.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import yaml

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
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            value = int(value)  # numpy's integers and the like: whole numbers, kept as Python ints
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
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        value = float(value)  # numpy's floats and integers
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


# ------------------------------------------------------------------------------------ declared settings
def setting(default: Any = None, help: str = "", *, flag: str | tuple[str, ...] | None = None, min: float | None = None,
            gt: float | None = None, cli: bool = True, cli_default: Any = ..., sampling: bool = False,
            default_factory: Any = None) -> Any:
    """A dataclass field that declares a setting once, for every place it enters: YAML keys, the command line
    (flag, help, lower bound) and the range check.

    Args:
        default: the value when unset (``default_factory`` instead for mutable values).
        help: one line for ``--help`` and the docs.
        flag: the command-line flag, or flags (default ``--`` + the name with dashes).
        min: inclusive lower bound, checked by :func:`check_bounds` and by the command line.
        gt: exclusive lower bound (checked by :func:`check_bounds`; the command line refuses values below it).
        cli: whether the setting is a command-line option at all.
        cli_default: the command line's default when it differs from ``default``.
        sampling: an extra sampling setting: passed to backends in ``Request.sampling`` when off its default
            (each backend maps it to its engine's name, or refuses it; :mod:`memagent.backends.sampling`).
    """
    meta = {"help": help, "flag": flag, "min": min, "gt": gt, "cli": cli, "cli_default": cli_default,
            "sampling": sampling}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def coerce_fields(obj: Any, prefix: str = "") -> None:
    """Coerce every field of a (frozen) settings dataclass to its annotated type, in place.

    Raises:
        ConfigError: a value of the wrong type, naming ``<prefix><name>``.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, coerce(getattr(obj, f.name), hints[f.name], prefix + f.name))


def check_bounds(obj: Any, prefix: str = "") -> None:
    """Check the lower bounds declared with :func:`setting` (``None`` values pass).

    Raises:
        ConfigError: ``<prefix><name> must be >= <min>, got <value>`` (or ``> <gt>``).
    """
    for f in dataclasses.fields(obj):
        low, above, value = f.metadata.get("min"), f.metadata.get("gt"), getattr(obj, f.name)
        if low is not None and value is not None and value < low:
            raise ConfigError(f"{prefix}{f.name} must be >= {low}, got {value}")
        if above is not None and value is not None and value <= above:
            raise ConfigError(f"{prefix}{f.name} must be > {above}, got {value}")


#: Field metadata of a dataclass embedded *flat*: its keys sit at the level of the embedding class in YAML,
#: on the command line and in ``flat_dict`` (``exclude``: keys of the embedded class not offered there).
def flat(default_factory: Any, exclude: tuple[str, ...] = ()) -> Any:
    """A field holding a settings dataclass whose keys are read and written flat, at the embedding level."""
    return dataclasses.field(default_factory=default_factory, metadata={"flat": True, "exclude": tuple(exclude)})


def flat_names(cls: type) -> list[str]:
    """The keys a mapping for ``cls`` may hold: its own fields, with flat-embedded fields expanded."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("flat"):
            out.extend(k for k in flat_names(hints[f.name]) if k not in f.metadata["exclude"])
        else:
            out.append(f.name)
    return out


def split_flat(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (flat keys) regrouped as ``cls``'s constructor takes it: the keys of each flat-embedded field
    become one nested mapping under that field's name (other keys, unknown ones included, stay as they are)."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for f in dataclasses.fields(cls):
        if f.metadata.get("flat"):
            names = [k for k in flat_names(hints[f.name]) if k not in f.metadata["exclude"]]
            out[f.name] = {k: out.pop(k) for k in names if k in out}
    return out


def build_flat(cls: type, data: dict[str, Any], where: Callable[[str], str], given: dict[str, Any] | None = None) -> Any:
    """Build ``cls`` from a flat mapping whose keys are already checked: values coerced to their annotated
    types (errors name ``where(key)``), flat-embedded settings built over the field's default instance;
    ``given`` holds fields already built (nested sections such as ``model.lora``), passed as they are.

    Raises:
        ConfigError: a value of the wrong type, or a failed check of a settings class.
    """
    hints = typing.get_type_hints(cls)
    grouped = split_flat(cls, data)
    kwargs: dict[str, Any] = dict(given or {})
    for f in dataclasses.fields(cls):
        if f.name not in grouped:
            continue
        if f.metadata.get("flat"):
            base = f.default_factory()
            inner = {k: coerce(v, typing.get_type_hints(type(base))[k], where(k)) for k, v in grouped[f.name].items()}
            kwargs[f.name] = dataclasses.replace(base, **inner) if inner else base
        else:
            kwargs[f.name] = coerce(grouped[f.name], hints[f.name], where(f.name))
    return cls(**kwargs)


def flat_dict(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` with flat-embedded settings spliced in at the embedding level (tuples as lists)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("flat"):
            out.update({k: v for k, v in flat_dict(value).items() if k not in f.metadata["exclude"]})
        elif dataclasses.is_dataclass(value):
            out[f.name] = flat_dict(value)
        else:
            out[f.name] = _plain(value)
    return out


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# ------------------------------------------------------------------------------------------------ sizes
def parse_ints(text: str | None, option: str, suffix: bool = True) -> list[int]:
    """``"50,100"`` -> ``[50, 100]``, in order, each size once; ``K``/``M`` suffixes allowed (``8K`` = 8192 tokens,
    ``1M`` = 1048576) unless ``suffix`` is false (numbers of documents: "8K documents" is almost surely a token
    length).

    Raises:
        ConfigError: an item is not a positive integer, or has a suffix where none is allowed.
    """
    if not text or not text.strip():
        return []
    out: list[int] = []
    for item in text.split(","):
        s = item.strip().lower()
        mult = 1
        if s[-1:] in ("k", "m") and not suffix:
            raise ConfigError(f"{option}: {item.strip()!r}: a number of documents takes no K/M suffix (8K would mean "
                              "8192 documents); write plain numbers like 50,100, or give token lengths instead (memagent data "
                              "hotpotqa --tokens 8K; in an eval grid, unit: tokens)")
        if s.endswith("k"):
            s, mult = s[:-1], 1024
        elif s.endswith("m"):
            s, mult = s[:-1], 1024 * 1024
        try:
            v = int(s) * mult
        except ValueError:
            raise ConfigError(f"{option}: {item!r} is not a whole number (write sizes like 8192 or 8K, comma-separated)") from None
        if v < 1:
            raise ConfigError(f"{option}: sizes must be positive, got {item!r}")
        if v not in out:  # 4K,4096 is one size
            out.append(v)
    return out


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping of a YAML settings file (the message names both lines; ``key`` is the key)."""

    def __init__(self, message: str, key: Any = None):
        super().__init__(message)
        self.key = key


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key given twice in one mapping: PyYAML keeps the last value silently,
    so a grid's second ``tasks:`` block dropped the first one's tasks and a second ``chunk_tokens`` replaced the
    first. A key merged in with ``<<: *anchor`` may still be set again beside it, as YAML intends.

    Raises:
        DuplicateKeyError: naming the key and the lines of both.
    """

    def flatten_mapping(self, node):
        # Checked here, once per node, before PyYAML merges a ``<<`` source's pairs into the node's own (in place):
        # a mapping that is itself merged elsewhere may be flattened before it is constructed, and its merged pairs
        # beside its own override then read as a key given twice (a chain of merges was refused).
        checked = self.__dict__.setdefault("_unique_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the constructor names it
                    continue
                if first is not key_node:
                    raise DuplicateKeyError(
                        f"line {key_node.start_mark.line + 1}: the key {key!r} is given a second time (first at "
                        f"line {first.start_mark.line + 1}) in one mapping; YAML would keep only the last, silently "
                        "dropping the first: give it once", key)
        super().flatten_mapping(node)


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` with :class:`UniqueKeyLoader` (a key given twice in one mapping is refused).

    Raises:
        DuplicateKeyError: a repeated key; yaml.YAMLError: other bad YAML.
    """
    return yaml.load(stream, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
