"""Rollouts on OpenAI-compatible servers that load LoRA adapters at run time (``run.rollout_engine=servers``).

The servers (vLLM replicas, started with ``--enable-lora --max-lora-rank R`` and the environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) serve the base model. After every update the trainer writes the
policy's adapter (peft format: ``adapter_config.json`` + ``adapter_model.safetensors``) to a new folder and
asks each server to load it under a new name (``POST /v1/load_lora_adapter``), then to drop the previous one
(``POST /v1/unload_lora_adapter``); rollout requests name the current adapter as their ``model``. Requests
ask for the exact token ids (``return_token_ids``), so nothing is re-tokenised.

Routing is the one of ``memagent eval`` over several ``--base-url`` servers
(:mod:`memagent.backends.endpoints`): least-loaded, one RL group's calls to the same server while it is not
much busier (the group shares its prompts' prefixes), a server that fails leaves the rotation and its requests
are retried on another. A server that comes back is given the current adapter before it takes requests
again (its health check loads it), so no request reaches a server with a stale policy.

The adapter folders must be readable by the servers at the path the trainer writes them to
(``run.rollout_adapter_dir``: a shared file system when the servers run on other machines).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from typing import Any

import httpx

from memagent.backends.openai_compat import OpenAIBackend, _Transient
from memagent.errors import BackendError, ConfigError

#: Adapter folders kept on disk (the current one and the one before it, which requests of a step that
#: overlapped the swap could still name).
KEEP_ADAPTERS = 2


class LoraServersBackend(OpenAIBackend):
    """An :class:`~memagent.backends.openai_compat.OpenAIBackend` whose requests name the current LoRA adapter,
    which :meth:`publish` loads on every server.

    Args:
        base_url: the servers' API roots (``http://host:8000/v1``).
        base_model: the served base model's name (requests before the first :meth:`publish` use it).
        tokenizer: memagent's tokenizer of the model (chunking and budgets).
        pad_id: the padding token id of the training batches.
        **kwargs: further :class:`OpenAIBackend` settings (``concurrency``, ``transport``, ...).

    Attributes:
        adapter: ``(name, path)`` of the adapter requests use, or ``None`` (the base model).
        loaded: per server URL, the adapter name it holds.
    """

    def __init__(self, base_url, base_model: str, tokenizer=None, pad_id: int = 0, **kwargs: Any):
        extra = dict(kwargs.pop("extra_body", None) or {})
        extra.setdefault("return_token_ids", True)  # the exact prompt and response ids (vLLM >= 0.10.2)
        extra.setdefault("skip_special_tokens", False)
        # sample from the policy's own distribution: without these vLLM applies the model's generation config
        # (e.g. a top_k), and the rollouts would be off-policy with nothing to correct it. A repetition penalty
        # is the request's own setting; start vLLM with --generation-config vllm so none comes from the model.
        for key, value in (("top_k", -1), ("min_p", 0.0)):
            extra.setdefault(key, value)
        super().__init__(base_url, base_model, tokenizer=tokenizer, extra_body=extra, **kwargs)
        self.pad_id = pad_id
        self.adapter: tuple[str, str] | None = None
        self.loaded: dict[str, str] = {}

    # The pool's health check, run for a server out of the rotation (and once per server at start): a server
    # that answers is given the current adapter before it takes requests again. It is loaded every time, not
    # only when this client thinks the server lacks it: a server that went down may have restarted empty.
    def _probe(self, url: str, timeout_s: float = 2.0) -> httpx.Response:
        resp = super()._probe(url, timeout_s)
        if self.adapter is not None:
            self._load(url, *self.adapter, timeout_s=max(timeout_s, 30.0))
        return resp

    def _read(self, resp: httpx.Response, request, ep=None):
        # a server that restarted between two requests (its kept-alive connection reopened at once, so it never
        # left the rotation) answers 404 for the adapter it no longer holds: take it out of the rotation, where
        # its health check loads the adapter again, and retry the request elsewhere (or there, once loaded)
        if resp.status_code == 404 and self.adapter is not None and self.adapter[0] in resp.text:
            url = str(resp.request.url)
            ep = next((e for e in self.pool.endpoints if url.startswith(e.url + "/")), None)
            if ep is not None:
                self.loaded.pop(ep.url, None)
                self.pool.mark_down(ep, f"it lost LoRA adapter {self.adapter[0]} (restarted?)")
                raise _Transient(BackendError(f"{ep.url} does not hold adapter {self.adapter[0]} (restarted?); "
                                              "loading it again", request.request_id), failover=True)
        return super()._read(resp, request, ep)

    def _load(self, url: str, name: str, path: str, timeout_s: float | None = None) -> None:
        """Load adapter ``name`` from ``path`` on the server at ``url``, then unload the one it held.

        Raises:
            httpx.HTTPError: the server cannot be reached.
            BackendError: the server refused the adapter (the message names the server and its answer).
        """
        kw = {"timeout": timeout_s} if timeout_s is not None else {}
        resp = self._client.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": path}, **kw)
        # names are new for every version, so "already loaded" means this server kept it (it did not restart)
        already = resp.status_code == 400 and "already" in resp.text.lower()
        if resp.status_code >= 400 and not already:
            raise BackendError(f"{url} refused LoRA adapter {name!r} from {path} (HTTP {resp.status_code}: "
                               f"{resp.text[:300]}); start vLLM with --enable-lora --max-lora-rank >= the adapter's "
                               "rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and give it read access to "
                               "run.rollout_adapter_dir")
        old = self.loaded.get(url)
        self.loaded[url] = name
        if old is not None and old != name:
            try:
                self._client.post(f"{url}/unload_lora_adapter", json={"lora_name": old})
            except httpx.HTTPError:
                pass  # the old adapter only takes server memory; the next publish tries again with its own

    def publish(self, name: str, path: str) -> None:
        """Make adapter ``name`` (a peft folder at ``path``) the one every request uses: load it on each server
        in the rotation; a server that cannot be reached leaves it (and gets the adapter when it comes back).

        Raises:
            BackendError: a server refused the adapter, or no server could load it.
        """
        self.adapter = (name, path)
        self.model = name
        failures = []
        for ep in self.pool.endpoints:
            if not ep.up:
                continue
            try:
                self._load(ep.url, name, path)
            except httpx.HTTPError as e:
                failures.append(ep.url)
                self.pool.mark_down(ep, f"{type(e).__name__}: {e}", quiet=True)
                warnings.warn(f"cannot reach {ep.url} to load adapter {name} ({type(e).__name__}); it leaves the "
                              "rotation until it answers again (then it gets the adapter first)", stacklevel=2)
        if not self.pool.any_up():
            raise BackendError(f"no rollout server could load adapter {name!r} ({', '.join(failures)}): start the "
                               "servers of run.rollout_servers and rerun (training resumes from its checkpoint)")


class ServerRolloutEngine:
    """The rollout engine of ``run.rollout_engine=servers`` (see the module docstring); the trainer uses it like
    :class:`memagent.train.engine.RolloutEngine`.

    Args:
        cfg, dist, policy, tokenizer, fsdp: as :class:`memagent.train.engine.RolloutEngine`; ``policy`` must be a
            ``peft.PeftModel`` (LoRA training).

    Attributes:
        backend: the :class:`LoraServersBackend`.
        rollout_policy: the policy module (its adapter is what is published).
        folder: where the adapter folders are written (``run.rollout_adapter_dir``).

    Raises:
        ConfigError: full fine-tuning, FSDP, or no servers configured.
        BackendError: no server answers, or one refuses the adapter.
    """

    def __init__(self, cfg, dist, policy, tokenizer, fsdp: bool, transport: httpx.BaseTransport | None = None):
        if getattr(policy, "peft_config", None) is None:
            raise ConfigError("run.rollout_engine=servers loads the policy's LoRA adapter on the servers after every "
                              "update, so it trains LoRA only: turn LoRA on (model.lora.enabled=true)")
        if fsdp:
            raise ConfigError("run.rollout_engine=servers does not run under FSDP (the adapter would be sharded); "
                              "use run.distributed ddp")
        if not cfg.run.rollout_servers:
            raise ConfigError("run.rollout_engine=servers needs run.rollout_servers (the servers' API roots)")
        from memagent.tokenization import HFTokenizer

        self.cfg, self.dist, self.policy, self.tokenizer = cfg, dist, policy, tokenizer
        self.rollout_policy = policy
        root = cfg.run.rollout_adapter_dir or os.path.join(cfg.run.output_dir, "rollout_adapters")
        self.folder = os.path.abspath(root)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.backend = LoraServersBackend(
            list(cfg.run.rollout_servers), str(cfg.model.path), tokenizer=HFTokenizer(tokenizer, "policy"),
            pad_id=pad, concurrency=cfg.run.rollout_concurrency, transport=transport)
        self.backend.check_reachable(check_model=False)  # requests name adapters, published below
        # adapter names are new for every engine (a resumed run never meets a name a server still holds from
        # before), every version and, under torchrun, every process (each publishes its own identical copy)
        self.run_tag = f"{uuid.uuid4().hex[:8]}" + (f"-r{dist.rank}" if dist.enabled else "")
        self.published = 0
        self.versions: list[str] = []
        self.sync()
        check_token_ids(self.backend)  # on the adapter just published: a name every server serves

    def sync(self) -> None:
        """Write the policy's adapter to a new folder and load it on every server."""
        name = f"memagent-{self.run_tag}-v{self.published}"
        path = os.path.join(self.folder, name)
        os.makedirs(self.folder, exist_ok=True)
        self.policy.save_pretrained(path)
        self.backend.publish(name, path)
        self.published += 1
        self.versions.append(path)
        for old in self.versions[:-KEEP_ADAPTERS]:
            shutil.rmtree(old, ignore_errors=True)
        self.versions = self.versions[-KEEP_ADAPTERS:]

    def save_policy(self, path: str) -> None:
        """Write the adapter and tokenizer (the policy is a peft model: merge with ``memagent export``)."""
        self.policy.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def close(self) -> None:
        self.backend.close()



def check_token_ids(backend: LoraServersBackend) -> None:
    """One 1-token request: the servers must return the exact prompt and response token ids, which the update
    trains on.

    Raises:
        ConfigError: the answer has no ``prompt_token_ids`` or ``token_ids`` (a server that ignores
            ``return_token_ids``: vLLM before 0.10.2, SGLang, llama.cpp's server).
    """
    from memagent.types import Message, Request

    comp = backend.generate([Request(messages=(Message("user", "Say OK."),), max_tokens=1, temperature=1.0,
                                     top_p=1.0, request_id="token-id-check")])[0]
    if comp.error is not None:
        raise BackendError(f"the rollout servers failed a 1-token request: {comp.error}")
    if comp.prompt_token_ids is None or comp.token_ids is None:
        raise ConfigError("run.rollout_engine=servers trains on the exact token ids the servers sampled, and "
                          f"{', '.join(backend.base_urls)} did not return them (prompt_token_ids / token_ids with "
                          "return_token_ids=true): use vLLM >= 0.10.2, or run.rollout_engine vllm/llamacpp/hf")
