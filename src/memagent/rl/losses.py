"""Clipped policy-gradient loss and loss aggregation.

Aggregation is expressed as per-token weights ``w (B, T)`` so that ``loss = sum(w * per_token_loss)``.
Weights are computed once over a whole mini-batch (all ranks, all micro-batches) with
:func:`aggregation_weights`; a micro-batch then contributes ``sum(w_micro * loss_micro)`` and the sum of
the micro-batch losses is the mini-batch loss exactly, whatever the split.

Aggregation modes (what each normalises by):

- ``token-mean`` (reference default): every generated token of the mini-batch weighs the same,
  ``1 / total tokens``. Longer responses and trajectories with more conversations weigh more.
- ``seq-mean-token-mean``: mean over each row's tokens, then mean over rows; every conversation weighs the
  same, so tokens of short responses weigh more.
- ``seq-mean-token-sum``: sum over each row's tokens, then mean over rows.
- ``seq-mean-token-sum-norm``: sum over all tokens divided by ``rows * horizon_tokens`` with a constant
  horizon (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"): removes the length bias of a
  per-row mean. verl divides by the padded width only; we divide by the row count too so the scale does
  not grow with the batch.
- ``traj-mean-token-mean`` (ours): token mean within each trajectory over all its conversations, then mean
  over trajectories. It exists because with ``token-mean`` over rows a trajectory that read a long
  document (many chunks, many update conversations) contributes many more tokens than one that read a short
  document, so long documents dominate the gradient; here every trajectory weighs the same however many
  chunks it has.

Source: reference-memagent.md §4.8 (policy loss, dual clip, token-mean, grad accumulation).
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

from memagent.errors import DataError
from memagent.rl.kl import KLType, kl_penalty

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "traj-mean-token-mean"]
#: The aggregation modes, in the order documented above (the one list: derived from :data:`AggMode`).
AGG_MODES: tuple[str, ...] = typing.get_args(AggMode)


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise DataError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")


def aggregation_units(mask: torch.Tensor, mode: str, row_traj_index: torch.Tensor | None = None) -> torch.Tensor:
    """How many units the mode averages over in this (part of a) mini-batch: tokens for ``token-mean``,
    rows with at least one token for the ``seq-*`` modes, trajectories with at least one token for
    ``traj-mean-token-mean``. Sum it over ranks to get the global count for :func:`aggregation_weights`.

    Args:
        mask: ``(B, T)`` loss mask.
        mode: aggregation mode.
        row_traj_index: ``(B,)`` trajectory of each row (``traj-mean-token-mean`` only).

    Returns:
        0-d float64 tensor.
    """
    _check_mode(mode)
    m = mask.to(torch.float64)
    if mode == "token-mean":
        return m.sum()
    if mode.startswith("seq-"):
        return (m.sum(-1) > 0).to(torch.float64).sum()
    if row_traj_index is None:
        raise DataError("traj-mean-token-mean needs row_traj_index")
    trajs = row_traj_index[m.sum(-1) > 0]
    return torch.tensor(float(torch.unique(trajs).numel()), dtype=torch.float64)


def aggregation_weights(
    mask: torch.Tensor,
    mode: AggMode = "token-mean",
    row_traj_index: torch.Tensor | None = None,
    horizon_tokens: int | None = None,
    total_units: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Per-token weights implementing an aggregation mode over a mini-batch.

    Args:
        mask: ``(B, T)`` loss mask of the mini-batch's rows (1 = trained token).
        mode: one of :data:`AGG_MODES` (see module docstring).
        row_traj_index: ``(B,)`` trajectory of each row; required for ``traj-mean-token-mean``. All rows of a
            trajectory must be in ``mask`` (a trajectory is never split across ranks or mini-batches).
        horizon_tokens: the constant horizon of ``seq-mean-token-sum-norm`` in tokens (e.g. the maximum
            response length); defaults to ``T``.
        total_units: the global count from :func:`aggregation_units` summed over ranks; defaults to the
            local count (single process).

    Returns:
        ``(B, T)`` float32 weights, zero where ``mask`` is 0; they sum to 1 over the global mini-batch for
        the mean modes.

    Raises:
        DataError: unknown mode, or ``row_traj_index`` missing for ``traj-mean-token-mean``.
    """
    _check_mode(mode)
    m = mask.to(torch.float64)
    total = aggregation_units(mask, mode, row_traj_index) if total_units is None else total_units
    total = torch.as_tensor(total, dtype=torch.float64).clamp(min=1.0)
    if mode == "token-mean":
        w = m / total
    elif mode == "seq-mean-token-mean":
        w = m / m.sum(-1, keepdim=True).clamp(min=1.0) / total
    elif mode == "seq-mean-token-sum":
        w = m / total
    elif mode == "seq-mean-token-sum-norm":
        w = m / (total * float(horizon_tokens or m.shape[-1]))
    else:
        idx = row_traj_index.long()
        traj_tokens = torch.zeros(int(idx.max()) + 1 if idx.numel() else 0, dtype=torch.float64)
        traj_tokens.index_add_(0, idx, m.sum(-1))
        w = m / traj_tokens[idx].clamp(min=1.0).unsqueeze(-1) / total
    return w.to(torch.float32)


def clipped_pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate with dual clip.

    ``r = exp(logp - old_logp)``; ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; for
    ``A < 0`` the loss is further capped at ``-A * dual_clip`` (Ye et al. 2020, dual-clip PPO), which bounds
    the update when a very unlikely token got a negative advantage.

    Args:
        logp: ``(B, T)`` current-policy log-probabilities of the sampled tokens.
        old_logp: ``(B, T)`` log-probabilities under the policy that sampled them.
        advantages: ``(B, T)`` per-token advantages, or ``(B,)`` per-row (broadcast over tokens).
        mask: ``(B, T)`` loss mask (metrics only; the loss is not reduced here).
        clip_low, clip_high: lower and upper clip ranges (``clip_high > clip_low`` is DAPO's clip-higher).
        dual_clip: the dual-clip constant ``c > 1``, or ``None`` to disable.

    Returns:
        ``(per_token_loss (B, T), metrics)``; metrics are masked token means (0-d tensors):
        ``pg/clip_frac``, ``pg/dual_clip_frac``, ``pg/ratio_mean``, ``pg/approx_kl``.

    Raises:
        DataError: ``dual_clip`` is not greater than 1.

    Source: reference-memagent.md §4.8.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise DataError(f"dual_clip must be > 1 (reference: 3.0) or None, got {dual_clip}")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss = clipped
    dual = torch.zeros_like(clipped, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = (adv < 0) & (clipped > cap)
        loss = torch.where(adv < 0, torch.minimum(clipped, cap), clipped)
    m = mask.to(loss.dtype)
    n = m.sum().clamp(min=1.0)
    with torch.no_grad():
        metrics = {
            "pg/clip_frac": ((loss2 > loss1).to(m.dtype) * m).sum() / n,
            "pg/dual_clip_frac": (dual.to(m.dtype) * m).sum() / n,
            "pg/ratio_mean": (ratio * m).sum() / n,
            "pg/approx_kl": (-log_ratio * m).sum() / n,
        }
    return loss, metrics


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: KLType = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full GRPO objective of one (micro-)batch: ``sum(w * (pg + kl_coef * kl - entropy_coef * H))``.

    Args:
        logp, old_logp: ``(B, T)`` current / sampling-policy log-probabilities of the sampled tokens.
        advantages: ``(B,)`` or ``(B, T)`` advantages.
        weights: ``(B, T)`` aggregation weights from :func:`aggregation_weights` (computed over the whole
            mini-batch, so micro-batch losses add up to the mini-batch loss).
        mask: ``(B, T)`` loss mask (for metrics).
        clip_low, clip_high, dual_clip: see :func:`clipped_pg_loss`.
        ref_logp: ``(B, T)`` reference-model log-probabilities; required when ``kl_coef > 0``.
        kl_coef: weight of the KL term (reference: 0.001).
        kl_type: KL estimator (reference: ``"k3"``).
        entropy: ``(B, T)`` per-token policy entropy in nats (optional; logged when given).
        entropy_coef: weight of the entropy bonus (reference: 0).

    Returns:
        ``(loss, metrics)``: 0-d loss with gradient; metrics are 0-d detached tensors (``pg/loss``,
        ``kl/mean``, ``entropy/mean`` plus those of :func:`clipped_pg_loss`); the ``*/loss`` and
        ``kl/mean``/``entropy/mean`` metrics are weighted by ``weights`` like the loss, so they too add up
        over micro-batches.

    Raises:
        DataError: ``kl_coef > 0`` without ``ref_logp``, or ``entropy_coef != 0`` without ``entropy``.
    """
    pg, metrics = clipped_pg_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip)
    w = weights.to(pg.dtype)
    pg_loss = (w * pg).sum()
    loss = pg_loss
    metrics["pg/loss"] = pg_loss.detach()
    if kl_coef > 0 and ref_logp is None:
        raise DataError("kl_coef > 0 needs ref_logp (reference-model log-probabilities)")
    if ref_logp is not None:
        kl = (w * kl_penalty(logp, ref_logp, kl_type)).sum()
        metrics["kl/mean"] = kl.detach()
        if kl_coef > 0:
            loss = loss + kl_coef * kl
    if entropy_coef != 0 and entropy is None:
        raise DataError("entropy_coef != 0 needs the per-token entropy")
    if entropy is not None:
        ent = (w * entropy).sum()
        metrics["entropy/mean"] = ent.detach()
        if entropy_coef != 0:
            loss = loss - entropy_coef * ent
    return loss, metrics
