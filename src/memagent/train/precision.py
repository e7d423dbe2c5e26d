"""Compute precision of the update: bfloat16 matmuls over float32 master weights.

``compute_dtype="bfloat16"`` runs the policy's forward (and so its backward) under ``torch.autocast``: matrix
products take bfloat16 inputs while the parameters, their gradients and the AdamW state stay in the
parameters' own dtype (float32 for a run that learns: a bfloat16-parameter run rounds small AdamW updates
away, see :class:`memagent.train.config.TrainConfig`). The log-softmax over the vocabulary and everything
after it (ratios, KL, the loss) stays float32.

On CPUs with native bfloat16 instructions (AVX512_BF16 or AMX) the matmuls run about twice as fast; elsewhere
bfloat16 is emulated and slower (:func:`native_bfloat16` tells).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from memagent.errors import ConfigError

COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


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
