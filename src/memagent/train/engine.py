"""Rollout engines: what generates the rollouts (and validation answers), and how it gets new weights.

The trainer talks to an engine through two seams: :attr:`RolloutEngine.backend` (a
:class:`memagent.backends.base.Backend` that returns exact token ids, built through the one backend factory)
and :meth:`RolloutEngine.sync` (bring the engine up to the policy's weights after an update or a resume).
:func:`make_engine` picks one from ``run.rollout_engine``: ``hf`` (:class:`RolloutEngine`), ``vllm``
(:class:`VLLMEngine`), ``llamacpp`` (:class:`LlamaCppEngine`, a batched
llama.cpp engine that gets the LoRA adapter pushed after each step) or ``servers``
(:class:`memagent.train.engine_servers.ServerRolloutEngine`: OpenAI-compatible vLLM servers that load the LoRA
adapter at run time). Another engine subclasses
:class:`RolloutEngine` and is added there.

Under FSDP the policy is sharded, so rollouts run on an unsharded copy (:attr:`RolloutEngine.rollout_policy`)
that :meth:`sync` refreshes from the gathered full weights (a collective: every rank calls it).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from memagent.backends.factory import open_backend
from memagent.errors import ConfigError
from memagent.train.config import TrainConfig
from memagent.train.distributed import DistInfo, barrier
from memagent.train.engine_llamacpp import base_gguf_source, cached_f16_base, rollout_window_tokens


class RolloutEngine:
    """Rollouts on the policy module itself through transformers ``generate`` (``run.rollout_engine=hf``).

    Args:
        cfg: the training configuration.
        dist: process placement.
        policy: the (not yet sharded) policy module.
        tokenizer: its transformers tokenizer.
        fsdp: the policy will be sharded: roll out on an unsharded copy.

    Attributes:
        rollout_policy: the module rollouts run on (the policy itself, or its unsharded copy under FSDP).
        backend: the rollout backend.
    """

    def __init__(self, cfg: TrainConfig, dist: DistInfo, policy: torch.nn.Module, tokenizer: Any, fsdp: bool):
        self.cfg, self.dist, self.policy, self.tokenizer, self.fsdp = cfg, dist, policy, tokenizer, fsdp
        self.rollout_policy = copy.deepcopy(policy).eval().requires_grad_(False) if fsdp else policy
        self.backend = self.build_backend()

    def build_backend(self):
        """The rollout backend (here: :class:`memagent.backends.hf.HFBackend` on :attr:`rollout_policy`)."""
        backend, _ = open_backend({"name": "hf", "model": self.rollout_policy, "tokenizer": self.tokenizer,
                                   "max_batch_size": self.cfg.agent.rollout.batch_size, "seed": self.cfg.run.seed})
        return backend

    def sync(self) -> None:
        """Bring the rollouts up to the policy's weights after they changed (an update or a resume).

        FSDP: gather the full weights (a collective: every rank calls this) into the unsharded rollout copy.
        Otherwise rollouts run on the policy module itself and nothing is copied."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True))
            self.rollout_policy.load_state_dict(full)

    def save_policy(self, path: str) -> None:
        """Write the full rollout weights and tokenizer as a model directory (also under FSDP)."""
        self.rollout_policy.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def close(self) -> None:
        """Release the engine. Call it after the last collective of the run."""
        self.backend.close()


class VLLMEngine(RolloutEngine):
    """Rollouts on an in-process vLLM engine (``run.rollout_engine=vllm``), started from the policy's weights
    (written once to ``output_dir/rollout_init``, which vLLM loads) and given the new weights in memory after
    every step. Closing it shuts the engine down (under torchrun vLLM's teardown also destroys the process
    groups it joined)."""

    def build_backend(self):
        init = os.path.join(self.cfg.run.output_dir, "rollout_init")
        if self.dist.is_main:
            self.rollout_policy.save_pretrained(init)
            self.tokenizer.save_pretrained(init)
        barrier()
        extra = {}
        if self.dist.enabled:  # one engine per process, inside the torchrun world vLLM finds already set up
            extra = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}
        backend, _ = open_backend({"name": "vllm", "model": init, "dtype": self.cfg.model.dtype,
                                   "seed": self.cfg.run.seed + self.dist.rank,
                                   "gpu_memory_utilization": self.cfg.run.vllm_gpu_memory_utilization,
                                   "weight_sync": True, "tokenizer": self.tokenizer, **extra})
        return backend

    def sync(self) -> None:
        """Gather the full weights (FSDP), then copy them into the engine."""
        super().sync()
        with torch.no_grad():
            self.backend.load_weights((n, p.detach()) for n, p in self.rollout_policy.named_parameters())


class LlamaCppEngine(RolloutEngine):
    """Rollouts on a batched llama.cpp engine over an F16 copy of the base GGUF, the LoRA adapter pushed after
    every update (``run.rollout_engine=llamacpp``; see :mod:`memagent.train.engine_llamacpp`). Arguments as
    :class:`RolloutEngine`; ``policy`` must be a ``peft.PeftModel`` (LoRA training).

    Attributes:
        base_path: the F16 base GGUF the engine runs.
        adapter_path: where :meth:`sync` writes the adapter GGUF.

    Raises:
        ConfigError: full fine-tuning (not a peft model), FSDP, or a policy that does not come from a GGUF.
    """

    def __init__(self, cfg, dist, policy: torch.nn.Module, tokenizer: Any, fsdp: bool):
        if getattr(policy, "peft_config", None) is None:
            raise ConfigError("run.rollout_engine=llamacpp pushes the policy's LoRA adapter into llama.cpp after every "
                              "update, so it trains LoRA only; turn LoRA on (model.lora.enabled=true) or use "
                              "run.rollout_engine hf for full fine-tuning")
        if fsdp:
            raise ConfigError("run.rollout_engine=llamacpp does not run under FSDP (the adapter would be sharded); "
                              "use run.distributed ddp or run.rollout_engine hf")
        self.folder = os.path.join(cfg.run.output_dir, "rollout")
        self.adapter_path = os.path.join(self.folder, f"adapter.rank{dist.rank}.gguf" if dist.enabled else "adapter.gguf")
        source = base_gguf_source(cfg.model.path)
        if dist.is_main:
            cached_f16_base(source, self.folder)
        barrier()
        self.base_path = os.path.join(self.folder, "base-f16.gguf")
        super().__init__(cfg, dist, policy, tokenizer, fsdp)
        self.sync()  # the adapter as it starts (a fresh LoRA is a no-op, a loaded one is not)

    def build_backend(self):
        """A :class:`~memagent.backends.llamacpp_batch.BatchedLlamaCppBackend` on :attr:`base_path`, one sequence
        per sample the agent advances together, keeping stop tokens."""
        model_window = getattr(getattr(self.policy, "config", None), "max_position_embeddings", None)
        backend, _ = open_backend({
            "name": "llamacpp-batch", "model_path": self.base_path,
            "n_ctx": rollout_window_tokens(self.cfg, model_window), "n_parallel": self.cfg.agent.rollout.batch_size,
            "n_threads": self.rollout_threads(), "seed": self.cfg.run.seed + self.dist.rank,
            "keep_stop_token": True})
        pad = self.tokenizer.pad_token_id
        backend.pad_id = pad if pad is not None else self.tokenizer.eos_token_id  # training batches' padding
        return backend

    def rollout_threads(self) -> int:
        """``run.rollout_threads``, or every core divided among the job's processes (at least 1)."""
        if self.cfg.run.rollout_threads is not None:
            return self.cfg.run.rollout_threads
        return max(1, (os.cpu_count() or 1) // max(1, self.dist.world_size))

    def sync(self) -> None:
        """Write the policy's adapter as a llama.cpp LoRA GGUF and push it into the engine."""
        from memagent.export.gguf_lora import write_peft_lora_gguf

        os.makedirs(self.folder, exist_ok=True)
        write_peft_lora_gguf(self.policy, self.adapter_path)
        self.backend.load_adapter(self.adapter_path)


def _server_engine(cfg, dist, policy, tokenizer, fsdp):
    from memagent.train.engine_servers import ServerRolloutEngine

    return ServerRolloutEngine(cfg, dist, policy, tokenizer, fsdp)


#: ``run.rollout_engine`` -> engine class (or factory).
ENGINES = {"hf": RolloutEngine, "vllm": VLLMEngine, "llamacpp": LlamaCppEngine, "servers": _server_engine}


def make_engine(cfg: TrainConfig, dist: DistInfo, policy: torch.nn.Module, tokenizer: Any, fsdp: bool) -> RolloutEngine:
    """The rollout engine ``run.rollout_engine`` names.

    Raises:
        ConfigError: the engine cannot serve this run (e.g. ``llamacpp`` with full fine-tuning).
    """
    return ENGINES[cfg.run.rollout_engine](cfg, dist, policy, tokenizer, fsdp)
