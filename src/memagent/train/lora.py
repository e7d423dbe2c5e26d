"""LoRA training of the policy (peft): settings, adapter injection, the reference model as the base weights,
and adapter-only checkpoints.

With LoRA the base weights stay frozen and only low-rank adapters ``B @ A`` (rank ``r``, scaled by
``alpha / r``) on the target modules are trained (Hu et al. 2021, "LoRA"). Three consequences for GRPO:

- The reference model of the KL term is the initial policy, i.e. the base weights: the same module with the
  adapter switched off (peft's ``disable_adapter()``), so no second copy of the model is kept in memory
  (:func:`reference_logprobs`, :func:`adapter_disabled`).
- A checkpoint holds the trainable parameters and their optimizer state only (:func:`lora_checkpoint_state`),
  a few MB for a 135M model, plus a fingerprint of the frozen base so a resume on other base weights is
  refused. The base is rebuilt from ``model.path`` on resume.
- The frozen base may be stored in bfloat16 while the adapter and its AdamW state stay float32 (peft keeps
  adapters of a bfloat16 base in float32): small AdamW updates then land in float32 weights and are not
  rounded away, unlike a bfloat16 full fine-tuning run.

LoRA usually wants a larger learning rate than full fine-tuning (1e-5 to 2e-4 rather than 1e-6).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memagent.errors import ConfigError

#: Every linear projection of a Llama/Qwen-style decoder layer.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyperparameters (embedded in the model config as ``model.lora``).

    Attributes:
        enabled: train LoRA adapters instead of all weights (default: full fine-tuning).
        rank: adapter rank ``r``.
        alpha: scaling numerator; the adapter's output is multiplied by ``alpha / rank``.
        dropout: dropout on the adapter's input (training forward only; the reference pass has none).
        target_modules: names of the modules that get an adapter (the last component of the module path,
            e.g. ``q_proj``); each must exist in the model.
        init_from: a warm start: a training checkpoint (``checkpoints/step_*.pt`` of an earlier LoRA run on the
            same base, rank and target modules), a LoRA adapter GGUF or a packaged policy's name (e.g.
            ``ruler-niah``), whose adapter this run starts from instead of peft's fresh
            initialisation (:func:`load_init_adapter`). Only the adapter is taken: the optimizer, schedule,
            step count and data order start anew, and the reference model stays the base (the KL term is to the
            untrained model, not to the warm start). A resumed run loads its own checkpoint over it.

    Raises:
        ConfigError: ``rank < 1``, ``alpha <= 0``, dropout outside ``[0, 1)`` or no target modules.
    """

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ALL_LINEAR
    init_from: str | None = None

    def __post_init__(self):
        if self.rank < 1:
            raise ConfigError(f"model.lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError(f"model.lora.target_modules needs at least one module name, e.g. {list(ALL_LINEAR)}")


def adaptable_module_names(model: nn.Module) -> list[str]:
    """Sorted distinct short names (last path component) of the modules peft can put a LoRA adapter on
    (linear, embedding and 1-d convolution layers)."""
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d)
    return sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if name and isinstance(mod, kinds)})


def _tied_embedding_modules(model: nn.Module) -> set[str]:
    """The names of the input embedding and output head when they share one weight (``tie_word_embeddings``)."""
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if inp is None or out is None or getattr(inp, "weight", None) is not getattr(out, "weight", False):
        return set()
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    return {names.get(id(inp)), names.get(id(out))} - {None}


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA adapters into ``model`` and freeze everything else.

    The model is changed in place (peft wraps its target layers); adapters of a bfloat16 or float16 model are
    created in float32. The adapters' initial values use the torch RNG (``B = 0``, so the adapted model starts
    exactly at the base model).

    Args:
        model: a transformers causal LM.
        settings: the LoRA hyperparameters (``settings.enabled`` is not checked: the caller decides).

    Returns:
        the peft model (``peft.PeftModelForCausalLM``); its trainable parameters are the adapters only.

    Raises:
        ConfigError: a target module name that the model lacks (the message lists the ones it has), or the input
            embedding or output head of a model that ties them (one weight: a merged export would change both).

    Source: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models".
    """
    from peft import LoraConfig, get_peft_model

    have = adaptable_module_names(model)
    missing = [t for t in settings.target_modules if t not in have]
    if missing:
        raise ConfigError(f"model.lora.target_modules {missing} are not modules of this model; it has: {', '.join(have)}")
    tied = _tied_embedding_modules(model) & set(settings.target_modules)
    if tied:
        raise ConfigError(f"model.lora.target_modules {sorted(tied)}: this model ties its input embedding and output "
                          "head (tie_word_embeddings, one weight), so an adapter trained on one of them would change "
                          "both once merged (memagent export), which is not the policy trained; adapt the other "
                          f"layers ({', '.join(t for t in have if t not in tied)})")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for our users to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config, autocast_adapter_dtype=True)


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` (or the module it wraps as ``.model`` / ``.module``) is a peft model."""
    return peft_model(model) is not None


def peft_model(model: nn.Module) -> Any:
    """The live peft model inside ``model``, or ``None`` for a policy without adapters.

    The trainer's policy (``Trainer.policy``, also the ``policy`` a rollout engine is built with) *is* the peft
    model when ``model.lora.enabled``: its adapter weights are the ones the optimizer steps, so an engine that
    serves the adapter elsewhere (e.g. pushed to llama.cpp after each step) reads them from here, with
    ``save_pretrained(dir)`` (adapter only) or :func:`adapter_state_dict`.

    Args:
        model: the policy, or a module wrapping it (:class:`memagent.train.batching.TokenLogProbs` as ``.model``,
            DDP as ``.module``).

    Returns:
        the ``peft.PeftModel``, or ``None``.
    """
    for _ in range(4):  # TokenLogProbs -> .model, DDP -> .module
        if hasattr(model, "disable_adapter") and hasattr(model, "get_base_model"):
            return model
        model = getattr(model, "module", None) or getattr(model, "model", None)
        if model is None:
            return None
    return None


def adapter_disabled(model: nn.Module) -> contextlib.AbstractContextManager:
    """Context in which the LoRA policy computes the base model (the reference model).

    Args:
        model: the peft model, or a module wrapping it (:class:`memagent.train.batching.TokenLogProbs`, DDP).

    Raises:
        ConfigError: ``model`` has no LoRA adapter.
    """
    found = peft_model(model)
    if found is None:
        raise ConfigError("the reference model as the adapter-disabled policy needs a LoRA policy (model.lora.enabled)")
    return found.disable_adapter()


def reference_logprobs(scorer: nn.Module, rows: Sequence, pad_id: int, max_tokens: int,
                       equal_forwards: Callable[[int], int] | None = None) -> list[torch.Tensor]:
    """Reference-model log-probabilities of every row's response tokens: the LoRA policy with its adapter
    disabled, so the frozen base weights serve as the reference without a second model in memory.

    Args:
        scorer: a :class:`memagent.train.batching.TokenLogProbs` on the peft model.
        rows, pad_id, max_tokens, equal_forwards: as for
            :func:`memagent.train.batching.row_logprobs`.

    Returns:
        per row a ``(T_resp,)`` float32 CPU tensor.

    Raises:
        ConfigError: the scorer's model has no LoRA adapter.
    """
    from memagent.train.batching import row_logprobs

    with adapter_disabled(scorer):
        return row_logprobs(scorer, rows, pad_id, max_tokens, False, equal_forwards)[0]


# ------------------------------------------------------------------------------------------- checkpoints
def trainable_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the parameters that require gradients, in ``named_parameters`` order."""
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the trainable parameters (the adapters under LoRA), keyed by parameter name."""
    return {n: p.detach().to("cpu", copy=True) for n, p in trainable_named_parameters(model)}


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable parameters into ``model`` (bit for bit).

    Raises:
        ConfigError: the names or shapes differ from the model's trainable parameters (another rank or other
            target modules).
    """
    params = dict(trainable_named_parameters(model))
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ConfigError(f"the checkpoint's adapter does not fit this model: {len(missing)} trainable parameters "
                          f"missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})")
    with torch.no_grad():
        for n, p in params.items():
            if tuple(state[n].shape) != tuple(p.shape):
                raise ConfigError(f"the checkpoint's {n} has shape {tuple(state[n].shape)}, the model's "
                                  f"{tuple(p.shape)} (another LoRA rank?)")
            p.copy_(state[n].to(p.device, p.dtype))


def load_init_adapter(model: nn.Module, path: str) -> dict[str, Any]:
    """Warm start (``model.lora.init_from``): copy the adapter of the training checkpoint at ``path`` into the
    peft ``model``; returns the checkpoint's step and base fingerprint (``{"step": int, "base_fingerprint": str}``)
    for the run's provenance. ``path`` may also be a llama.cpp LoRA adapter GGUF (what ``memagent export
    --format lora-gguf`` writes) or a packaged policy's name (``ruler-niah``): :func:`load_gguf_adapter`, step
    ``None``.

    Raises:
        ConfigError: ``path`` is missing or not a LoRA training checkpoint or adapter GGUF, a name that is no
            packaged policy, its adapter was trained on other base weights (fingerprint differs), or its
            adapter has other names or shapes (rank, targets) or another alpha.
    """
    from memagent.policies import resolve_lora

    path = resolve_lora(path)  # a packaged policy's name -> its adapter GGUF; a path stays as it is
    if not os.path.isfile(path):
        raise ConfigError(f"model.lora.init_from: {path!r} is not a file; give a LoRA run's checkpoint "
                          "(its checkpoints/step_*.pt), a LoRA adapter GGUF or a packaged policy's name")
    if path.endswith(".gguf"):
        return {"step": None, "base_fingerprint": load_gguf_adapter(model, path)}
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - pickle, zip and EOF errors alike
        raise ConfigError(f"model.lora.init_from: {path!r} cannot be read ({type(e).__name__}: {e})") from e
    saved = state.get("model") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or "adapter" not in saved:
        raise ConfigError(f"model.lora.init_from: {path!r} is not a LoRA training checkpoint (no adapter in it)")
    trained = state.get("lora")
    if isinstance(trained, dict):  # the shapes would load under another alpha (another scale) or name other targets
        live = peft_model(model).peft_config["default"]
        now = {"rank": live.r, "alpha": float(live.lora_alpha), "target_modules": sorted(live.target_modules)}
        then = {"rank": trained.get("rank"), "alpha": float(trained.get("alpha") or 0),
                "target_modules": sorted(trained.get("target_modules") or ())}
        diff = [f"model.lora.{k}: the checkpoint's {then[k]!r}, this run's {now[k]!r}" for k in now if then[k] != now[k]]
        if diff:
            raise ConfigError(f"model.lora.init_from {path!r} holds an adapter made with other LoRA settings "
                              f"({'; '.join(diff)}); set them to the checkpoint's")
    here = load_adapter_on_base(model, saved["adapter"], saved.get("base_fingerprint"), f"model.lora.init_from {path!r}")
    return {"step": state.get("step"), "base_fingerprint": here}


def load_gguf_adapter(model: nn.Module, path: str) -> str:
    """Copy a llama.cpp LoRA adapter GGUF into the peft ``model`` (float16 files lose nothing more than their
    rounding); returns the base's fingerprint. A GGUF records no base fingerprint, so the base is not checked:
    start from an adapter made on this run's base (a packaged policy names its base in ``policy.json``).

    Raises:
        ConfigError: not a LoRA adapter GGUF, other target modules or ranks, an ``adapter.lora.alpha`` that
            differs from this run's LoRA scale (``model.lora.alpha``), or a model that is not llama-architecture.
    """
    from memagent.export.gguf_lora import LlamaShape, LoraScaling, read_lora_gguf, split_lora_state_dict

    peft = peft_model(model)
    live = dict(trainable_named_parameters(model))
    pairs = split_lora_state_dict(live, "default")
    settings = LoraScaling.from_peft(peft.peft_config["default"])
    arrays, alpha = read_lora_gguf(path, list(pairs), LlamaShape.from_hf_config(peft.get_base_model().config))
    if abs(alpha - settings.gguf_alpha()) > 1e-6 * settings.gguf_alpha():  # (a file with folded scales: alpha 0)
        raise ConfigError(f"model.lora.init_from {path!r}: adapter alpha {alpha}, this run's LoRA gives "
                          f"{settings.gguf_alpha()}: set model.lora.alpha and rank to the adapter's")
    name_of = {id(p): n for n, p in live.items()}
    state = {name_of[id(param)]: torch.from_numpy(arrays[module][side])
             for module, ab in pairs.items() for side, param in ab.items()}
    load_adapter_state_dict(model, state)
    return base_fingerprint(model)


def load_adapter_on_base(model: nn.Module, adapter: dict[str, torch.Tensor], fingerprint: str | None,
                         where: str = "the checkpoint") -> str:
    """Copy a saved ``adapter`` into ``model`` after checking it was trained on this base (``fingerprint`` from
    :func:`base_fingerprint`; ``None``: an older checkpoint without one, not checked). Returns this base's
    fingerprint.

    Raises:
        ConfigError: other base weights, or an adapter of other names or shapes.
    """
    here = base_fingerprint(model)
    if fingerprint not in (None, here):
        raise ConfigError(f"{where} was trained on other base weights (fingerprint {fingerprint}, this model's "
                          f"{here}: another model.path, model.dtype or file); use the same base model")
    load_adapter_state_dict(model, adapter)
    return here


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters named instead of numbered (robust to a model rebuilt in
    another order; the names are ``model.named_parameters()``'s).

    Raises:
        ConfigError: the optimizer holds a parameter that is not one of ``model``'s.
    """
    name_of = {id(p): n for n, p in model.named_parameters()}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in name_of for p in order):
        raise ConfigError("the optimizer holds parameters that are not the model's")
    names = [name_of[id(p)] for p in order]
    sd = optimizer.state_dict()
    return {"state": {names[i]: v for i, v in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: nn.Module, state: dict[str, Any]) -> None:
    """Inverse of :func:`optimizer_state_by_name`.

    Raises:
        ConfigError: the saved parameter names are not those the optimizer holds.
    """
    name_of = {id(p): n for n, p in model.named_parameters()}
    index = {name_of[id(p)]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    saved = [n for g in state["param_groups"] for n in g["params"]]
    if sorted(saved) != sorted(index):
        extra = sorted(set(saved) - set(index))[:2]
        raise ConfigError(f"the checkpoint's optimizer state is for other parameters ({len(saved)} saved, "
                          f"{len(index)} here; e.g. {extra})")
    optimizer.load_state_dict({
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    })


def base_fingerprint(model: nn.Module) -> str:
    """CRC-32 (hex) over the names, shapes, dtypes and bytes of the frozen parameters (the base weights under
    LoRA): identifies the base a LoRA checkpoint was trained on."""
    crc = 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            continue
        t = p.detach().to("cpu").contiguous().reshape(-1)
        crc = zlib.crc32(f"{n}|{tuple(p.shape)}|{p.dtype}".encode(), crc)
        crc = zlib.crc32(t.view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"


def lora_checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, settings: LoraSettings) -> dict[str, Any]:
    """What a LoRA checkpoint holds of the model: the adapter, its optimizer state by name, the settings and the
    base fingerprint (put these keys into the trainer's checkpoint dict next to scheduler, RNG and step).

    Returns:
        ``{"lora": settings as a dict, "adapter": {name: tensor}, "optimizer": by-name state,
        "base_fingerprint": str}``.
    """
    return {"lora": dataclasses.asdict(settings), "adapter": adapter_state_dict(model),
            "optimizer": optimizer_state_by_name(optimizer, model), "base_fingerprint": base_fingerprint(model)}


def load_lora_checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                               settings: LoraSettings, where: str = "the checkpoint") -> None:
    """Restore a :func:`lora_checkpoint_state` into a freshly built LoRA model and its optimizer.

    Raises:
        ConfigError: the checkpoint is a full fine-tuning one, was made with other LoRA settings, or on other
            base weights (each with what differs).
    """
    check_resume_kind(state.get("lora"), settings, where)
    load_adapter_on_base(model, state["adapter"], state.get("base_fingerprint"), where)
    load_optimizer_state_by_name(optimizer, model, state["optimizer"])


def check_resume_kind(saved: dict[str, Any] | None, settings: LoraSettings, where: str = "the checkpoint") -> None:
    """Refuse to resume a LoRA checkpoint as full fine-tuning, a full one as LoRA, or LoRA with another rank,
    alpha, dropout or targets.

    Args:
        saved: the checkpoint's ``lora`` settings dict; ``None`` for a full fine-tuning checkpoint.
        settings: this run's settings.
        where: the checkpoint's name for the message.

    Raises:
        ConfigError: naming every setting that differs.
    """
    if saved is None or not saved.get("enabled", True):
        if settings.enabled:
            raise ConfigError(f"{where} holds a full fine-tuning run (all weights); this run asks for LoRA "
                              "(model.lora.enabled=true): resume with model.lora.enabled=false or start a new run")
        return
    if not settings.enabled:
        raise ConfigError(f"{where} holds a LoRA run (rank {saved.get('rank')}, targets {list(saved.get('target_modules', []))}) "
                          "and only its adapter; this run asks for full fine-tuning: resume with model.lora.enabled=true "
                          "and the same LoRA settings, or start a new run")
    now = dataclasses.asdict(settings)
    diff = [(k, saved.get(k), now[k]) for k in now if _norm(saved.get(k)) != _norm(now[k])]
    if diff:
        listing = "; ".join(f"model.lora.{k}: {a!r} -> {b!r}" for k, a, b in diff)
        raise ConfigError(f"{where} was trained with other LoRA settings ({listing}); resume with the checkpoint's "
                          "settings or start a new run")


def _norm(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v
