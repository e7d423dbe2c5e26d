"""Command-line options derived from the settings' own declarations.

``memagent run``, ``demo`` and ``eval`` take the agent's settings (:class:`memagent.agent.config.AgentConfig`) and
the backend options (:class:`memagent.backends.factory.BackendOptions`) as options generated from those classes'
fields (flag, help and lower bound declared with :func:`memagent.configtypes.setting`), so a setting added
there is an option of every command at once. A command asks for them with :func:`with_settings`: its
function receives one built settings object per group instead of the individual options, and
:func:`given_options` tells it which of them were given explicitly (a packaged policy fills only the others).
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import typer

from memagent.errors import MemagentError


#: Name of the context parameter :func:`with_settings` adds to a command (typer passes the click context).
_CTX = "memagent_click_context"

_GIVEN: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("memagent_given_options", default=frozenset())


def given_options() -> frozenset[str]:
    """Names of the settings (field names) the running command's user gave explicitly, on the command line or
    through an environment variable, even where the value equals the default; empty outside a command made by
    :func:`with_settings`."""
    return _GIVEN.get()


#: Backend options that have a default and apply to one backend only: given explicitly for another, they would be
#: silently ignored (those without a default, such as --threads, are refused by the backend's settings).
SERVER_ONLY_OPTIONS = {"concurrency": "--concurrency", "api_key_env": "--api-key-env"}


def refuse_unused_backend_options(backend: str) -> None:
    """Refuse ``--concurrency`` or ``--api-key-env`` given explicitly with a backend other than ``openai``.

    Raises:
        ConfigError: naming the option and the backend it applies to.
    """
    from memagent.errors import ConfigError

    for field, flag in SERVER_ONLY_OPTIONS.items():
        if field in given_options() and backend != "openai":
            raise ConfigError(f"{flag} is not used by --backend {backend}; it applies to server requests "
                              "(--backend openai)")


@dataclasses.dataclass(frozen=True)
class Group:
    """The options of one settings class, handed to the command as one object.

    Attributes:
        cls: the settings dataclass.
        param: the command function's parameter that receives the built object.
        defaults: command-specific defaults (e.g. ``demo`` caps the memory lower).
        only: offer only these fields (default: every field declared with ``cli=True``).
        help: command-specific help lines.
    """

    cls: type
    param: str
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    only: Sequence[str] | None = None
    help: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def fields(self) -> list[dataclasses.Field]:
        """The settings offered as options."""
        return [f for f in dataclasses.fields(self.cls) if f.metadata.get("cli", True)
                and (self.only is None or f.name in self.only)]

    def parameters(self) -> list[inspect.Parameter]:
        """The settings as keyword parameters whose defaults are typer options (flag, help, bound, default)."""
        hints = typing.get_type_hints(self.cls)
        out = []
        for f in self.fields():
            m = f.metadata
            flags = m.get("flag") or "--" + f.name.replace("_", "-")
            flags = (flags,) if isinstance(flags, str) else tuple(flags)
            default = self.defaults.get(f.name, f.default if m.get("cli_default", ...) is ... else m["cli_default"])
            low = m.get("min") if m.get("min") is not None else m.get("gt")
            if _base_type(hints[f.name]) is float:  # NaN and inf are refused with the setting's name, not click's range
                bounds = {"parser": _float_option(f.name), "metavar": "FLOAT"}
            else:
                bounds = {"min": low} if low is not None else {}
            option = typer.Option(default, *flags, help=self.help.get(f.name, m.get("help", "")), **bounds)
            out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                         annotation=_cli_type(hints[f.name])))
        return out

    def build(self, values: dict[str, Any]) -> Any:
        """The settings object from the options' values (taken out of ``values``).

        Raises:
            ConfigError: a value the settings class refuses.
        """
        return self.cls(**{f.name: values.pop(f.name) for f in self.fields()})


def _base_type(tp: Any) -> Any:
    """``X`` of ``X | None``; ``tp`` itself otherwise."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else tp


def _float_option(name: str) -> Callable[[Any], float]:
    """A command-line parser for a float setting, without click's range check: click's range message for NaN
    ("should be >= 0") would misname the fault, so the value goes to the settings class, which refuses NaN, inf
    (:func:`memagent.configtypes.finite_number`) and values below the declared bound by the setting's name
    (exit status 2 too)."""

    def parse(text: Any) -> float:
        try:
            return float(text)
        except ValueError:
            raise typer.BadParameter(f"{name} must be a number, got {text}") from None

    return parse


def _cli_type(tp: Any) -> Any:
    """``X | None`` as ``Optional[X]`` (the form every typer version reads); ``tuple[X, ...]`` as ``List[X]`` (an
    option given once per value)."""
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:
        return typing.Optional[_cli_type(next(a for a in args if a is not type(None)))]
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return typing.List[args[0]]
    return tp


def with_settings(*groups: Group) -> Callable[[Callable], Callable]:
    """Decorate a typer command: each group's fields become options, and the command receives the built
    settings object in the group's ``param`` (a bad value exits with status 2 and the error, like any bad input).
    """

    def deco(func: Callable) -> Callable:
        sig = inspect.signature(func)
        hints = typing.get_type_hints(func, include_extras=True)
        taken = {g.param for g in groups}
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name not in taken]
        added = [p for g in groups for p in g.parameters()]
        clash = {p.name for p in own} & {p.name for p in added}
        if clash:
            raise TypeError(f"{func.__name__}: options {sorted(clash)} are declared twice")

        def command(**kwargs: Any) -> Any:
            ctx = kwargs[own_ctx] if own_ctx else kwargs.pop(_CTX, None)
            names = [f.name for g in groups for f in g.fields()]
            given = frozenset(n for n in names if _given(ctx, n))
            try:
                built = {g.param: g.build(kwargs) for g in groups}
            except MemagentError as e:
                typer.secho(f"error: {e}", fg="red", err=True)
                raise typer.Exit(2) from None
            token = _GIVEN.set(given)
            try:
                return func(**kwargs, **built)
            finally:
                _GIVEN.reset(token)

        # typer hands its context to one parameter only: the command's own, if it has one, else one added here
        own_ctx = next((p.name for p in own if p.annotation is typer.Context), None)
        context = [] if own_ctx else [inspect.Parameter(_CTX, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
        command.__signature__ = sig.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
                                            + added + context)
        command.__annotations__ = {p.name: p.annotation for p in [*own, *added, *context]}
        command.__name__, command.__qualname__, command.__doc__ = func.__name__, func.__qualname__, func.__doc__
        command.__module__ = func.__module__
        return command

    return deco


def _given(ctx: Any, name: str) -> bool:
    """Whether option ``name`` was given (not taken from its default) in the click context ``ctx``; the source's
    enum is compared by name, since typer may bring its own copy of click."""
    get = getattr(ctx, "get_parameter_source", None)
    source = get(name) if get is not None else None
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def agent_group(param: str = "agent_config", **kw: Any) -> Group:
    """The agent's settings (:class:`memagent.agent.config.AgentConfig`) as options."""
    from memagent.agent.config import AgentConfig

    return Group(AgentConfig, param, **kw)


def backend_group(param: str = "backend_options", **kw: Any) -> Group:
    """The backend options (:class:`memagent.backends.factory.BackendOptions`)."""
    from memagent.backends.factory import BackendOptions

    return Group(BackendOptions, param, **kw)


def apply_policy(agent_config: Any, backend_options: Any, defaults: Mapping[str, Any] | None = None) -> Any:
    """``--lora NAME`` of a packaged policy: the agent settings with the policy's trained values for every option
    not given on the command line (:func:`given_options`; a value given explicitly wins, even one equal to the
    default). The policy's base model is loaded by the backend factory when ``--model`` is not given; a
    ``--model`` other than that base gets a warning. What the policy set is printed on stderr.

    Args:
        agent_config: the command's :class:`memagent.agent.config.AgentConfig`.
        backend_options: the command's :class:`memagent.backends.factory.BackendOptions`.
        defaults: the command's own option defaults where they differ from the class's (``demo``).

    Returns:
        the agent settings to use (``agent_config`` itself for a path or no ``--lora``).

    Raises:
        ConfigError: ``--lora`` names no packaged policy (with the closest names).
    """
    from memagent.agent.config import AgentConfig
    from memagent.policies import agent_overrides, base_model, is_policy_name

    fields = [f.name for f in dataclasses.fields(AgentConfig)]
    base = {**{k: getattr(AgentConfig(), k) for k in fields}, **(defaults or {})}
    lora = backend_options.lora_path
    changes = agent_overrides(lora, {k: getattr(agent_config, k) for k in fields}, base, given_options())
    base_spec = base_model(lora)  # the name was checked just above
    model = base_spec if backend_options.model is None else None
    shown = {**({"model": model} if model else {}), **changes}
    trained_on = base_spec or "smollm2"
    if backend_options.model is not None and is_policy_name(lora) and not _same_model_file(backend_options.model, trained_on):
        typer.secho(f"warning: policy {lora} was trained on --model {trained_on}; on {backend_options.model} its "
                    f"adapter may score lower (drop --model to use {trained_on})", fg="yellow", err=True)
    if shown:
        typer.echo(f"policy {lora}: with the settings it was trained with: "
                   + ", ".join(f"{k}={v}" for k, v in shown.items()), err=True)
    _warn_about_policy_use(lora, agent_config, fields)
    return dataclasses.replace(agent_config, **changes)


def _warn_about_policy_use(lora: str | None, agent_config: Any, fields: list[str]) -> None:
    """Warnings where ``--lora`` uses a packaged policy otherwise than it was trained: settings given on the command
    line that differ from its trained ones; its adapter file given by path (its base model and settings are then
    not applied); a file or folder here that hides a policy of the same name."""
    import os
    from pathlib import Path

    from memagent.policies import get, is_policy_name, names

    if not lora:
        return
    if is_policy_name(lora):
        trained = get(lora).agent
        given = given_options()
        differ = [(k, getattr(agent_config, k), v) for k, v in trained.items()
                  if k in fields and k in given and not _same_setting(k, getattr(agent_config, k), v)]
        if differ:
            typer.secho(f"warning: policy {lora} was trained with other settings than this run's: "
                        + ", ".join(f"{k}={now} (trained {then})" for k, now, then in differ)
                        + "; it may score lower", fg="yellow", err=True)
        return
    for name in names():
        if lora == name and Path(lora).exists():
            typer.secho(f"warning: --lora {lora} is read as the file or folder {os.path.abspath(lora)!r} here, not "
                        "as the packaged policy of that name (an adapter is a .gguf file); run elsewhere, or rename "
                        "it, to use the policy", fg="yellow", err=True)
            return
        try:
            same = os.path.samefile(lora, get(name).adapter_path)
        except (OSError, MemagentError):
            same = False
        if same:
            typer.secho(f"warning: --lora {lora} is the adapter of the packaged policy {name}; given by path, it runs "
                        f"on the default model with the default budgets, not the base and settings it was trained "
                        f"with: give --lora {name}", fg="yellow", err=True)
            return


def _same_setting(key: str, given: Any, trained: Any) -> bool:
    """Whether a setting given equals the policy's trained one; templates by their text (a YAML file holding the
    built-in templates is the same templates)."""
    if given == trained:
        return True
    if key != "templates":
        return False
    from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates

    def load(value):
        return DEFAULT_TEMPLATES if value in (None, "") else value if isinstance(value, PromptTemplates) \
            else PromptTemplates.from_file(value)

    try:
        return load(given).hash == load(trained).hash
    except MemagentError:
        return False


def _same_model_file(model: str, spec: str) -> bool:
    """Whether the ``--model`` value names the file a llama.cpp model spec (``smollm2``, ``smollm2-f16``) stands
    for, as the spec or as a path (compared without writing the F16 copy)."""
    import os

    from memagent.backends.models import F16_GGUF, SMOLLM2_F16, cache_dir, smollm2_gguf_path

    if model == spec:
        return True
    try:
        target = os.path.join(cache_dir(), F16_GGUF) if spec == SMOLLM2_F16 else smollm2_gguf_path()
    except MemagentError:
        return False
    return os.path.realpath(model) == os.path.realpath(target)
