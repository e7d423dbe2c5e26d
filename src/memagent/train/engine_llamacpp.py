"""The pieces of the llama.cpp rollout engine (``run.rollout_engine=llamacpp``,
:class:`memagent.train.engine.LlamaCppEngine`): a batched llama.cpp engine on an F16 copy of the base GGUF, with
the policy's LoRA adapter pushed into it after every update.

At start the engine writes, once per run folder, an F16 dequantized copy of the base GGUF
(``output_dir/rollout/base-f16.gguf``; reused on resume while its source is unchanged): on it llama.cpp's
logits stay within about 0.05 of transformers' on the same weights, where the Q4_1 file differs by up to 1.4.
Rollouts and validation answers run through :class:`memagent.backends.llamacpp_batch.BatchedLlamaCppBackend`
(a step's requests as parallel sequences with shared prompt prefixes), which returns the exact prompt and
sampled ids (the stop token kept, so the policy learns to stop) and each sampled token's log-probability
at the sampling temperature. :meth:`~memagent.train.engine.LlamaCppEngine.sync` writes the live peft model's adapter as a llama.cpp
LoRA GGUF (``output_dir/rollout/adapter.gguf``) and pushes it into the engine; the trainer calls it after every
update and after a resume.

The engine serves LoRA training only: full fine-tuning would need the whole model rewritten and reloaded
every step, so it is refused.
"""

from __future__ import annotations

import os

from memagent.errors import ConfigError

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
    record beside it (``base-f16.json``: source path and size in bytes) still matches ``source``
    (:func:`memagent.backends.models.cached_f16_copy`).

    Returns:
        the copy's path.
    """
    from memagent.backends.models import cached_f16_copy

    return cached_f16_copy(source, folder)


def rollout_window_tokens(cfg, model_window: int | None) -> int:
    """Each sequence's window in tokens: the agent's budgets (chunk, memory in and out, final answer, slack) plus
    :data:`PROMPT_ALLOWANCE_TOKENS`, capped at the model's own window."""
    a = cfg.agent.rollout
    need = a.chunk_tokens + 2 * a.memory_tokens + a.final_tokens + 2 * a.slack_tokens + PROMPT_ALLOWANCE_TOKENS
    return min(need, model_window) if model_window else need
