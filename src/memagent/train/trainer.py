"""The training loop: rollout -> reward -> advantage -> loss -> optimizer step, with checkpoints.

One training step (:meth:`Trainer.train_step`): take ``prompts_per_step`` questions (in data order), sample
``group_size`` MemAgent trajectories for each with the current policy (:mod:`memagent.train.rollout`), score
the final answers with the configured verifier (:func:`memagent.scoring.score`), compute group advantages per
trajectory and broadcast them to every conversation (:mod:`memagent.rl`), compute old-policy and reference
log-probabilities of every row, then make ``mini_batches`` optimizer steps over whole-trajectory mini-batches
(gradient accumulation over micro-batches, :mod:`memagent.train.update`). The learning-rate schedule advances
once per training step.

The parts that vary live in their own modules: the policy, its optimizer and schedule
(:mod:`memagent.train.policy`), the rollout engine and its weight sync (:mod:`memagent.train.engine`),
checkpoints and resume (:mod:`memagent.train.checkpoint`), data (:mod:`memagent.train.data`), validation
(:mod:`memagent.train.validation`) and the step's metrics (:mod:`memagent.train.metrics`).

The update's levers are settings: ``model.lora`` (peft adapters; the reference model is the policy with its
adapter disabled, computed inside the update's micro-batch loop; :mod:`memagent.train.lora`),
``model.compute_dtype`` (bf16 autocast over float32 master weights; :mod:`memagent.train.precision`) and
``rl.shared_prefix`` (prompt prefixes shared by rows computed once per group; :mod:`memagent.train.prefix`).

Source: reference-memagent.md §4.1 (hyperparameters), §4.7 (step), §4.8 (update), §4.10 (objective).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

from memagent.errors import ConfigError
from memagent.rl.advantages import group_advantages
from memagent.rl.multiconv import broadcast_advantages, check_rows
from memagent.runfiles import FolderLock, append_rows, first_missing, keep_lines, remove_created, write_json
from memagent.train import data
from memagent.train.batching import TokenLogProbs, row_logprobs, split_trajectories
from memagent.train.checkpoint import (POLICY_STEP_FILE, SCRATCH_ENTRIES, Checkpointer, check_output_dir, optimizer_by_index,  # noqa: F401
                                      optimizer_by_name, policy_step)
from memagent.train.config import TrainConfig, config_to_dict
from memagent.train.distributed import DistInfo, all_reduce_max, all_reduce_sum, barrier, shard_fsdp, wrap_ddp
from memagent.train.engine import make_engine
from memagent.train.metrics import reduce_mini_batch, step_metrics
from memagent.train.policy import (apply_optim_settings, load_policy, lr_lambda, make_optimizer,  # noqa: F401 - re-exported
                                  seed_everything)
from memagent.train.precision import resolve_compute_dtype
from memagent.train.rollout import collect_rollouts
from memagent.train.update import mini_batch_backward, mini_batch_units


#: How a budget error names the settings to change in a training config (:meth:`MemoryAgent.check_budget`).
TRAIN_SETTING_NAMES = {"chunk_tokens": "agent.chunk_tokens", "memory_tokens": "agent.memory_tokens",
                       "final_tokens": "agent.final_tokens",
                       "window": "model.path"}


class Trainer:
    """Multi-conversation GRPO trainer (see module docstring).

    Args:
        cfg: the training configuration.
        dist_info: process placement (default: single process).
        train_samples, val_samples: override the configured data (tests); ``val_samples`` maps a length
            multiplier to its questions.
        reward_fn: override the configured reward ``(response, answers) -> float`` (tests).

    Attributes:
        policy: the policy module the optimizer steps; with ``model.lora.enabled`` the live ``peft.PeftModel``
            (its adapter is what trains; a rollout engine built with it reads the adapter from it).

    Raises:
        ConfigError: inconsistent settings (e.g. prompts per step not divisible by the world size).
    """

    def __init__(self, cfg: TrainConfig, dist_info: DistInfo | None = None, train_samples=None, val_samples=None,
                 reward_fn=None):
        self.cfg, self.dist = cfg, dist_info or DistInfo()
        self._check_sizes()
        check_output_dir(cfg.run.output_dir)
        self.out_dir = cfg.run.output_dir
        self._created = first_missing(self.out_dir)  # what this run adds on the way to its folder (None: it exists)
        self._scratch_before = {n for n in SCRATCH_ENTRIES if os.path.exists(os.path.join(self.out_dir, n))}
        # one trainer per folder: a second (a double launch, a requeued job) would interleave metrics and checkpoints
        self._lock = FolderLock(self.out_dir, ".train.lock",
                                f"run.output_dir {self.out_dir!r} is locked: another memagent train is writing to it; "
                                "wait for it to finish, or give another run.output_dir")
        if self.dist.is_main:
            self._lock.acquire()
        try:
            self._build(cfg, train_samples, val_samples, reward_fn)
        except BaseException:
            self._abandon()
            raise

    def _build(self, cfg: TrainConfig, train_samples, val_samples, reward_fn) -> None:
        from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates
        from memagent.scoring import score

        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        seed_everything(cfg.run.seed)
        self.policy, self.hf_tokenizer = load_policy(cfg)
        self.policy.to(self.dist.device)
        if cfg.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.policy.train()
        self.reference, self.reference_context = self._make_reference()
        self.fsdp = cfg.run.distributed == "fsdp" and self.dist.enabled
        self.engine = make_engine(cfg, self.dist, self.policy, self.hf_tokenizer, self.fsdp)
        self._wrap_scorers()
        self.optimizer, self.scheduler = make_optimizer(self.policy, cfg)
        self.pad_id = self.backend.pad_id
        self.templates = PromptTemplates.from_file(cfg.agent.rollout.templates) if cfg.agent.rollout.templates \
            else DEFAULT_TEMPLATES
        self.train_samples = train_samples if train_samples is not None else data.train_data(cfg)
        self.val_samples = val_samples if val_samples is not None else data.val_data(cfg)
        data.check_gold(self.train_samples, cfg.data.train_path or "the training set")
        if cfg.rl.prompts_per_step > len(self.train_samples):
            raise ConfigError(f"rl.prompts_per_step={cfg.rl.prompts_per_step} exceeds the {len(self.train_samples)} "
                              f"training questions ({cfg.data.train_path or 'data.synthetic_train_size'}): a step "
                              "would take some questions twice, as groups of the same ids and seeds; lower "
                              "rl.prompts_per_step (or rl.group_size gives more rollouts per question)")
        for m, vs in self.val_samples.items():
            data.check_gold(vs, cfg.data.val_path or f"the x{m} validation set")
        #: setting -> sha256 of the questions it gave (checked on resume: content, not path)
        self.data_sha256 = {"data.train_path": data.samples_sha256(self.train_samples)}
        if cfg.data.val_path and self.val_samples:
            self.data_sha256["data.val_path"] = data.samples_sha256([s for m in sorted(self.val_samples)
                                                                     for s in self.val_samples[m]])
        self.reward_fn = reward_fn or (lambda response, answers: score(cfg.rl.reward, response, answers))
        self.step, self.skipped_updates = 0, 0
        self.data_position = 0  # global index of the next step's first question (see step_samples)
        self.checkpoints = Checkpointer(cfg, self.dist, self.fsdp)
        self.ckpt_dir = self.checkpoints.dir
        self._start_or_resume()
        self._writer = None

    def _check_sizes(self) -> None:
        rl, world = self.cfg.rl, self.dist.world_size
        if rl.prompts_per_step % world:
            raise ConfigError(f"rl.prompts_per_step ({rl.prompts_per_step}) must be divisible by the "
                              f"number of processes ({world})")
        local_trajs = rl.prompts_per_step // world * rl.group_size
        if rl.mini_batches > local_trajs:
            raise ConfigError(f"rl.mini_batches ({rl.mini_batches}) exceeds the {local_trajs} trajectories "
                              "each process has per step")
        if self.cfg.run.distributed == "fsdp" and self.dist.enabled and (self.cfg.model.lora.enabled or rl.shared_prefix):
            raise ConfigError("model.lora and rl.shared_prefix are not supported with run.distributed=fsdp (FSDP ranks "
                              "must run the same per-layer passes; LoRA's adapters are small): use run.distributed=ddp")
        if rl.drop_uniform_groups and self.dist.enabled:
            raise ConfigError("rl.drop_uniform_groups runs in one process only (a process could be left without "
                              "rows, and its collectives would not pair up): set it to false under torchrun")

    def _make_reference(self):
        """``(reference module, reference context)``: with LoRA the reference model is the policy with its adapter
        disabled (a context, no copy; its log-probabilities come in the update's own micro-batch loop), with full
        fine-tuning a frozen copy of the initial policy; neither without a KL term."""
        if self.cfg.rl.loss.kl_coef == 0:
            return None, None
        if self.cfg.model.lora.enabled:
            from memagent.train.lora import adapter_disabled

            return None, lambda: adapter_disabled(self.policy)
        return copy.deepcopy(self.policy).eval().requires_grad_(False), None

    def _wrap_scorers(self) -> None:
        """Log-probabilities at the rollout temperature (of the distribution the tokens were sampled from), in
        ``model.compute_dtype``; sharded under FSDP, wrapped in DDP otherwise."""
        chunk, temp = self.cfg.model.logprob_chunk_tokens, self.cfg.agent.rollout.temperature
        dtype = resolve_compute_dtype(self.cfg.model.compute_dtype, torch.device(self.dist.device).type)
        self.scorer = TokenLogProbs(self.policy, chunk, temperature=temp, compute_dtype=dtype)
        self.ref_scorer = TokenLogProbs(self.reference, chunk, temperature=temp, compute_dtype=dtype) if self.reference else None
        if self.fsdp:
            shard_fsdp(self.scorer)
            if self.ref_scorer is not None:
                shard_fsdp(self.ref_scorer)
            self.ddp = self.scorer
        else:
            self.ddp = wrap_ddp(self.scorer, self.dist)
        self.equal_forwards = all_reduce_max if self.fsdp else None

    def _start_or_resume(self) -> None:
        cfg = self.cfg
        if not cfg.run.resume and (self.checkpoints.found() or os.path.exists(os.path.join(self.out_dir, "metrics.jsonl"))):
            raise ConfigError(f"run.output_dir {self.out_dir!r} already holds a training run (metrics.jsonl or "
                              "checkpoints); choose another run.output_dir to start over, or set run.resume=true to "
                              "continue it (nothing is deleted)")
        if cfg.run.resume:
            loaded = self.load_latest()
            if self.dist.is_main:  # rows after the checkpoint (all rows if none) are redone: drop them
                self._drop_metrics_after(self.step if loaded else -1)

    # ------------------------------------------------------------------------------------- engine
    @property
    def backend(self):
        """The rollout backend (:attr:`engine`'s)."""
        return self.engine.backend

    @property
    def rollout_policy(self):
        """The module rollouts run on (the policy, or its unsharded copy under FSDP)."""
        return self.engine.rollout_policy

    def sync_rollout_policy(self) -> None:
        """Bring the rollout engine up to the policy's weights (a collective under FSDP)."""
        self.engine.sync()

    def close(self) -> None:
        """Release the rollout engine (a vLLM engine's memory and process groups). Call it after the last
        collective of the run: under torchrun vLLM's teardown also destroys the process groups it joined. The
        run folder's lock goes too."""
        self._lock.release()
        self.engine.close()

    def agent(self, temperature: float, top_p: float, seed: int | None):
        """A :class:`MemoryAgent` on the current policy, built like ``memagent run`` builds its agent."""
        import dataclasses

        from memagent.agent.loop import MemoryAgent

        conf = dataclasses.replace(self.cfg.agent.rollout, temperature=temperature, top_p=top_p, seed=seed, strict=True)
        agent = MemoryAgent(self.backend, conf, self.templates)
        agent.setting_names = TRAIN_SETTING_NAMES
        return agent

    def step_samples(self) -> tuple[list, int]:
        """This process's questions for the next step and the global index of its first one (see
        :func:`memagent.train.data.step_samples`), from ``data_position``: ``step x prompts_per_step`` in a run
        that never changed ``rl.prompts_per_step``, the checkpoint's position carried on in one that did."""
        return data.step_samples(self.train_samples, self.cfg, self.data_position, self.dist.rank, self.dist.world_size)

    # ------------------------------------------------------------------------------------------- step
    def train_step(self) -> dict[str, float]:
        """Run one training step and return its metrics (under torchrun: over all processes)."""
        cfg, rl = self.cfg, self.cfg.rl
        # rollout: G trajectories per question on the current policy, each scored by the reward
        samples, first = self.step_samples()
        seed = zlib.crc32(f"{cfg.run.seed}/step{self.step}".encode()) & 0x7FFFFFFF
        ro = collect_rollouts(self.agent(cfg.agent.rollout.temperature, cfg.agent.rollout.top_p, seed), samples,
                              rl.group_size, self.reward_fn)
        rows = list(ro.rows)
        # advantage: per trajectory within its group, broadcast to every conversation of the trajectory
        rewards = torch.tensor(ro.rewards, dtype=torch.float32)
        groups = torch.tensor(ro.group_ids) + first
        traj_adv, adv_metrics = group_advantages(rewards, groups, rl.normalize_std, singleton=rl.singleton)
        row_traj = torch.tensor([r.traj_index for r in rows])
        check_rows(row_traj, torch.tensor([r.is_final for r in rows]), len(ro.rewards))
        row_adv = broadcast_advantages(traj_adv, row_traj)
        # loss and step: old-policy and reference log-probs, then one optimizer step per mini-batch
        t_up = time.perf_counter()
        old, ent, ref = self._reference_logprobs(rows)
        sums: dict[str, float] = {}
        norms = []
        kept = 0
        for part in split_trajectories(row_traj.tolist(), rl.mini_batches):
            units = None
            if rl.drop_uniform_groups:  # zero-advantage rows add nothing to the policy gradient: leave them out
                units = mini_batch_units([rows[i] for i in part], rl.loss, self.pad_id)
                part = [i for i in part if float(traj_adv[row_traj[i]]) != 0.0]
            kept += len(part)
            if not part:
                continue
            m = self._update(rows, part, row_adv, old, ref, units)
            norms.append(self._optimizer_step())
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        sums["update/rows_kept_frac"] = kept / max(1, len(rows))
        self.sync_rollout_policy()
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # a step without an optimizer step (every group uniform) still advances
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.step += 1
        self.data_position += rl.prompts_per_step
        return step_metrics(self.step, ro, rewards, groups, row_traj, ent, adv_metrics, sums, norms, lr,
                            time.perf_counter() - t_up, rl.mini_batches, self.skipped_updates)

    @property
    def min_shared_tokens(self) -> int | None:
        """The shortest prompt prefix the update shares (``rl.shared_prefix``), or ``None``: no sharing."""
        return self.cfg.rl.shared_prefix_min_tokens if self.cfg.rl.shared_prefix else None

    def _reference_logprobs(self, rows):
        """``(old, entropies, reference)`` log-probabilities of every row's response tokens. With one mini-batch
        the update is the only one on fresh samples: the old policy is the current weights (``old=None``, fused
        into the training forward). With LoRA the reference comes inside the update's micro-batch loop
        (``reference=None`` here)."""
        budget, eq, share = self.cfg.optim.micro_batch_tokens, self.equal_forwards, self.min_shared_tokens
        single = self.cfg.rl.mini_batches == 1
        old, ent = (None, None) if single else row_logprobs(self.scorer, rows, self.pad_id, budget, True, eq, share)
        ref = row_logprobs(self.ref_scorer, rows, self.pad_id, budget, False, eq, share)[0] if self.ref_scorer else None
        return old, ent, ref

    def _update(self, rows, part, row_adv, old, ref, units=None) -> dict[str, float]:
        """The gradient of one mini-batch (the rows of whole trajectories ``part``), its metrics over ranks;
        ``units``: the loss denominator when ``part`` is what is left of a larger mini-batch."""
        self.optimizer.zero_grad(set_to_none=True)
        m = mini_batch_backward(
            self.ddp, [rows[i] for i in part], row_adv[part], [old[i] for i in part] if old is not None else None,
            [ref[i] for i in part] if ref is not None else None, self.cfg.rl.loss, self.pad_id,
            self.cfg.optim.micro_batch_tokens, all_reduce_sum if self.dist.enabled else None, self.dist.world_size,
            log_entropy=self.cfg.rl.mini_batches == 1, equal_forwards=self.equal_forwards,
            min_shared_tokens=self.min_shared_tokens, reference=self.reference_context, total_units=units,
        )
        return reduce_mini_batch(m) if self.dist.enabled else m

    def _optimizer_step(self) -> float:
        """Clip the gradient and step (skipped, and counted, when its norm is not finite); returns the norm."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            self.skipped_updates += 1
            self.optimizer.zero_grad(set_to_none=True)
        return norm

    def validate(self) -> dict[str, float]:
        """Evaluate the current policy on the validation questions (:func:`memagent.train.validation.validate`)."""
        from memagent.train.validation import validate

        return validate(self.cfg, self.backend, self.val_samples, self.step)

    # ------------------------------------------------------------------------------------ checkpoints
    def full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(model, optimizer)`` state dicts, unsharded, keyed by parameter name, on the CPU (a collective under
        FSDP: every rank calls it)."""
        return (self.checkpoints.model_state(self.policy), self.checkpoints.optimizer_state(self.policy, self.optimizer))

    def save_checkpoint(self) -> str:
        """Write model, optimizer, scheduler, RNG states and data position (see :class:`Checkpointer`)."""
        model_sd, optim_sd = self.full_state()
        path = self.checkpoints.save({
            "step": self.step, "data_position": self.data_position,
            "skipped_updates": self.skipped_updates, "model": model_sd, "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(), "templates_hash": self.templates.hash,
            "data_sha256": self.data_sha256,
        })
        if self.cfg.model.lora.enabled and self.dist.is_main:  # small: the newest adapter is always exportable
            self.save_model_dir()
        return path

    def save_model_dir(self) -> str:
        """Write the trained policy where ``memagent export`` reads it (main process), and ``config.json`` (the
        resolved training config) next to it. LoRA: ``output_dir/adapter/`` (peft ``save_pretrained``: the adapter
        and its config, plus the tokenizer), replaced whole so a kill never leaves half of one; full fine-tuning:
        ``output_dir/policy/`` (a transformers model directory), replaced whole too. Either records its step in
        :data:`POLICY_STEP_FILE`. Returns the directory."""
        write_json(os.path.join(self.out_dir, "config.json"), config_to_dict(self.cfg), indent=1)
        lora = self.cfg.model.lora.enabled
        path = os.path.join(self.out_dir, "adapter" if lora else "policy")
        tmp, old = path + ".tmp", path + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        if lora:
            with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for users to do
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                self.policy.save_pretrained(tmp)
            self.hf_tokenizer.save_pretrained(tmp)
        else:
            self.engine.save_policy(tmp)  # full weights, also under FSDP
        write_json(os.path.join(tmp, POLICY_STEP_FILE), {"step": self.step})  # which step it is (memagent export)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        return path

    def load_latest(self) -> bool:
        """Resume from the newest checkpoint in ``output_dir`` if any; returns whether one was loaded.

        Raises:
            ConfigError: the checkpoint was made with other settings (see :meth:`Checkpointer.load`).
        """
        state = self.checkpoints.load(self.templates.hash, self.data_sha256)
        if state is None:
            return False
        self.checkpoints.load_model_state(self.policy, state["model"])
        self.checkpoints.load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.sync_rollout_policy()
        self.scheduler.load_state_dict(state["scheduler"])
        apply_optim_settings(self.optimizer, self.scheduler, self.cfg)  # a branch's optim.* changes take effect
        self.step = int(state["step"])
        self.data_position = int(state.get("data_position", self.step * self.cfg.rl.prompts_per_step))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        return True

    def _drop_metrics_after(self, step: int) -> None:
        """On resume, cut ``metrics.jsonl`` rows of steps after the checkpoint (they are about to be redone)."""
        keep_lines(os.path.join(self.out_dir, "metrics.jsonl"),
                   lambda row: isinstance(row, dict) and int(row.get("step", 0)) <= step)

    # ------------------------------------------------------------------------------------------- loop
    def log(self, metrics: dict[str, Any]) -> None:
        """Append one JSON line to ``metrics.jsonl`` and write TensorBoard scalars (main process)."""
        if not self.dist.is_main:
            return
        # a non-finite number (a skipped update's grad norm) as null: bare NaN is not JSON, and other readers refuse it
        metrics = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        append_rows(os.path.join(self.out_dir, "metrics.jsonl"), [metrics])
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
        start = self.step
        config_path = os.path.join(self.out_dir, "config.json")
        untrained = self.dist.is_main and not self._trained_anything()
        before = Path(config_path).read_bytes() if untrained and os.path.isfile(config_path) else None
        if self.dist.is_main:
            write_json(config_path, config_to_dict(self.cfg), indent=1)
        try:
            return self._fit(start)
        except BaseException:
            # refused or stopped before anything else was written (a first batch that does not fit, Ctrl-C during
            # the first rollout): leave the folder as it was (its earlier config.json, or none; a folder this run
            # made is removed when empty), not a config.json that marks it as this run
            if untrained and not self._trained_anything():
                if before is None:
                    os.remove(config_path)
                    self._abandon()
                else:
                    Path(config_path).write_bytes(before)
            raise
        finally:
            self._lock.release()

    def _abandon(self) -> None:
        """A trainer refused or stopped before it trained anything: let the folder's lock go and leave the folder
        as it was (the rollout engine's scratch this trainer wrote removed; a folder it created removed when
        empty), so that the corrected command starts there rather than meeting "holds files but no run"."""
        self._lock.release()
        if not self.dist.is_main:
            return
        for name in SCRATCH_ENTRIES:  # what this attempt wrote, whether or not the folder holds a run
            if name not in self._scratch_before:
                shutil.rmtree(os.path.join(self.out_dir, name), ignore_errors=True)
        if self._trained_anything():
            return
        if self._created is not None:
            with contextlib.suppress(OSError):
                self._lock.path.unlink()
        remove_created(self.out_dir, self._created)

    def _trained_anything(self) -> bool:
        """Whether the output folder holds metrics or checkpoints (rollout scratch folders do not count)."""
        return any(os.path.exists(os.path.join(self.out_dir, name)) for name in ("metrics.jsonl", "checkpoints"))

    def _fit(self, start: int) -> dict[str, float]:
        r = self.cfg.run
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
            # a resume already past run.stop_after_step stops after its first step: that step is checkpointed too
            # (else it was logged, thrown away and redone by every rerun of the same command)
            stop = r.stop_after_step is not None and self.step >= r.stop_after_step
            if (r.save_every and self.step % r.save_every == 0) or self.step == r.total_steps or stop:
                self.save_checkpoint()
            if stop:
                break
        model_dir = os.path.join(self.out_dir, "adapter" if self.cfg.model.lora.enabled else "policy")
        if self.step >= r.total_steps and self.dist.is_main and (self.step > start or policy_step(model_dir) != self.step):
            self.save_model_dir()  # a rerun of a finished run trained nothing: its policy folder is already there
        if self._writer is not None:
            self._writer.close()
        return last
