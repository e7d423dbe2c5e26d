"""Checkpoints: save and resume a training run exactly (weights, optimizer, schedule, RNG, data position).

:class:`Checkpointer` writes ``output_dir/checkpoints/step_{step:06d}.pt`` (main process; under FSDP every rank
takes part in gathering the full state first) and keeps the newest ``run.keep_checkpoints``. What is saved of
the policy is decided by :meth:`Checkpointer.model_state` / :meth:`Checkpointer.load_model_state`: the full
state dict here; a policy that trains only some parameters (a LoRA adapter) overrides them to save those only.
A resume refuses a checkpoint made with other settings than the run's (the rule of
:mod:`memagent.runfiles.resume`; :data:`RESUMABLE_CHANGES` may change).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from memagent.errors import ConfigError
from memagent.runfiles.resume import setting_changes
from memagent.train.config import TrainConfig, config_to_dict, dotted
from memagent.train.distributed import DistInfo, barrier
from memagent.train.policy import rng_state, set_rng_state

#: Settings a resumed run may change: run length, logging, checkpoint cadence, the folder (a moved run) and
#: knobs that only trade memory for speed (``model.compute_dtype`` too: bfloat16 rounding moves log-probabilities by
#: about 1e-2, and "auto" resolves differently per machine). Anything else changes what is trained.
RESUMABLE_CHANGES = frozenset({
    "run.total_steps", "run.stop_after_step", "run.save_every", "run.val_every", "run.val_before_train",
    "run.keep_checkpoints", "run.tensorboard", "run.torch_threads", "run.rollout_threads", "run.resume", "run.output_dir", "run.distributed",
    "run.dist_timeout_s", "run.rollout_engine", "run.vllm_gpu_memory_utilization",
    "run.rollout_servers", "run.rollout_adapter_dir", "run.rollout_concurrency",
    "model.logprob_chunk_tokens", "model.gradient_checkpointing", "model.compute_dtype", "optim.micro_batch_tokens",
    "rl.shared_prefix", "rl.shared_prefix_min_tokens", "run.resume_changes",
})


#: What a training run writes into ``run.output_dir`` besides ``config.json``: a folder holding any of them is
#: a run's (maybe one stopped during its first validation), and may be resumed.
RUN_ENTRIES = ("metrics.jsonl", "checkpoints", "val", "tb", "policy", "adapter", "rollout", "rollout_adapters",
               "rollout_init")
#: The file in ``policy/`` or ``adapter/`` that records the training step the folder holds.
POLICY_STEP_FILE = "training_step.json"


def policy_step(folder: str | os.PathLike) -> int | None:
    """The training step a run's ``policy/`` or ``adapter/`` holds (:data:`POLICY_STEP_FILE`); ``None`` when the
    folder or the record is missing or unreadable (folders written before the record existed)."""
    import json

    try:
        with open(os.path.join(folder, POLICY_STEP_FILE), encoding="utf-8") as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


#: The rollout engines' scratch folders (weights or adapters handed to llama.cpp or vLLM): a trainer refused
#: before it trained anything removes those it wrote.
SCRATCH_ENTRIES = ("rollout", "rollout_adapters", "rollout_init")


def check_output_dir(path: str | os.PathLike) -> None:
    """Refuse a ``run.output_dir`` that cannot hold a training run, before any model loads: a file, a path
    under a file or a broken link; a folder whose ``config.json`` is not a training config (an export: the run
    would write its own over it); and a folder that holds files but no run (none of :data:`RUN_ENTRIES` nor a
    training ``config.json``). An absent or empty folder, or one holding a run (with
    whatever notes were copied beside it), passes.

    Raises:
        ConfigError: naming the folder and what to do.
    """
    from memagent.runfiles import folder_problem, unwritable

    where = f"run.output_dir {os.fspath(path)!r}"
    problem = folder_problem(path) or unwritable(path)
    if problem:
        raise ConfigError(f"{where} {problem}; give a new or empty folder (or a training run's folder to resume it)")
    if not os.path.isdir(path):
        return
    config = os.path.join(path, "config.json")
    kind = _config_kind(config)
    if kind == "other":
        raise ConfigError(f"{where} holds a config.json that is not a training config (an exported model?), which "
                          "the run would overwrite; give a new or empty folder")
    is_run = kind == "train" or any(os.path.exists(os.path.join(path, name)) for name in RUN_ENTRIES)
    entries = sorted(e for e in os.listdir(path) if not e.startswith("."))
    if entries and not is_run:
        shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
        raise ConfigError(f"{where} holds files but no training run ({shown}); give a new or empty folder, so that "
                          "nothing there is overwritten")


def _config_kind(path: str) -> str | None:
    """``"train"`` (a training config), ``"other"`` (JSON of something else: an export's), ``"unreadable"`` (a
    file torn by a kill: the run rewrites it, its checkpoints hold the settings), or ``None`` (no file)."""
    import json

    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return "unreadable"
    return "train" if isinstance(d, dict) and {"run", "rl", "optim"} <= set(d) else "other"


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every setting that differs, except :data:`RESUMABLE_CHANGES`; a key an older
    checkpoint lacks counts as its default."""
    return setting_changes(old, new, RESUMABLE_CHANGES, defaults=dotted(config_to_dict(TrainConfig())))


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
        self.lora = cfg.model.lora.enabled
        self._base_fingerprint: str | None = None  # LoRA: the frozen base's CRC, computed once

    def found(self) -> list[str]:
        """Checkpoint files, oldest first."""
        return sorted(glob.glob(os.path.join(self.dir, "step_*.pt")))

    # ---------------------------------------------------------------------------------- policy state
    def model_state(self, policy: torch.nn.Module) -> dict[str, Any]:
        """The policy's saved state: every tensor, unsharded, on the CPU, keyed by name (a collective under FSDP).
        LoRA: the adapter only and a fingerprint of the frozen base (:mod:`memagent.train.lora`)."""
        if self.lora:
            from memagent.train.lora import adapter_state_dict, base_fingerprint

            if self._base_fingerprint is None:
                self._base_fingerprint = base_fingerprint(policy)
            return {"adapter": adapter_state_dict(policy), "base_fingerprint": self._base_fingerprint}
        if not self.fsdp:
            return {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state(self, policy: torch.nn.Module, state: dict[str, Any]) -> None:
        """Load what :meth:`model_state` saved.

        Raises:
            ConfigError: LoRA: the checkpoint was trained on other base weights, or its adapter has other shapes.
        """
        if self.lora:
            from memagent.train.lora import load_adapter_on_base

            self._base_fingerprint = load_adapter_on_base(policy, state["adapter"], state.get("base_fingerprint"),
                                                          "the checkpoint's adapter")
            return
        if not self.fsdp:
            policy.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(policy, state, options=StateDictOptions(full_state_dict=True))

    def optimizer_state(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (the layout of ``torch.distributed.checkpoint``: the
        same in one process, under DDP and under FSDP). LoRA: the adapters' state only."""
        if self.lora:
            from memagent.train.lora import optimizer_state_by_name

            return optimizer_state_by_name(optimizer, policy)
        if not self.fsdp:
            return optimizer_by_name(optimizer.state_dict(), policy)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what :meth:`optimizer_state` saved (also the by-index layout of checkpoints before 0.2)."""
        if self.lora:
            from memagent.train.lora import load_optimizer_state_by_name

            load_optimizer_state_by_name(optimizer, policy, state)
            return
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
            lora = dataclasses.asdict(self.cfg.model.lora) if self.lora else None  # which kind of run (resume check)
            torch.save({**state, "rng": rng_state(), "config": config_to_dict(self.cfg), "lora": lora}, tmp)
            os.replace(tmp, path)
            for old in self.found()[: -self.cfg.run.keep_checkpoints]:
                os.remove(old)
        barrier()
        return path

    def load(self, templates_hash: str, data_hashes: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """The newest checkpoint's state, after checking it was made with this run's settings (``None``: no
        checkpoint). The RNG states are restored here; the caller loads the rest.

        The prompt templates and the data files are compared by content: the templates' text
        (``templates_hash``) and the questions as read (``data_hashes``: setting -> sha256 of its questions,
        :func:`memagent.train.data.samples_sha256`, for ``data.train_path`` and, when validation reads one,
        ``data.val_path``), so the same file given by another path resumes and a file whose questions changed
        under the same path is refused. A setting the checkpoint has no hash for (one written before
        2026-12-07, or validation off on either side) is compared as written instead.

        Raises:
            ConfigError: the checkpoint was made with other settings in keys that change what is trained
                (anything but :data:`RESUMABLE_CHANGES` and ``run.resume_changes``): a resumed run would otherwise
                mix two configurations unawares.
        """
        found = self.found()
        if not found:
            return None
        path, state = self._newest_readable(found)
        from memagent.train.lora import check_resume_kind

        check_resume_kind(state.get("lora"), self.cfg.model.lora, path)  # LoRA vs full fine-tuning, with what differs
        changes = config_changes(state.get("config", {}), config_to_dict(self.cfg))
        old_hashes = state.get("data_sha256") or {}
        for key, new in (data_hashes or {}).items():
            old = old_hashes.get(key)
            if old is None:
                continue
            changes = [c for c in changes if c[0] != key]  # the questions, not the path they came from
            if old != new:
                changes.append((key, f"questions with sha256 {old[:12]}...", f"questions with sha256 {new[:12]}..."))
        if state.get("templates_hash", templates_hash) == templates_hash:  # the file's text, not its path
            changes = [c for c in changes if c[0] != "agent.templates"]
        else:
            changes = [c for c in changes if c[0] != "agent.templates"]
            changes.append(("agent.templates (the prompt templates' text)", state["templates_hash"], templates_hash))
        old_total = state.get("config", {}).get("run", {}).get("total_steps", self.cfg.run.total_steps)
        if self.cfg.optim.schedule == "cosine" and old_total != self.cfg.run.total_steps:
            changes.append(("run.total_steps (the cosine schedule decays to 0 at it)", old_total, self.cfg.run.total_steps))
        changed, branched = self._branch(changes)
        if changed:
            listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
            raise ConfigError(f"{path} was saved with other settings ({listing}); resume with the checkpoint's "
                              "settings, or choose another run.output_dir to start a new run (to branch this "
                              "one on purpose, name the keys in run.resume_changes)")
        if branched and self.dist.is_main:
            listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in branched)
            warnings.warn(f"resuming {path} (step {state['step']}) with changed settings ({listing}), as "
                          "run.resume_changes allows: the run continues under the new values", stacklevel=2)
        set_rng_state(state["rng"])
        return state

    def _branch(self, changed: list[tuple[str, Any, Any]]) -> tuple[list, list]:
        """``changed`` split into the changes ``run.resume_changes`` does not allow and those it does."""
        allowed = set(self.cfg.run.resume_changes)  # each a setting: TrainConfig checks it as it loads
        key = lambda c: c[0].split(" ", 1)[0]  # noqa: E731 - "agent.templates (the prompt templates' text)"
        return [c for c in changed if key(c) not in allowed], [c for c in changed if key(c) in allowed]

    def _newest_readable(self, found: list[str]) -> tuple[str, dict[str, Any]]:
        """``(path, state)`` of the newest checkpoint that loads; a file that does not (truncated by a kill or a
        full disk) is skipped with a warning naming it, and the previous one is tried.

        Raises:
            ConfigError: no checkpoint loads (each file with its error).
        """
        bad = []
        for path in reversed(found):
            try:
                state = torch.load(path, map_location="cpu", weights_only=False)
                if not isinstance(state, dict) or "step" not in state:
                    raise ValueError("not a training checkpoint (no step)")
            except Exception as e:  # noqa: BLE001 - any unreadable file: pickle, zip and EOF errors alike
                bad.append(f"{path} ({type(e).__name__}: {e})")
                warnings.warn(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); resuming from the "
                              "previous checkpoint instead", stacklevel=3)
                continue
            return path, state
        raise ConfigError(f"no checkpoint in {self.dir} can be read: {'; '.join(bad)}. Remove the unreadable files to "
                          "start the run over in this folder, or choose another run.output_dir")


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
