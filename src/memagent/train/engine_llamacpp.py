"""Training rollouts on llama.cpp (``run.rollout_engine=llamacpp``): a batched llama.cpp engine on an F16 copy of
the base GGUF, with the policy's LoRA adapter pushed into it after every update.

At start the engine writes, once per run folder, an F16 dequantized copy of the base GGUF
(``output_dir/rollout/base-f16.gguf``; reused on resume while its source is unchanged): on it llama.cpp's
logits stay within about 0.05 of transformers' on the same weights, where the Q4_1 file differs by up to 1.4.
Rollouts and validation answers run through :class:`memagent.backends.llamacpp_batch.BatchedLlamaCppBackend`
(a step's requests as parallel sequences with shared prompt prefixes), which returns the exact prompt and
sampled ids (the stop token kept, so the policy learns to stop) and each sampled token's log-probability
at the sampling temperature. :meth:`LlamaCppEngine.sync` writes the live peft model's adapter as a llama.cpp
LoRA GGUF (``output_dir/rollout/adapter.gguf``) and pushes it into the engine; the trainer calls it after every
update and after a resume.

The engine serves LoRA training only: full fine-tuning would need the whole model rewritten and reloaded
every step, so it is refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from memagent.errors import ConfigError
from memagent.train.distributed import barrier
from memagent.train.engine import RolloutEngine

#: Prompt tokens allowed, beyond the agent's budgets, for the template and the question when sizing each
#: sequence's window (a longer question is refused by the agent's budget check, naming the fix).
PROMPT_ALLOWANCE_TOKENS = 1024


def base_gguf_source(model_path: str) -> str:
    """The GGUF file a policy's ``model.path`` was loaded from.

    Args:
        model_path: ``model.path`` of the training config (``smollm2`` or a ``.gguf`` path).

    Raises:
        ConfigError: the policy does not come from a GGUF (``tiny`` or an HF directory), or the file is missing.
    """
    if model_path == "smollm2":
        from memagent.embedded import smollm2_gguf_path

        return smollm2_gguf_path()
    if not str(model_path).endswith(".gguf"):
        raise ConfigError(f"run.rollout_engine=llamacpp runs the base model from its GGUF (tokenizer and chat template "
                          f"included), but model.path {model_path!r} is not one; use model.path smollm2 or a .gguf "
                          "file, or run.rollout_engine hf")
    if not os.path.isfile(model_path):
        raise ConfigError(f"model.path {model_path!r}: GGUF file not found")
    return str(model_path)


def cached_f16_base(source: str, folder: str) -> str:
    """An F16 dequantized copy of ``source`` in ``folder`` (``base-f16.gguf``), written once and reused while a
    record beside it (``base-f16.json``: source path and size in bytes) still matches ``source``.

    Returns:
        the copy's path.
    """
    from memagent.export.gguf_model import write_dequantized_gguf

    path, record_path = os.path.join(folder, "base-f16.gguf"), os.path.join(folder, "base-f16.json")
    record = {"source": os.path.abspath(source), "source_bytes": os.path.getsize(source), "dtype": "f16"}
    if os.path.isfile(path) and os.path.isfile(record_path):
        with open(record_path, encoding="utf-8") as f:
            if json.load(f) == record:
                return path
    os.makedirs(folder, exist_ok=True)
    write_dequantized_gguf(source, path, "f16")  # atomic: a kill leaves no partial file
    with open(record_path, "w", encoding="utf-8") as f:
        json.dump(record, f)
    return path


def rollout_window_tokens(cfg, model_window: int | None) -> int:
    """Each sequence's window in tokens: the agent's budgets (chunk, memory in and out, final answer, slack) plus
    :data:`PROMPT_ALLOWANCE_TOKENS`, capped at the model's own window."""
    a = cfg.agent.rollout
    need = a.chunk_tokens + 2 * a.memory_tokens + a.final_tokens + 2 * a.slack_tokens + PROMPT_ALLOWANCE_TOKENS
    return min(need, model_window) if model_window else need


class LlamaCppEngine(RolloutEngine):
    """Rollouts on a batched llama.cpp engine over an F16 copy of the base GGUF, the LoRA adapter pushed after
    every update (see the module docstring). Arguments as :class:`RolloutEngine`; ``policy`` must be a
    ``peft.PeftModel`` (LoRA training).

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
        from memagent.backends.factory import open_backend

        model_window = getattr(getattr(self.policy, "config", None), "max_position_embeddings", None)
        backend, _ = open_backend({
            "name": "llamacpp-batch", "model_path": self.base_path,
            "n_ctx": rollout_window_tokens(self.cfg, model_window), "n_parallel": self.cfg.agent.rollout.batch_size,
            "n_threads": self.cfg.run.torch_threads, "seed": self.cfg.run.seed + self.dist.rank,
            "keep_stop_token": True})
        pad = self.tokenizer.pad_token_id
        backend.pad_id = pad if pad is not None else self.tokenizer.eos_token_id  # training batches' padding
        return backend

    def sync(self) -> None:
        """Write the policy's adapter as a llama.cpp LoRA GGUF and push it into the engine."""
        from memagent.export.gguf_lora import write_peft_lora_gguf

        os.makedirs(self.folder, exist_ok=True)
        write_peft_lora_gguf(self.policy, self.adapter_path)
        self.backend.load_adapter(self.adapter_path)
