"""Compute precision of the update: bfloat16 matmuls over float32 master weights.

``compute_dtype="bfloat16"`` runs the policy's forward (and so its backward) under ``torch.autocast``: matrix
products take bfloat16 inputs while the parameters, their gradients and the AdamW state stay in the
parameters' own dtype (float32 for a run that learns: a bfloat16-parameter run rounds small AdamW updates
away, see :class:`memagent.train.config.TrainConfig`). The log-softmax over the vocabulary and everything
after it (ratios, KL, the loss) stays float32.

On CPUs with native bfloat16 instructions (AVX512_BF16 or AMX) the matmuls run about twice as fast; elsewhere
bfloat16 is emulated and much slower: on an AVX2-only AMD EPYC the levered update of one question x G=4 took
1,080 s under bfloat16 against 88-125 s in float32 (``benchmarks/update_levers.py`` shapes, one thread).
``compute_dtype="auto"`` (:func:`resolve_compute_dtype`) picks bfloat16 only where :func:`native_bfloat16`
says the device has it, and a forced ``"bfloat16"`` on a CPU without it warns.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from memagent.errors import ConfigError

COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
#: What ``model.compute_dtype`` accepts: a dtype, or ``"auto"`` (:func:`resolve_compute_dtype`).
COMPUTE_DTYPE_SETTINGS: tuple[str, ...] = ("auto", *COMPUTE_DTYPES)


def compute_autocast(compute_dtype: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """Context for the policy's forward in ``compute_dtype``.

    Args:
        compute_dtype: ``"float32"`` (no autocast) or ``"bfloat16"``.
        device: where the model runs (autocast is per device type).

    Raises:
        ConfigError: another dtype.
    """
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    if compute_dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    raise ConfigError(f"model.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}")


def adapter_casts_off(model: torch.nn.Module, active: bool) -> contextlib.AbstractContextManager:
    """Under autocast, stop peft's LoRA layers from casting their input to the adapter's float32 and back
    (autocast already feeds bfloat16 to every matmul): two copies of each adapted layer's input saved per
    forward. A no-op for a model without adapters or when ``active`` is False."""
    if not active:
        return contextlib.nullcontext()
    try:
        from peft.helpers import disable_input_dtype_casting
    except ImportError:
        return contextlib.nullcontext()
    return disable_input_dtype_casting(model)


def full_precision(device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """Context that turns autocast off (for the log-softmax and the loss)."""
    return torch.autocast(device_type=torch.device(device).type, enabled=False)


@functools.lru_cache(maxsize=None)
def native_bfloat16(device_type: str = "cpu", cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether ``device_type`` computes bfloat16 natively: a CUDA device that supports it, or a CPU whose
    flags (``cpuinfo``) include ``avx512_bf16`` or ``amx_bf16``. Unknown platforms answer False."""
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_compute_dtype(setting: str, device_type: str = "cpu", native: bool | None = None) -> str:
    """The update's compute dtype for ``model.compute_dtype = setting`` on ``device_type``.

    ``"auto"`` answers ``"bfloat16"`` where the device computes it natively (:func:`native_bfloat16`: a CUDA
    device with bf16, a CPU with AVX512_BF16 or AMX) and ``"float32"`` elsewhere. ``"float32"`` and
    ``"bfloat16"`` answer themselves; ``"bfloat16"`` on a device without native bfloat16 also warns, since
    there it is emulated and was measured about 9x slower than float32 (module docstring).

    Args:
        setting: one of :data:`COMPUTE_DTYPE_SETTINGS`.
        device_type: ``"cpu"`` or ``"cuda"``.
        native: whether the device has native bfloat16; None asks :func:`native_bfloat16`.

    Raises:
        ConfigError: another setting.
    """
    if setting not in COMPUTE_DTYPE_SETTINGS:
        raise ConfigError(f"model.compute_dtype must be one of {', '.join(COMPUTE_DTYPE_SETTINGS)}, got {setting!r}")
    if setting == "float32":
        return setting
    has = native_bfloat16(device_type) if native is None else native
    if setting == "auto":
        return "bfloat16" if has else "float32"
    if not has:
        warnings.warn(f"model.compute_dtype=bfloat16 on a {device_type} without native bfloat16 (no AVX512_BF16 or "
                      "AMX): bfloat16 is emulated there and the update runs several times slower than in float32; "
                      "set model.compute_dtype=auto or float32", stacklevel=2)
    return setting
