"""Extra sampling settings (beyond temperature and top-p): memagent's name -> each engine's own name.

A request carries in ``Request.sampling`` the agent's extra sampling settings that are off their default
(:meth:`memagent.agent.config.AgentConfig.sampling_options`; a setting at its default is never sent, so it
changes nothing anywhere). Each backend asks :func:`engine_options` for them under its engine's names and
passes them on; a setting that its backend has no entry for is refused with a :class:`ConfigError` naming
the setting, the backend and the backends that take it.

To add a setting: declare it in :class:`memagent.agent.config.AgentConfig` with ``sampling=True`` and add its
entry to :data:`ENGINE_NAMES`.
"""

from __future__ import annotations

from typing import Any

from memagent.errors import ConfigError
from memagent.types import Request

#: setting -> {backend name: the engine's name of that setting}. ``openai`` sends it as a body field.
ENGINE_NAMES: dict[str, dict[str, str]] = {
    # llama.cpp's repeat_penalty, transformers' GenerationConfig and vLLM's SamplingParams repetition_penalty;
    # the body field vLLM, SGLang and llama.cpp's server read on /chat/completions
    "repetition_penalty": {"llamacpp": "repeat_penalty", "hf": "repetition_penalty", "vllm": "repetition_penalty",
                           "openai": "repetition_penalty"},
}


def engine_options(request: Request, backend: str) -> dict[str, Any]:
    """The request's extra sampling settings under the engine's names, for backend ``backend``.

    Args:
        request: the request (its ``sampling`` holds only settings off their default).
        backend: the backend's registered name (``llamacpp``, ``hf``, ``vllm``, ``openai``, ``scripted``).

    Raises:
        ConfigError: a setting this backend cannot apply (or one memagent does not know).
    """
    out = {}
    for name, value in request.sampling.items():
        names = ENGINE_NAMES.get(name)
        if names is None:
            raise ConfigError(f"request {request.request_id!r}: unknown sampling setting {name!r} (known: "
                              f"{', '.join(sorted(ENGINE_NAMES)) or 'none'})")
        if backend not in names:
            raise ConfigError(f"the {backend} backend cannot apply {name}={value!r}; leave it at its default, or use a "
                              f"backend that takes it ({', '.join(sorted(names))})")
        out[names[backend]] = value
    return out
