"""Per-token KL estimators between the policy and a frozen reference model.

With ``d = logp_ref - logp`` (log-probabilities of the sampled tokens, which were drawn from the policy):

- ``k1 = -d``: unbiased, high variance, can be negative;
- ``k2 = d**2 / 2``: biased, low variance, always >= 0;
- ``k3 = exp(d) - d - 1`` ("low_var_kl"): unbiased and always >= 0; the reference's choice. As in the
  reference, ``d`` is clamped to [-20, 20] before ``exp`` and the result to [-10, 10].

These describe the estimate's value: k1 and k3 average to KL(policy || reference) over tokens drawn from the
policy. As a loss term (the sampled tokens held fixed, as here and in the reference) their gradients differ:
k1's expected gradient is 0 (it adds noise and no pull towards the reference), k2's is the gradient of
KL(policy || reference), and k3's is the gradient of KL(reference || policy), the reverse direction (checked on a
4-token categorical: k3 gave [0.0497, -0.1740, 0.1715, -0.0472] against KL(policy || reference)'s
[0.0182, -0.1419, 0.1933, -0.0696]). Both k2 and k3 pull the policy towards the reference; k1 with
``rl.kl_coef > 0`` does not, and the trainer warns about it.

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
