"""Checkpoints: save and resume a training run exactly (weights, optimizer, schedule, RNG, data position).

:class:`Checkpointer` writes ``output_dir/checkpoints/step_{step:06d}.pt`` (main process; under FSDP every rank
takes part in gathering the full state first) and keeps the newest ``run.keep_checkpoints``. What is saved of
the policy is decided by :meth:`Checkpointer.model_state` / :meth:`Checkpointer.load_model_state`: the full
state dict here; a policy that trains only some parameters (a LoRA adapter) overrides them to save those only.
A resume refuses a checkpoint made with other settings than the run's (the rule of
:mod:`memagent.runfiles.resume`; :data:`RESUMABLE_CHANGES` may change).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from memagent.errors import ConfigError
from memagent.runfiles.resume import setting_changes
from memagent.train.config import TrainConfig, config_to_dict
from memagent.train.distributed import DistInfo, barrier
from memagent.train.policy import rng_state, set_rng_state

#: Settings a resumed run may change: run length, logging, checkpoint cadence, the folder (a moved run) and
#: knobs that only trade memory for speed. Anything else changes what is trained and must match the checkpoint.
RESUMABLE_CHANGES = frozenset({
    "run.total_steps", "run.stop_after_step", "run.save_every", "run.val_every", "run.val_before_train",
    "run.keep_checkpoints", "run.tensorboard", "run.torch_threads", "run.resume", "run.output_dir", "run.distributed",
    "run.dist_timeout_s", "run.rollout_engine", "run.vllm_gpu_memory_utilization",
    "model.logprob_chunk_tokens", "model.gradient_checkpointing", "optim.micro_batch_tokens",
})


def _dotted(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every setting that differs, except :data:`RESUMABLE_CHANGES`; a key an older
    checkpoint lacks counts as its default."""
    return setting_changes(old, new, RESUMABLE_CHANGES, defaults=_dotted(config_to_dict(TrainConfig())))


class Checkpointer:
    """Saves and loads a training run's state.

    Args:
        cfg: the training configuration.
        dist: process placement.
        fsdp: the policy is sharded (state dicts are gathered: a collective).
    """

    def __init__(self, cfg: TrainConfig, dist: DistInfo, fsdp: bool):
        self.cfg, self.dist, self.fsdp = cfg, dist, fsdp
        self.dir = os.path.join(cfg.run.output_dir, "checkpoints")

    def found(self) -> list[str]:
        """Checkpoint files, oldest first."""
        return sorted(glob.glob(os.path.join(self.dir, "step_*.pt")))

    # ---------------------------------------------------------------------------------- policy state
    def model_state(self, policy: torch.nn.Module) -> dict[str, Any]:
        """The policy's saved state: every tensor, unsharded, on the CPU, keyed by name (a collective under FSDP)."""
        if not self.fsdp:
            return {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state(self, policy: torch.nn.Module, state: dict[str, Any]) -> None:
        """Load what :meth:`model_state` saved."""
        if not self.fsdp:
            policy.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(policy, state, options=StateDictOptions(full_state_dict=True))

    def optimizer_state(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (the layout of ``torch.distributed.checkpoint``: the
        same in one process, under DDP and under FSDP)."""
        if not self.fsdp:
            return optimizer_by_name(optimizer.state_dict(), policy)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        state = optimizer_by_name(state, policy)  # checkpoints before 0.2: by index
        if not self.fsdp:
            optimizer.load_state_dict(optimizer_by_index(state, policy))
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(policy, optimizer, state, options=StateDictOptions(full_state_dict=True))

    # ------------------------------------------------------------------------------------ save / load
    def save(self, state: dict[str, Any]) -> str:
        """Write ``state`` (main process; every rank calls this) as the checkpoint of ``state["step"]`` and drop
        all but the newest ``run.keep_checkpoints``. Returns its path."""
        path = os.path.join(self.dir, f"step_{state['step']:06d}.pt")
        if self.dist.is_main:
            os.makedirs(self.dir, exist_ok=True)
            tmp = path + ".tmp"
            torch.save({**state, "rng": rng_state(), "config": config_to_dict(self.cfg)}, tmp)
            os.replace(tmp, path)
            for old in self.found()[: -self.cfg.run.keep_checkpoints]:
                os.remove(old)
        barrier()
        return path

    def load(self, templates_hash: str) -> dict[str, Any] | None:
        """The newest checkpoint's state, after checking it was made with this run's settings (``None``: no
        checkpoint). The RNG states are restored here; the caller loads the rest.

        Raises:
            ConfigError: the checkpoint was made with other settings in keys that change what is trained
                (anything but :data:`RESUMABLE_CHANGES`): a resumed run would otherwise mix two configurations.
        """
        found = self.found()
        if not found:
            return None
        state = torch.load(found[-1], map_location="cpu", weights_only=False)
        changed = config_changes(state.get("config", {}), config_to_dict(self.cfg))
        if state.get("templates_hash", templates_hash) != templates_hash:  # the file's text, not its path
            changed.append(("prompt templates (agent.templates' text)", state["templates_hash"], templates_hash))
        old_total = state.get("config", {}).get("run", {}).get("total_steps", self.cfg.run.total_steps)
        if self.cfg.optim.schedule == "cosine" and old_total != self.cfg.run.total_steps:
            changed.append(("run.total_steps (the cosine schedule decays to 0 at it)", old_total, self.cfg.run.total_steps))
        if changed:
            listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
            raise ConfigError(f"{found[-1]} was saved with other settings ({listing}); resume with the checkpoint's "
                              "settings, or choose another run.output_dir to start a new run")
        set_rng_state(state["rng"])
        return state


def optimizer_by_name(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index (``optimizer.state_dict()`` of an optimizer built on
    ``model.parameters()``) re-keyed by parameter name (``named_parameters`` order, the same order); one
    keyed by name already is returned as is."""
    names = [n for n, _ in model.named_parameters()]
    groups = state.get("param_groups", [])
    if not groups or not groups[0]["params"] or isinstance(groups[0]["params"][0], str):
        return state
    return {"state": {names[i]: v for i, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}


def optimizer_by_index(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Inverse of :func:`optimizer_by_name`: the layout ``torch.optim.Optimizer.load_state_dict`` takes."""
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    return {"state": {index[k]: v for k, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}
