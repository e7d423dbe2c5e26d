"""Model backends behind one protocol (:class:`memagent.backends.base.Backend`).

Backends are registered by name and imported lazily, so `memagent` does not import torch or llama.cpp
unless the chosen backend needs them.
"""

from __future__ import annotations

from typing import Any

from memagent.backends.base import Backend
from memagent.registry import Registry

BACKENDS: Registry[Any] = Registry("backend")


def _scripted():
    from memagent.backends.scripted import ScriptedBackend

    return ScriptedBackend


def _llamacpp():
    from memagent.backends.llamacpp import LlamaCppBackend

    return LlamaCppBackend


def _llamacpp_batch():
    from memagent.backends.llamacpp_batch import BatchedLlamaCppBackend

    return BatchedLlamaCppBackend


def _openai():
    from memagent.backends.openai_compat import OpenAIBackend

    return OpenAIBackend


def _hf():
    from memagent.backends.hf import HFBackend

    return HFBackend


def _vllm():
    from memagent.backends.vllm import VLLMBackend

    return VLLMBackend


BACKENDS.register_lazy("scripted", _scripted)
BACKENDS.register_lazy("llamacpp", _llamacpp)
BACKENDS.register_lazy("llamacpp-batch", _llamacpp_batch)
BACKENDS.register_lazy("openai", _openai)
BACKENDS.register_lazy("hf", _hf)
BACKENDS.register_lazy("vllm", _vllm)


def make_backend(name: str, **kwargs: Any) -> Backend:
    """Build the backend registered as ``name`` with keyword settings.

    Raises:
        UnknownNameError: no backend of that name (suggests the closest).
        ConfigError: a keyword the backend does not take (names the closest valid one).
    """
    import inspect

    from memagent.errors import ConfigError, closest

    factory = BACKENDS.get(name)
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        valid = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and k != "self"]
        for k in kwargs:
            if k not in valid:
                close = closest(k, valid)
                hint = f"; did you mean {close!r}?" if close else ""
                raise ConfigError(f"backend {name!r} has no setting {k!r}{hint} (settings: {', '.join(valid)})")
    return factory(**kwargs)


__all__ = ["BACKENDS", "Backend", "make_backend"]  # building from settings: memagent.backends.factory
