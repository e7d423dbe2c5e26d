"""The training loop: rollout -> reward -> advantage -> loss -> optimizer step, with checkpoints.

One training step: take ``prompts_per_step`` questions (in data order), sample ``group_size`` MemAgent
trajectories for each with the current policy (:mod:`memagent.train.rollout`), score the final answers with
the strict verifier, compute group advantages per trajectory and broadcast them to every conversation
(:mod:`memagent.rl`), compute old-policy and reference log-probabilities of every row, then make
``mini_batches`` optimizer steps over whole-trajectory mini-batches (gradient accumulation over
micro-batches, :mod:`memagent.train.update`). The learning-rate schedule advances once per training step.

Source: reference-memagent.md §4.1 (hyperparameters), §4.7 (step), §4.8 (update), §4.10 (objective).
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import math
import os
import random
import time
import zlib
from typing import Any

import torch

from memagent.errors import ConfigError
from memagent.rl.advantages import group_advantages
from memagent.rl.multiconv import broadcast_advantages, check_rows
from memagent.train.batching import TokenLogProbs, row_logprobs, split_trajectories
from memagent.train.config import TrainConfig, config_to_dict, with_defaults
from memagent.train.distributed import DistInfo, all_reduce_max, all_reduce_sum, barrier, shard_fsdp, wrap_ddp
from memagent.train.rollout import collect_rollouts
from memagent.train.update import LossSettings, mini_batch_backward


def load_policy(cfg: TrainConfig) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``cfg.model.path`` (``tiny``, ``smollm2``, HF directory or ``.gguf``)."""
    from memagent.backends.hf import load_hf_model

    path = cfg.model.path
    if path == "tiny":
        from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

        tok = make_tiny_tokenizer()
        model = make_tiny_model(tok, seed=cfg.run.seed)
        return model.to(torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16), tok
    if path == "smollm2":
        from memagent.backends.models import smollm2_gguf_path

        path = smollm2_gguf_path()
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


class Trainer:
    """Multi-conversation GRPO trainer (see module docstring).

    Args:
        cfg: the training configuration.
        dist_info: process placement (default: single process).
        train_samples, val_samples: override the configured data (tests); ``val_samples`` maps a length
            multiplier to its questions.
        reward_fn: override the configured reward ``(response, answers) -> float`` (tests).

    Raises:
        ConfigError: inconsistent settings (e.g. prompts per step not divisible by the world size).
    """

    def __init__(self, cfg: TrainConfig, dist_info: DistInfo | None = None, train_samples=None, val_samples=None,
                 reward_fn=None):
        from memagent.backends.hf import HFBackend

        if cfg.model.lora.enabled or cfg.model.compute_dtype != "float32":  # the building blocks exist; see docs
            raise ConfigError("model.lora.enabled and model.compute_dtype=bfloat16 are not wired into this trainer yet "
                              "(memagent.train.lora / memagent.train.precision provide them); train with the defaults")
        self.cfg = cfg
        self.dist = dist_info or DistInfo()
        if cfg.rl.prompts_per_step % self.dist.world_size:
            raise ConfigError(f"rl.prompts_per_step ({cfg.rl.prompts_per_step}) must be divisible by the "
                              f"number of processes ({self.dist.world_size})")
        local_trajs = cfg.rl.prompts_per_step // self.dist.world_size * cfg.rl.group_size
        if cfg.rl.mini_batches > local_trajs:
            raise ConfigError(f"rl.mini_batches ({cfg.rl.mini_batches}) exceeds the {local_trajs} trajectories "
                              "each process has per step")
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        _seed_everything(cfg.run.seed)
        self.policy, self.hf_tokenizer = load_policy(cfg)
        self.policy.to(self.dist.device)
        if cfg.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.policy.train()
        self.reference = None
        if cfg.rl.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.fsdp = cfg.run.distributed == "fsdp" and self.dist.enabled
        # rollouts: the policy itself, or under FSDP an unsharded copy refreshed after every step
        self.rollout_policy = copy.deepcopy(self.policy).eval().requires_grad_(False) if self.fsdp else self.policy
        # log-probabilities at the rollout temperature: of the distribution the tokens were sampled from
        chunk, temp = cfg.model.logprob_chunk_tokens, cfg.agent.temperature
        self.scorer = TokenLogProbs(self.policy, chunk, temperature=temp)
        self.ref_scorer = TokenLogProbs(self.reference, chunk, temperature=temp) if self.reference else None
        if self.fsdp:
            shard_fsdp(self.scorer)
            if self.ref_scorer is not None:
                shard_fsdp(self.ref_scorer)
            self.ddp = self.scorer
        else:
            self.ddp = wrap_ddp(self.scorer, self.dist)
        self.equal_forwards = all_reduce_max if self.fsdp else None
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.warmup_steps, cfg.run.total_steps, o.schedule)
        )
        self.out_dir = cfg.run.output_dir
        if cfg.run.rollout_engine == "vllm":
            self.backend = self._vllm_backend()
        else:
            self.backend = HFBackend(self.rollout_policy, self.hf_tokenizer, max_batch_size=cfg.agent.batch_size,
                                     seed=cfg.run.seed)
        self.pad_id = self.backend.pad_id
        self.templates = _templates(cfg.agent.templates)
        self.train_samples = train_samples if train_samples is not None else _train_data(cfg)
        self.val_samples = val_samples if val_samples is not None else _val_data(cfg)
        _check_gold(self.train_samples, cfg.data.train_path or "the training set")
        for m, vs in self.val_samples.items():
            _check_gold(vs, cfg.data.val_path or f"the x{m} validation set")
        self.reward_fn = reward_fn or _reward_fn(cfg.rl.reward)
        self.settings = LossSettings(
            cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.dual_clip, cfg.rl.kl_coef, cfg.rl.kl_type,
            cfg.rl.entropy_coef, cfg.rl.agg_mode, cfg.rl.horizon_tokens, cfg.rl.mask_final,
        )
        self.step = 0
        self.skipped_updates = 0
        self.ckpt_dir = os.path.join(self.out_dir, "checkpoints")
        if not cfg.run.resume and (glob.glob(os.path.join(self.ckpt_dir, "step_*.pt"))
                                   or os.path.exists(os.path.join(self.out_dir, "metrics.jsonl"))):
            raise ConfigError(f"run.output_dir {self.out_dir!r} already holds a training run (metrics.jsonl or "
                              "checkpoints); choose another run.output_dir to start over, or set run.resume=true to "
                              "continue it (nothing is deleted)")
        if cfg.run.resume:
            loaded = self.load_latest()
            if self.dist.is_main:  # rows after the checkpoint (all rows if none) are redone: drop them
                self._drop_metrics_after(self.step if loaded else -1)
        self._writer = None

    # ------------------------------------------------------------------------------------------ agent
    def agent(self, temperature: float, top_p: float, seed: int | None):
        """A :class:`MemoryAgent` on the current policy, built like ``memagent run`` builds its agent."""
        from memagent.agent.loop import AgentConfig, MemoryAgent

        a = self.cfg.agent
        conf = AgentConfig(chunk_tokens=a.chunk_tokens, memory_tokens=a.memory_tokens, final_tokens=a.final_tokens,
                           max_context_tokens=a.max_context_tokens, temperature=temperature, top_p=top_p,
                           seed=seed, batch_size=a.batch_size, strict=True)
        return MemoryAgent(self.backend, conf, self.templates)

    def step_samples(self, step: int) -> tuple[list, int]:
        """This process's questions for ``step`` and the global index of its first one.

        Questions are taken in data order (reshuffled per epoch when ``data.shuffle``); process ``r`` of
        ``W`` takes the ``r``-th contiguous block of ``prompts_per_step / W``.
        """
        n, per = len(self.train_samples), self.cfg.rl.prompts_per_step
        local = per // self.dist.world_size
        first = step * per + self.dist.rank * local
        out = []
        for g in range(first, first + local):
            epoch, pos = divmod(g, n)
            order = list(range(n))
            if self.cfg.data.shuffle:
                random.Random(f"{self.cfg.run.seed}/epoch{epoch}").shuffle(order)
            out.append(self.train_samples[order[pos]])
        return out, first

    # ------------------------------------------------------------------------------------------- step
    def train_step(self) -> dict[str, float]:
        """Run one training step and return its metrics (under torchrun: over all processes)."""
        cfg, step = self.cfg, self.step
        samples, first = self.step_samples(step)
        seed = zlib.crc32(f"{cfg.run.seed}/step{step}".encode()) & 0x7FFFFFFF
        agent = self.agent(cfg.agent.temperature, cfg.agent.top_p, seed)
        ro = collect_rollouts(agent, samples, cfg.rl.group_size, self.reward_fn)
        rows = list(ro.rows)
        rewards = torch.tensor(ro.rewards, dtype=torch.float32)
        groups = torch.tensor(ro.group_ids) + first
        traj_adv, adv_metrics = group_advantages(rewards, groups, cfg.rl.normalize_std, singleton=cfg.rl.singleton)
        row_traj = torch.tensor([r.traj_index for r in rows])
        check_rows(row_traj, torch.tensor([r.is_final for r in rows]), len(ro.rewards))
        row_adv = broadcast_advantages(traj_adv, row_traj)
        t_up = time.perf_counter()
        budget = cfg.optim.micro_batch_tokens
        single = cfg.rl.mini_batches == 1  # one update on fresh samples: old policy == current weights
        eq = self.equal_forwards
        old, ent = (None, None) if single else row_logprobs(self.scorer, rows, self.pad_id, budget, True, eq)
        ref = row_logprobs(self.ref_scorer, rows, self.pad_id, budget, False, eq)[0] if self.ref_scorer else None
        sums: dict[str, float] = {}
        norms = []
        for part in split_trajectories(row_traj.tolist(), cfg.rl.mini_batches):
            self.optimizer.zero_grad(set_to_none=True)
            m = mini_batch_backward(
                self.ddp, [rows[i] for i in part], row_adv[part], [old[i] for i in part] if old is not None else None,
                [ref[i] for i in part] if ref is not None else None, self.settings, self.pad_id, budget,
                all_reduce_sum if self.dist.enabled else None, self.dist.world_size, log_entropy=single,
                equal_forwards=eq,
            )
            if self.dist.enabled:
                m = _reduce_metrics(m)
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.optim.grad_clip)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
            norms.append(norm)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                self.skipped_updates += 1
                self.optimizer.zero_grad(set_to_none=True)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        self.sync_rollout_policy()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        update_s = time.perf_counter() - t_up
        return self._step_metrics(ro, rewards, groups, row_traj, ent, adv_metrics, sums, norms, lr, update_s)

    def _step_metrics(self, ro, rewards, groups, row_traj, ent, adv_metrics, sums, norms, lr, update_s):
        nb = max(1, self.cfg.rl.mini_batches)
        conv = torch.bincount(row_traj, minlength=len(ro.rewards)).float()
        group_best = torch.zeros(int(groups.max()) + 1).scatter_reduce_(0, groups, rewards, "amax", include_self=False)
        red = all_reduce_sum(torch.tensor([
            float(rewards.sum()), float((rewards >= 1).sum()), float(len(rewards)), float(conv.sum()),
            float(ro.response_tokens), float((group_best[torch.unique(groups)] >= 1).sum()),
            float(torch.unique(groups).numel()),
            sum(float(e.sum()) for e in ent) if ent is not None else 0.0, sum(len(e) for e in ent) if ent is not None else 0,
        ], dtype=torch.float64))
        if ent is not None:
            entropy = float(red[7] / max(1.0, float(red[8])))
        else:  # from the training forward (already summed over ranks): the same token mean, whatever rl.agg_mode
            entropy = sums.get("entropy/token_sum", 0.0) / max(1.0, sums.get("tokens", 0.0))
        conv_min, conv_max = -all_reduce_max(-int(conv.min())), all_reduce_max(int(conv.max()))
        m = {
            "step": self.step, "lr": lr,
            "reward/mean": float(red[0] / red[2]), "reward/accuracy": float(red[1] / red[2]),
            "reward/group_pass": float(red[5] / red[6]),
            "conv/per_traj_mean": float(red[3] / red[2]), "conv/per_traj_min": float(conv_min),
            "conv/per_traj_max": float(conv_max),
            "response_tokens/mean": float(red[4] / red[3]),
            "entropy/mean": entropy,
            "grad_norm": float(sum(norms) / len(norms)), "skipped_updates": self.skipped_updates,
            "time/rollout_s": ro.seconds, "time/update_s": update_s,
            "tokens/rollout_per_s": ro.response_tokens / max(ro.seconds, 1e-9),
            "tokens/update_per_s": sum(r.num_tokens for r in ro.rows) / max(update_s, 1e-9),
        }
        m.update({k: float(v) for k, v in adv_metrics.items()})
        for k in ("loss", "pg/loss", "kl/mean"):
            if k in sums:
                m[k] = sums[k] / nb
        for k in ("pg/clip_frac", "pg/dual_clip_frac", "pg/ratio_mean", "pg/approx_kl"):
            if k in sums:
                m[k] = sums[k] / nb
        return m

    # ------------------------------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Evaluate the current policy on the validation questions through the eval runner.

        Runs :class:`memagent.eval.runner.EvalRunner` with one memory-agent method (this trainer's agent settings,
        ``agent.val_temperature``/``val_top_p``, greedy by default) on the current policy's backend, one cell per
        length multiplier ``m`` (the questions, with their length in tokens, go to ``val/data/x{m}.jsonl``). Rows and
        memory traces go to ``val/step_{step:06d}/`` (readable by ``memagent report``; cells are keyed by the mean
        document length in tokens); a failed request is an error row that scores 0, and a validation cut short by
        a kill resumes with its finished rows.

        Returns:
            ``val/x{m}/reward`` (the configured reward, ``rl.reward``), ``val/x{m}/sub_em`` (on the extracted
            answer), ``val/x{m}/boxed`` (fraction of answers in a box) and ``val/x{m}/n_error`` per ``m``.
        """
        from memagent.data.io import write_samples
        from memagent.eval.grid import EvalConfig, MethodConfig, TaskConfig
        from memagent.eval.metrics import read_results
        from memagent.eval.runner import EvalRunner
        from memagent.tokenization import count_tokens

        mults = [m for m, samples in sorted(self.val_samples.items()) if samples]
        if not mults:
            return {}

        files, tokens = {}, {}  # cells are keyed by their mean document length in tokens (the report's x axis)
        tok = self.backend.tokenizer
        for m in mults:
            path = os.path.join(self.out_dir, "val", "data", f"x{m}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            samples = [dataclasses.replace(s, metadata={**s.metadata, "length_tokens": count_tokens(tok, s.context),
                                                        "tokenizer": tok.name, "length_multiplier": m})
                       for s in self.val_samples[m]]
            write_samples(path, samples)
            tokens[m] = round(sum(s.metadata["length_tokens"] for s in samples) / len(samples))
            files[tokens[m]] = path
        if len(set(tokens.values())) != len(tokens):
            raise ConfigError(f"validation multipliers {mults} give documents of the same mean length in tokens")
        a, reward = self.cfg.agent, self.cfg.rl.reward
        metrics = (reward,) if reward == "sub_em" else (reward, "sub_em")
        method = MethodConfig(name="policy", kind="memory_agent", chunk_tokens=a.chunk_tokens,
                              memory_tokens=a.memory_tokens, final_tokens=a.final_tokens,
                              max_context_tokens=a.max_context_tokens, batch_size=a.batch_size, templates=a.templates)
        task = TaskConfig(name="val", lengths=tuple(tokens[m] for m in mults), files=files, metrics=metrics,
                          samples=max(len(self.val_samples[m]) for m in mults))
        out = os.path.join(self.out_dir, "val", f"step_{self.step:06d}")
        ecfg = EvalConfig(methods=(method,), tasks=(task,), name=f"validation step {self.step}", output=out,
                          seed=self.cfg.run.seed, temperature=a.val_temperature, top_p=a.val_top_p,
                          backend={"name": "hf", "model": self.cfg.model.path, "step": self.step})
        try:
            rows = read_results(EvalRunner(ecfg, backend=self.backend, tokenizer=self.backend.tokenizer).run())
        except ConfigError as e:  # rows of an earlier start of this run, made with other settings
            raise ConfigError(f"validation at step {self.step}: {out} holds rows this run cannot continue ({e}). "
                              f"Delete {out} to validate again, or restore the earlier settings") from None
        res: dict[str, float] = {}
        for m in mults:
            rs = [r for r in rows if int(r["length"]) == tokens[m]]
            n = len(rs)
            res[f"val/x{m}/reward"] = sum(r["scores"][reward] for r in rs) / n
            res[f"val/x{m}/sub_em"] = sum(r["scores"]["sub_em"] for r in rs) / n
            res[f"val/x{m}/boxed"] = sum(r["extraction"] == "boxed" for r in rs) / n
            res[f"val/x{m}/n_error"] = float(sum(r["status"] == "error" for r in rs))
        return res

    # ------------------------------------------------------------------------------------ checkpoints
    def sync_rollout_policy(self) -> None:
        """Bring the rollout engine up to the policy's weights after they changed (an update or a resume).

        FSDP: gather the full weights (a collective: every rank calls this) into the unsharded rollout copy.
        vLLM rollouts: then copy the full weights into the engine. Otherwise rollouts run on the policy
        module itself and nothing is copied."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True))
            self.rollout_policy.load_state_dict(full)
        if self.cfg.run.rollout_engine == "vllm":
            with torch.no_grad():
                self.backend.load_weights((n, p.detach()) for n, p in self.rollout_policy.named_parameters())

    def close(self) -> None:
        """Release the rollout engine (a vLLM engine's memory and process groups). Call it after the last
        collective of the run: under torchrun vLLM's teardown also destroys the process groups it joined."""
        self.backend.close()

    def _vllm_backend(self):
        """An in-process vLLM engine started from the policy's current weights (written once to
        ``output_dir/rollout_init``, which vLLM loads; later weights are pushed in memory)."""
        from memagent.backends.vllm import VLLMBackend

        init = os.path.join(self.out_dir, "rollout_init")
        if self.dist.is_main:
            self.rollout_policy.save_pretrained(init)
            self.hf_tokenizer.save_pretrained(init)
        barrier()
        extra = {}
        if self.dist.enabled:  # one engine per process, inside the torchrun world vLLM finds already set up
            extra = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}
        return VLLMBackend(init, dtype=self.cfg.model.dtype, seed=self.cfg.run.seed + self.dist.rank,
                           gpu_memory_utilization=self.cfg.run.vllm_gpu_memory_utilization, weight_sync=True,
                           tokenizer=self.hf_tokenizer, **extra)

    def full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(model, optimizer)`` state dicts, unsharded, keyed by parameter name (the layout of
        ``torch.distributed.checkpoint.state_dict``, the same in one process, under DDP and under FSDP), on
        the CPU. A collective under FSDP: every rank calls it; only rank 0's dicts are filled."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if not self.fsdp:  # nothing sharded: read this process's own copy (no collectives)
            return ({k: v.detach().cpu() for k, v in self.policy.state_dict().items()},
                    _optimizer_by_name(self.optimizer.state_dict(), self.policy))
        return (get_model_state_dict(self.policy, options=opts),
                get_optimizer_state_dict(self.policy, self.optimizer, options=opts))

    def save_checkpoint(self) -> str | None:
        """Write model, optimizer, scheduler, RNG states and data position (main process only; under FSDP
        every rank takes part in gathering the full state first)."""
        path = os.path.join(self.ckpt_dir, f"step_{self.step:06d}.pt")
        model_sd, optim_sd = self.full_state()
        if self.dist.is_main:
            os.makedirs(self.ckpt_dir, exist_ok=True)
            state = {
                "step": self.step, "data_position": self.step * self.cfg.rl.prompts_per_step,
                "skipped_updates": self.skipped_updates,
                "model": model_sd, "optimizer": optim_sd,
                "scheduler": self.scheduler.state_dict(), "rng": _rng_state(),
                "config": config_to_dict(self.cfg), "templates_hash": self.templates.hash,
            }
            tmp = path + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, path)
            for old in sorted(glob.glob(os.path.join(self.ckpt_dir, "step_*.pt")))[: -self.cfg.run.keep_checkpoints]:
                os.remove(old)
        barrier()
        return path

    def load_latest(self) -> bool:
        """Resume from the newest checkpoint in ``output_dir`` if any; returns whether one was loaded.

        Raises:
            ConfigError: the checkpoint was made with other settings than ``cfg`` in keys that change what is
                trained (anything but the run length, logging, checkpoint cadence and memory/speed knobs listed
                in :data:`RESUMABLE_CHANGES`): a resumed run would otherwise mix two configurations.
        """
        found = sorted(glob.glob(os.path.join(self.ckpt_dir, "step_*.pt")))
        if not found:
            return False
        state = torch.load(found[-1], map_location="cpu", weights_only=False)
        changed = config_changes(with_defaults(state.get("config", {})), config_to_dict(self.cfg))
        if state.get("templates_hash", self.templates.hash) != self.templates.hash:  # the file's text, not its path
            changed.append(("prompt templates (agent.templates' text)", state["templates_hash"], self.templates.hash))
        old_total = state.get("config", {}).get("run", {}).get("total_steps", self.cfg.run.total_steps)
        if self.cfg.optim.schedule == "cosine" and old_total != self.cfg.run.total_steps:
            changed.append(("run.total_steps (the cosine schedule decays to 0 at it)", old_total, self.cfg.run.total_steps))
        if changed:
            listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
            raise ConfigError(f"{found[-1]} was saved with other settings ({listing}); resume with the checkpoint's "
                              "settings, or choose another run.output_dir to start a new run")
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        optim_sd = _optimizer_by_name(state["optimizer"], self.policy)  # checkpoints before 0.2: by index
        if self.fsdp:
            set_model_state_dict(self.policy, state["model"], options=opts)
            set_optimizer_state_dict(self.policy, self.optimizer, optim_sd, options=opts)
        else:
            self.policy.load_state_dict(state["model"])
            self.optimizer.load_state_dict(_optimizer_by_index(optim_sd, self.policy))
        self.sync_rollout_policy()
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.skipped_updates = int(state.get("skipped_updates", 0))
        return True

    def _drop_metrics_after(self, step: int) -> None:
        """On resume, cut ``metrics.jsonl`` rows of steps after the checkpoint (they are about to be redone)."""
        path = os.path.join(self.out_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        keep = []
        for line in lines:
            try:
                if int(json.loads(line).get("step", 0)) <= step:
                    keep.append(line)
            except (json.JSONDecodeError, AttributeError):  # a line torn by the kill
                continue
        if len(keep) != len(lines):
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(x + "\n" for x in keep))
            os.replace(tmp, path)

    # ------------------------------------------------------------------------------------------- loop
    def log(self, metrics: dict[str, Any]) -> None:
        """Append one JSON line to ``metrics.jsonl`` and write TensorBoard scalars (main process)."""
        if not self.dist.is_main:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.cfg.run.tensorboard:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard hides events of steps redone after a resume
                self._writer = SummaryWriter(os.path.join(self.out_dir, "tb"), purge_step=self.step or None)
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._writer.add_scalar(k, v, int(metrics.get("step", self.step)))
            self._writer.flush()

    def fit(self) -> dict[str, float]:
        """Train to ``run.total_steps`` (from the resumed step), validating and checkpointing on schedule.

        Returns:
            the last step's metrics.
        """
        r = self.cfg.run
        if self.dist.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config_to_dict(self.cfg), f, indent=1)
        if self.step == 0 and r.val_before_train and r.val_every and self.dist.is_main:
            before = self.validate()
            if before:
                self.log({"step": 0, **before})
        barrier()
        last: dict[str, float] = {}
        while self.step < r.total_steps:
            last = self.train_step()
            if r.val_every and self.step % r.val_every == 0:
                if self.dist.is_main:
                    last.update(self.validate())
                barrier()  # other ranks wait here, not inside the next step's collectives
            self.log(last)
            if (r.save_every and self.step % r.save_every == 0) or self.step == r.total_steps or self.step == r.stop_after_step:
                self.save_checkpoint()
            if r.stop_after_step is not None and self.step >= r.stop_after_step:
                break
        if self.step >= r.total_steps and self.dist.is_main:
            self.rollout_policy.save_pretrained(os.path.join(self.out_dir, "policy"))  # full weights, also under FSDP
            self.hf_tokenizer.save_pretrained(os.path.join(self.out_dir, "policy"))
        if self._writer is not None:
            self._writer.close()
        return last


#: Settings a resumed run may change: run length, logging, checkpoint cadence, the folder (a moved run) and
#: knobs that only trade memory for speed. Anything else changes what is trained and must match the checkpoint.
RESUMABLE_CHANGES = frozenset({
    "run.total_steps", "run.stop_after_step", "run.save_every", "run.val_every", "run.val_before_train",
    "run.keep_checkpoints", "run.tensorboard", "run.torch_threads", "run.resume", "run.output_dir", "run.distributed",
    "run.dist_timeout_s", "run.rollout_engine", "run.vllm_gpu_memory_utilization",
    "model.logprob_chunk_tokens", "model.gradient_checkpointing", "optim.micro_batch_tokens",
})


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, old, new)`` for every setting that differs, except :data:`RESUMABLE_CHANGES`."""
    out = []
    for k in sorted(set(old) | set(new)):
        key = prefix + k
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_changes(a, b, key + "."))
        elif a != b and key not in RESUMABLE_CHANGES:
            out.append((key, a, b))
    return out


def _optimizer_by_name(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index (``optimizer.state_dict()`` of an optimizer built on
    ``model.parameters()``) re-keyed by parameter name (``named_parameters`` order, the same order); one
    keyed by name already is returned as is."""
    names = [n for n, _ in model.named_parameters()]
    groups = state.get("param_groups", [])
    if not groups or not groups[0]["params"] or isinstance(groups[0]["params"][0], str):
        return state
    return {"state": {names[i]: v for i, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}


def _optimizer_by_index(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Inverse of :func:`_optimizer_by_name`: the layout ``torch.optim.Optimizer.load_state_dict`` takes."""
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    return {"state": {index[k]: v for k, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def _seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _templates(path: str | None):
    from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates

    return PromptTemplates.from_file(path) if path else DEFAULT_TEMPLATES


def _reward_fn(name: str):
    """``strict_boxed`` (the training reward), the reference's variant, or ``sub_em`` on the extracted answer: a
    lenient reward for models that rarely write ``\\boxed{}`` (SmolLM2), so a small CPU run has any signal."""
    from memagent import verifiers
    from memagent.answers import extract_answer

    def sub_em_reward(response: str, answers) -> float:
        return verifiers.sub_em(extract_answer(response).answer, list(answers))

    return {"strict_boxed": verifiers.strict_boxed_reward,
            "strict_boxed_reference": verifiers.strict_boxed_reward_reference,
            "sub_em": sub_em_reward}[name]


#: Metrics of :func:`mini_batch_backward` that are means over this process's response tokens.
_TOKEN_MEANS = ("pg/clip_frac", "pg/dual_clip_frac", "pg/ratio_mean", "pg/approx_kl")


def _reduce_metrics(m: dict[str, float]) -> dict[str, float]:
    """One mini-batch's metrics over all processes: loss terms and token sums are summed (each process's
    loss is its share of the global loss: the aggregation weights use the global unit counts), token means are
    re-weighted by each process's token count. Every process calls this (a collective)."""
    keys = sorted(m)
    tokens = m.get("tokens", 0.0)
    red = all_reduce_sum(torch.tensor([m[k] * tokens if k in _TOKEN_MEANS else m[k] for k in keys], dtype=torch.float64))
    total = max(float(red[keys.index("tokens")]), 1.0) if "tokens" in keys else 1.0
    return {k: float(v) / total if k in _TOKEN_MEANS else float(v) for k, v in zip(keys, red.tolist())}


def _check_gold(samples, where: str) -> None:
    """Refuse, before any step, samples without gold answers: their reward cannot be computed.

    Raises:
        DataError: naming the file and the first ids.
    """
    missing = [s.id for s in samples if not s.answers]
    if missing:
        from memagent.errors import DataError

        raise DataError(f"{len(missing)} of {len(samples)} samples in {where} have no gold answers (ids "
                        f"{', '.join(map(repr, missing[:5]))}{', ...' if len(missing) > 5 else ''}); the reward needs "
                        "them: add answers or drop those samples")


def _resolve(path: str) -> str:
    if os.path.exists(path):
        return path
    from memagent.data.paths import data_file

    return os.fspath(data_file(path))


def _train_data(cfg: TrainConfig) -> list:
    d = cfg.data
    if d.train_path:
        from memagent.data.io import read_samples

        samples = read_samples(_resolve(d.train_path))
        if not samples:
            from memagent.errors import DataError

            raise DataError(f"data.train_path {d.train_path} holds no samples")
        return samples
    from memagent.train.synthetic import needle_samples

    return needle_samples(d.synthetic_train_size, d.synthetic_context_words, cfg.run.seed, "train")


def _val_data(cfg: TrainConfig) -> dict[int, list]:
    d = cfg.data
    if d.val_path:
        from memagent.data.io import read_samples

        samples = read_samples(_resolve(d.val_path), limit=d.val_size)
        if not samples:
            from memagent.errors import DataError

            raise DataError(f"data.val_path {d.val_path} holds no samples")
        return {1: samples}
    if d.synthetic is None:
        return {}
    if d.train_path:
        import warnings

        warnings.warn(f"training on {d.train_path} but validating on synthetic {d.synthetic} questions; set "
                      "data.val_path to validate on your own data (or data.synthetic=null for none)", stacklevel=2)
    from memagent.train.synthetic import needle_samples

    n = min(d.synthetic_val_size, d.val_size)
    return {m: needle_samples(n, d.synthetic_context_words * m, cfg.run.seed + 1, f"val{m}x")
            for m in d.val_context_multipliers}
