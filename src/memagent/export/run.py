"""What a training run folder must hold to be exported, and the three export formats.

Input contract (``RUN_DIR``):

- ``policy/``: the trained policy as an HF model directory (``config.json``, weights, tokenizer); the trainer
  writes it when a full fine-tuning run finishes. Or
- ``adapter/``: a peft LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, peft's
  ``save_pretrained``) over the run's base model. When both exist the adapter wins (``policy/`` may then be
  a merged copy).
- ``config.json``: the run's training config (the trainer writes it first); ``model.path`` names the base
  model (``smollm2``, ``tiny``, an HF directory or a ``.gguf``), ``run.seed`` seeds a ``tiny`` base. Without
  it the adapter's ``base_model_name_or_path`` is used.

Formats (``--format``):

- ``hf``: an HF model directory (LoRA merged with peft's ``merge_and_unload``) that transformers and vLLM load.
- ``gguf``: ``model.gguf`` for llama.cpp (``memagent run --backend llamacpp --model OUT/model.gguf``); its
  tokenizer and metadata come from the base GGUF, so the base must be a GGUF (``smollm2`` or a ``.gguf``).
- ``lora-gguf``: the adapter alone, ``adapter.gguf``, in llama.cpp's LoRA format (LoRA runs only).

An earlier step (``--checkpoint``): the trainer keeps its newest checkpoints as ``checkpoints/step_*.pt``
(``run.save_every``, ``run.keep_checkpoints``) but only the newest policy in ``adapter/`` or ``policy/``.
:func:`checkpoint_policy` turns one checkpoint into such a folder (the adapter, or the full weights over the
run's base), so every format exports any kept step.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from memagent.errors import ConfigError

Format = Literal["hf", "gguf", "lora-gguf"]
FORMATS: tuple[str, ...] = ("hf", "gguf", "lora-gguf")


@dataclass(frozen=True)
class RunPolicy:
    """The trained policy a run folder holds.

    Attributes:
        kind: ``"full"`` (``policy/``) or ``"lora"`` (``adapter/``).
        path: the ``policy/`` or ``adapter/`` directory.
        base: the base model spec (``smollm2``, ``tiny``, a directory or a ``.gguf``); ``None`` if unknown.
        seed: the run's seed (a ``tiny`` base is rebuilt from it).
    """

    kind: Literal["full", "lora"]
    path: str
    base: str | None
    seed: int = 0

    def base_gguf(self) -> str | None:
        """The base model's GGUF file, when the base is one."""
        if self.base == "smollm2":
            from memagent.embedded import smollm2_gguf_path

            return smollm2_gguf_path()
        return self.base if self.base and self.base.endswith(".gguf") else None


def find_policy(run_dir: str | os.PathLike) -> RunPolicy:
    """Locate the trained policy in a run folder (see the module docstring for the contract).

    Raises:
        ConfigError: the folder does not exist, holds neither ``policy/`` nor ``adapter/`` (the message says
            what it holds instead), or an ``adapter/`` lacks its files or a known base model.
    """
    run = os.fspath(run_dir)
    cfg = run_config(run)
    base = (cfg.get("model") or {}).get("path")
    seed = int((cfg.get("run") or {}).get("seed", 0))
    adapter, policy = os.path.join(run, "adapter"), os.path.join(run, "policy")
    if os.path.isdir(adapter):
        if not os.path.isfile(os.path.join(adapter, "adapter_config.json")) or not any(
            os.path.isfile(os.path.join(adapter, f)) for f in ("adapter_model.safetensors", "adapter_model.bin")
        ):
            raise ConfigError(f"{adapter} is not a peft adapter: it needs adapter_config.json and "
                              "adapter_model.safetensors (peft's save_pretrained)")
        if base is None:
            with open(os.path.join(adapter, "adapter_config.json"), encoding="utf-8") as f:
                base = json.load(f).get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{run} has an adapter but no base model: neither config.json's model.path nor the "
                              "adapter's base_model_name_or_path names one")
        return RunPolicy("lora", adapter, base, seed)
    if os.path.isfile(os.path.join(policy, "config.json")):
        _warn_if_stale(run, policy)
        return RunPolicy("full", policy, base, seed)
    held = sorted(os.listdir(run))
    hint = (" It has checkpoints/ only: a run stopped before its last step; resume it to the end "
            "(memagent train with the same config) to get policy/, or export a kept step with --checkpoint STEP.") \
        if "checkpoints" in held else ""
    raise ConfigError(f"{run} holds no trained policy: expected policy/ (an HF model directory, written when "
                      f"training finishes) or adapter/ (a peft LoRA adapter); it holds {held or 'nothing'}.{hint}")


class StaleExportWarning(UserWarning):
    """``policy/`` holds an earlier step than the run's newest checkpoint."""


def _kept_steps(run: str) -> list[int]:
    folder = os.path.join(run, "checkpoints")
    return sorted(int(m.group(1)) for f in (os.listdir(folder) if os.path.isdir(folder) else [])
                  if (m := re.fullmatch(r"step_(\d+)\.pt", f)))


def _warn_if_stale(run: str, policy: str) -> None:
    """Warn when ``policy/`` holds an earlier step than the run's newest checkpoint: a finished run continued
    (``run.total_steps`` raised) and stopped before its new end keeps its old ``policy/``."""
    from memagent.train.checkpoint import policy_step

    step, kept = policy_step(policy), _kept_steps(run)
    if step is not None and kept and kept[-1] > step:
        warnings.warn(f"{policy} holds step {step}, but the run's newest checkpoint is step {kept[-1]} (the run went "
                      f"on after policy/ was written and stopped before its end); exporting step {step}: give "
                      f"--checkpoint {kept[-1]} for the newest weights, or resume the run to its end", StaleExportWarning, stacklevel=3)


def load_base(policy: RunPolicy) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a LoRA run's base model, in float32.

    Raises:
        ConfigError: the base cannot be found or loaded.
    """
    from memagent.backends.hf import load_hf_model

    if policy.base == "tiny":
        from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

        tok = make_tiny_tokenizer()
        return make_tiny_model(tok, seed=policy.seed), tok
    path = policy.base_gguf() or policy.base
    if not path or not os.path.exists(path):
        raise ConfigError(f"the base model {policy.base!r} of {policy.path} is not a local file or directory; export "
                          "needs the base weights (model.path in the run's config.json)")
    return load_hf_model(path, "float32")


def load_policy_model(policy: RunPolicy) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the trained policy in float32, a LoRA adapter merged into its base."""
    if policy.kind == "full":
        from memagent.backends.hf import load_hf_model

        return load_hf_model(policy.path, "float32")
    try:
        from peft import PeftModel
    except ImportError as e:
        raise ConfigError(f"exporting a LoRA run needs peft ({e}); pip install peft") from e
    base, tok = load_base(policy)
    merged = PeftModel.from_pretrained(base, policy.path).merge_and_unload()
    return merged.eval(), tok


def _base_shape(policy: RunPolicy):
    """Layer and head counts of the base model, without loading its weights."""
    from memagent.export.gguf_lora import LlamaShape

    gguf_path = policy.base_gguf()
    if gguf_path:
        import gguf

        fields = gguf.GGUFReader(gguf_path).fields
        arch = fields["general.architecture"].contents()
        if arch != "llama":
            raise ConfigError(f"the base GGUF {gguf_path} is architecture {arch!r}; LoRA GGUF export supports llama")
        heads = int(fields["llama.attention.head_count"].contents())
        kv = fields.get("llama.attention.head_count_kv")
        return LlamaShape(int(fields["llama.block_count"].contents()), heads, int(kv.contents()) if kv else heads)
    return LlamaShape.from_hf_config(load_base(policy)[0].config)


def checkpoint_file(run_dir: str | os.PathLike, checkpoint: str | int) -> str:
    """The checkpoint file that ``checkpoint`` names: a step number (``8``, ``"8"`` or ``"08"``: the run's
    ``checkpoints/step_000008.pt``), a path to a ``.pt`` file, or a file name inside the run's ``checkpoints/``.

    Raises:
        ConfigError: the run folder does not exist, or no such file (for a step, the message lists the steps the
            run kept).
    """
    if not os.path.isdir(run_dir):
        raise ConfigError(f"run folder not found: {os.fspath(run_dir)!r}")
    text = str(checkpoint)
    folder = os.path.join(os.fspath(run_dir), "checkpoints")
    if re.fullmatch(r"[0-9]+", text):
        path = os.path.join(folder, f"step_{int(text):06d}.pt")
        if not os.path.isfile(path):
            kept = sorted(int(m.group(1)) for f in (os.listdir(folder) if os.path.isdir(folder) else [])
                          if (m := re.fullmatch(r"step_(\d+)\.pt", f)))
            raise ConfigError(f"--checkpoint {text}: {path} does not exist; the run kept steps {kept or 'none'} "
                              "(run.save_every and run.keep_checkpoints decide which)")
        return path
    for path in (text, os.path.join(folder, text)):
        if os.path.isfile(path):
            return path
    raise ConfigError(f"--checkpoint {text!r} is neither a step number, nor a file (read from the current folder), "
                      f"nor a file in {folder}")


def _peft_file_name(name: str, adapter: str = "default") -> str:
    """A live peft parameter name (``...q_proj.lora_A.default.weight``) as peft's files store it
    (``...q_proj.lora_A.weight``)."""
    return re.sub(rf"(\.lora_\w+?)\.{re.escape(adapter)}(\.\w+)$", r"\1\2", name)


def _refuse_format(policy: RunPolicy, fmt: str, what: str) -> None:
    """Refuse a format the policy cannot be written in, before any weights are loaded or written.

    Raises:
        ConfigError: ``lora-gguf`` for full weights, ``gguf`` for a base that is not a GGUF.
    """
    if fmt == "lora-gguf" and policy.kind != "lora":
        raise ConfigError(f"{what} was trained without LoRA (it holds the full weights), so there is no adapter to "
                          "export; use --format hf or --format gguf")
    if fmt == "gguf" and policy.base_gguf() is None:
        raise ConfigError(f"--format gguf copies the tokenizer and metadata of the base GGUF, but this run's base is "
                          f"{policy.base!r}; export --format hf and convert that with llama.cpp's convert_hf_to_gguf.py")


def checkpoint_policy(run_dir: str | os.PathLike, checkpoint: str | int, workdir: str, fmt: str | None = None) -> RunPolicy:
    """Write the policy that one training checkpoint holds as a run's policy folder under ``workdir``.

    A LoRA checkpoint (``{"lora": settings, "model": {"adapter": {live peft name: tensor}}}``, see
    :mod:`memagent.train.lora`) becomes ``workdir/adapter/`` (peft's ``adapter_config.json`` from the
    checkpoint's own LoRA settings and ``adapter_model.safetensors``); a full fine-tuning one (``"model"``: the
    whole state dict) becomes ``workdir/policy/``, its weights loaded over the run's base model (``model.path``
    of ``config.json``) and saved in float32 with the base's tokenizer. The checkpoint is memory-mapped, so its
    optimizer state is not read. A checkpoint whose own config names another ``model.path`` than the run's is
    refused; the base fingerprint it records is not recomputed.

    Args:
        run_dir: the run folder; its ``config.json`` names the base model.
        checkpoint: a step number or a checkpoint path (:func:`checkpoint_file`).
        workdir: an existing directory to write into (e.g. a temporary one).
        fmt: the export format, checked against the checkpoint's kind before anything is written.

    Returns:
        The :class:`RunPolicy` of the written folder.

    Raises:
        ConfigError: no such checkpoint, a file that is not a memagent training checkpoint, one made on another
            base model than the run's, a format it cannot be written in, or a base that cannot be loaded.
    """
    import torch

    path = checkpoint_file(run_dir, checkpoint)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and EOF errors alike
        raise ConfigError(f"--checkpoint {path!r} cannot be read ({type(e).__name__}: {e})") from e
    model_state = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model_state, dict) or not model_state:
        raise ConfigError(f"--checkpoint {path!r} is not a memagent training checkpoint (no model state in it)")
    run_cfg = run_config(run_dir)
    base = (run_cfg.get("model") or {}).get("path")
    seed = int((run_cfg.get("run") or {}).get("seed", 0))
    own = ((state.get("config") or {}).get("model") or {}).get("path")
    if own and base and own != base:
        raise ConfigError(f"--checkpoint {path!r} was trained on model.path {own!r}, but {os.fspath(run_dir)}'s "
                          f"config.json names {base!r}; give the checkpoint's own run folder")
    base = base or own
    if not base:
        raise ConfigError(f"{os.fspath(run_dir)} has no config.json naming model.path, the base model of "
                          f"--checkpoint {path!r}")
    kind = "lora" if "adapter" in model_state else "full"
    if fmt is not None:
        _refuse_format(RunPolicy(kind, path, base, seed), fmt, f"--checkpoint {path!r}")
    if kind == "lora":
        lora = state.get("lora")
        if not isinstance(lora, dict):
            raise ConfigError(f"--checkpoint {path!r} holds an adapter but no LoRA settings ('lora'); it was not "
                              "written by memagent train")
        from peft import LoraConfig
        from safetensors.torch import save_file

        folder = os.path.join(workdir, "adapter")
        LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora.get("dropout", 0.0)),
                   target_modules=list(lora["target_modules"]), bias="none", task_type="CAUSAL_LM").save_pretrained(folder)
        tensors = {_peft_file_name(k): v.detach().contiguous() for k, v in model_state["adapter"].items()}
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
        return RunPolicy("lora", folder, base, seed)
    model, tok = load_base(RunPolicy("full", path, base, seed))
    try:
        model.load_state_dict(model_state)
    except RuntimeError as e:
        raise ConfigError(f"--checkpoint {path!r} does not fit the run's base model {base!r}: {e}") from e
    folder = os.path.join(workdir, "policy")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return RunPolicy("full", folder, base, seed)


def run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's training config (``config.json``), ``{}`` when it has none.

    Raises:
        ConfigError: the run folder does not exist.
    """
    run = os.fspath(run_dir)
    if os.path.isfile(run):
        raise ConfigError(f"{run!r} is a file; give the training run's folder (its run.output_dir)")
    if not os.path.isdir(run):
        raise ConfigError(f"run folder not found: {run!r}")
    cfg_path = os.path.join(run, "config.json")
    if not os.path.isfile(cfg_path):
        return {}
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{cfg_path}: the run's training config cannot be read ({e}); restore it (a rerun of the "
                          "training command writes it again) or export from a copy of the run that has it") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path}: the run's training config must be a JSON object, got {type(cfg).__name__}")
    return cfg


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, fmt: str = "hf", dtype: str | None = None,
               checkpoint: str | int | None = None) -> str:
    """Export a run's trained policy.

    Args:
        run_dir: the run folder (module docstring).
        out_dir: a new or empty directory to write into.
        fmt: ``"hf"``, ``"gguf"`` or ``"lora-gguf"``.
        dtype: GGUF tensor type, ``"f16"`` or ``"f32"`` (``None``: f16 for ``gguf``, f32 for ``lora-gguf``, which
            keeps the adapter exactly; ``hf`` writes float32).
        checkpoint: export this kept step instead of the run's newest policy: a step number or a checkpoint
            path (:func:`checkpoint_policy`); ``None``: ``adapter/`` or ``policy/``.

    Returns:
        What was written: the HF directory, ``OUT/model.gguf`` or ``OUT/adapter.gguf``.

    Raises:
        ConfigError: an unknown format, a non-empty ``out_dir``, a run without a policy, ``lora-gguf`` for a
            run trained without LoRA, ``gguf`` for a base that is not a GGUF, a checkpoint that is missing or
            not a training checkpoint, or as the writers.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "hf" and dtype not in (None, "f32"):
        raise ConfigError(f"--dtype {dtype} applies to --format gguf and lora-gguf; --format hf writes float32 "
                          "(drop --dtype, or give f32)")
    if dtype not in (None, "f16", "f32"):  # before any model loads (it was refused after the merge)
        raise ConfigError(f"--dtype must be f16 or f32, got {dtype!r}")
    out = os.fspath(out_dir)
    from memagent.runfiles import folder_problem, unwritable

    problem = folder_problem(out)
    if problem and problem != "is a file":
        raise ConfigError(f"--out {out!r} {problem}; choose a new folder")
    if not problem and (problem := unwritable(out)):
        raise ConfigError(f"--out {out!r} {problem}; choose a folder you can write")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out {out!r} exists and is not an empty directory; choose a new folder")
    if checkpoint is None:
        return _export_policy(find_policy(run_dir), out, fmt, dtype, os.fspath(run_dir))
    parent = os.path.dirname(os.path.abspath(out))  # a full model's temporary copy on the output's disk
    with tempfile.TemporaryDirectory(prefix=".memagent-export-", dir=parent if os.path.isdir(parent) else None) as work:
        return _export_policy(checkpoint_policy(run_dir, checkpoint, work, fmt), out, fmt, dtype,
                              f"--checkpoint {checkpoint!r}")


def _export_policy(policy: RunPolicy, out: str, fmt: str, dtype: str | None, run_name: str) -> str:
    """:func:`export_run` once the policy folder is known."""
    _refuse_format(policy, fmt, run_name)
    base_gguf = policy.base_gguf()
    os.makedirs(out, exist_ok=True)
    if fmt == "lora-gguf":
        from safetensors.torch import load_file

        from memagent.export.gguf_lora import LoraScaling, write_lora_gguf

        with open(os.path.join(policy.path, "adapter_config.json"), encoding="utf-8") as f:
            scaling = LoraScaling.from_peft(json.load(f))
        weights = os.path.join(policy.path, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            raise ConfigError(f"{policy.path} holds adapter_model.bin; lora-gguf export reads adapter_model.safetensors")
        return write_lora_gguf(load_file(weights), os.path.join(out, "adapter.gguf"), _base_shape(policy), scaling,
                               dtype=dtype or "f32")
    model, tok = load_policy_model(policy)
    if fmt == "hf":
        model.save_pretrained(out)
        tok.save_pretrained(out)
        return out
    from memagent.export.gguf_model import write_model_gguf

    return write_model_gguf(model.state_dict(), model.config, base_gguf, os.path.join(out, "model.gguf"), dtype or "f16")
