"""Per-token KL estimators between the policy and a frozen reference model.

With ``d = logp_ref - logp`` (log-probabilities of the sampled tokens, which were drawn from the policy):

- ``k1 = -d``: unbiased, high variance, can be negative;
- ``k2 = d**2 / 2``: biased, low variance, always >= 0;
- ``k3 = exp(d) - d - 1`` ("low_var_kl"): unbiased and always >= 0; the reference's choice. As in the
  reference, ``d`` is clamped to [-20, 20] before ``exp`` and the result to [-10, 10].

Source: reference-memagent.md §4.8 (KL loss); J. Schulman, "Approximating KL divergence" (2020).
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

from memagent.errors import DataError

KLType = Literal["k1", "k2", "k3"]
#: The KL estimators (the one list: derived from :data:`KLType`).
KL_TYPES: tuple[str, ...] = typing.get_args(KLType)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLType = "k3") -> torch.Tensor:
    """Per-token KL estimate.

    Args:
        logp: ``(B, T)`` policy log-probabilities of the sampled tokens.
        ref_logp: ``(B, T)`` reference-model log-probabilities of the same tokens.
        kind: ``"k1"``, ``"k2"`` or ``"k3"`` (see module docstring).

    Returns:
        ``(B, T)`` per-token estimate (mask and aggregate it yourself).

    Raises:
        DataError: unknown ``kind``.
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise DataError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_TYPES)}")
