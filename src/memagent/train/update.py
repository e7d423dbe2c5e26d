"""One optimizer step's worth of gradient: a mini-batch of rows, split into micro-batches.

The aggregation weights are computed over the whole mini-batch (and, under DDP, with the unit count summed
over ranks) before any micro-batch runs, so the accumulated gradient equals the gradient of the chosen
aggregation over the whole mini-batch exactly (reference-memagent.md §4.8, "modified grad accumulation").
Under DDP each rank's loss is multiplied by the world size because DDP averages gradients over ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from memagent.rl.losses import aggregation_units, aggregation_weights, policy_loss
from memagent.rl.multiconv import row_loss_mask
from memagent.train.batching import dummy_batch, pad_rows, scatter_response
from memagent.train.config import LossSettings  # noqa: F401 - the loss settings' one declaration
from memagent.train.prefix import MicroBatch, check_sharing, plan_micro_batches
from memagent.train.rollout import Row

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


def mini_batch_backward(
    model: torch.nn.Module,
    rows: Sequence[Row],
    row_advantages: torch.Tensor,
    old_logps: Sequence[torch.Tensor] | None,
    ref_logps: Sequence[torch.Tensor] | None,
    settings: LossSettings,
    pad_id: int,
    micro_tokens: int,
    all_reduce_sum: AllReduceSum | None = None,
    world_size: int = 1,
    log_entropy: bool = False,
    equal_forwards: Callable[[int], int] | None = None,
    min_shared_tokens: int | None = None,
    reference: Callable[[], contextlib.AbstractContextManager] | None = None,
    total_units: torch.Tensor | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of the mini-batch loss into ``model``'s parameters (no optimizer step).

    Args:
        model: a :class:`memagent.train.batching.TokenLogProbs`, or a DDP wrapper of one.
        rows: this rank's rows of the mini-batch (whole trajectories).
        row_advantages: ``(R,)`` advantage of each row.
        old_logps, ref_logps: per row ``(T_resp,)`` sampling-policy / reference log-probabilities.
            ``old_logps=None`` means the rows were sampled by the current weights and this is the only
            update on them (one mini-batch, one epoch): the detached current log-probabilities are used,
            which saves a forward pass (the ratio is 1 by construction).
        settings: loss hyperparameters.
        pad_id: padding token id.
        micro_tokens: padded-token budget per micro-batch.
        all_reduce_sum: sums a tensor over ranks (DDP); ``None`` in a single process.
        world_size: number of ranks.
        log_entropy: compute the policy entropy for the ``entropy/mean`` metric even when its coefficient
            is 0.
        equal_forwards: FSDP: maps this rank's micro-batch count to the count every rank runs (their maximum);
            the missing micro-batches are forward/backward passes on a 2-token dummy row with loss 0, so the
            per-layer all-gathers and gradient reduce-scatters of all ranks pair up. Gradients are reduced
            only after the last one (``set_requires_gradient_sync``).
        min_shared_tokens: compute prompt prefixes shared by rows (at least this many tokens) once per group
            (:mod:`memagent.train.prefix`); micro-batches then hold whole groups. ``None``: no sharing.
        reference: with ``ref_logps=None``, a context in which ``model`` computes the reference model (LoRA:
            :func:`memagent.train.lora.adapter_disabled`); each micro-batch then takes its reference
            log-probabilities from ``model`` without gradient just before its training forward (fused
            reference pass: no second model, no separate pass over the rows).

    Returns:
        metrics as floats: ``loss``, ``pg/loss``, ``kl/mean``, ``entropy/mean`` (mini-batch aggregates) and
        token means ``pg/clip_frac``, ``pg/dual_clip_frac``, ``pg/ratio_mean``, ``pg/approx_kl``;
        ``tokens`` (response tokens on this rank) and, when entropy is computed, ``entropy/token_sum``
        (unweighted sum over those tokens).
    """
    check_sharing(min_shared_tokens, equal_forwards)
    full = pad_rows(rows, pad_id)
    mask = row_loss_mask(full.response_mask, torch.tensor([r.is_final for r in rows]), settings.mask_final)
    traj = torch.tensor([r.traj_index for r in rows])
    units = aggregation_units(mask, settings.agg_mode, traj) if total_units is None else total_units
    if all_reduce_sum is not None:
        units = all_reduce_sum(units.clone())
    weights = aggregation_weights(mask, settings.agg_mode, traj, settings.horizon_tokens, total_units=units)
    width = mask.shape[1]
    old_full = scatter_response(old_logps, rows, width) if old_logps is not None else None
    ref_full = scatter_response(ref_logps, rows, width) if ref_logps is not None else None
    step = _MicroStep(model, settings, settings.entropy_coef != 0 or log_entropy, row_advantages, mask, weights,
                      old_full, ref_full, reference if ref_logps is None else None, world_size)
    sums: dict[str, float] = {}
    plan = plan_micro_batches([r.prompt_ids for r in rows], [r.num_tokens for r in rows], micro_tokens,
                              min_shared_tokens)
    total = equal_forwards(len(plan)) if equal_forwards is not None else len(plan)
    for k, mb in enumerate(plan):
        with _grad_sync(model, k == total - 1):
            step(mb, pad_rows([rows[i] for i in mb.rows], pad_id), sums)
    _dummy_steps(model, step.reference, pad_id, len(plan), total)
    tokens = max(sums.get("tokens", 0.0), 1.0)
    for key in ("pg/clip_frac", "pg/dual_clip_frac", "pg/ratio_mean", "pg/approx_kl"):
        if key in sums:
            sums[key] /= tokens
    return sums


def mini_batch_units(rows: Sequence[Row], settings: LossSettings, pad_id: int) -> torch.Tensor:
    """The loss denominator of a mini-batch of ``rows`` (0-d float64): tokens, rows or trajectories as
    ``settings.agg_mode`` counts them (:func:`memagent.rl.losses.aggregation_units`), over the same loss mask
    :func:`mini_batch_backward` uses."""
    full = pad_rows(rows, pad_id)
    mask = row_loss_mask(full.response_mask, torch.tensor([r.is_final for r in rows]), settings.mask_final)
    return aggregation_units(mask, settings.agg_mode, torch.tensor([r.traj_index for r in rows]))


def _dummy_steps(model, reference, pad_id: int, done: int, total: int) -> None:
    """FSDP: forward/backward passes with loss 0 on a 2-token row, from micro-batch ``done`` to ``total``, so this
    rank's collectives stay in step with the ranks that have more micro-batches."""
    for k in range(done, total):
        with _grad_sync(model, k == total - 1):
            if reference is not None:
                with torch.no_grad(), reference():
                    model(*dummy_batch(pad_id))
            logp, _ = model(*dummy_batch(pad_id))
            (logp.sum() * 0.0).backward()


@dataclass
class _MicroStep:
    """Forward, loss and backward of one micro-batch, adding its metrics to a running sum."""

    model: torch.nn.Module
    settings: LossSettings
    want_entropy: bool
    row_advantages: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    old_full: torch.Tensor | None
    ref_full: torch.Tensor | None
    reference: Callable[[], contextlib.AbstractContextManager] | None
    world_size: int

    def __call__(self, mb: MicroBatch, batch, sums: dict[str, float]) -> None:
        s, idx = self.settings, torch.tensor(mb.rows)
        w_cols = batch.response_mask.shape[1]
        tmask = self.mask[idx, :w_cols]
        extra = {"groups": mb.groups} if mb.groups is not None else {}
        ref = self.ref_full[idx, :w_cols] if self.ref_full is not None else None
        if self.reference is not None:
            with torch.no_grad(), self.reference():
                ref, _ = self.model(batch.input_ids, batch.attention_mask, False, tmask, **extra)
        logp, ent = self.model(batch.input_ids, batch.attention_mask, self.want_entropy, tmask, **extra)
        dev = logp.device
        m = tmask.to(dev)
        loss, metrics = policy_loss(
            logp, self.old_full[idx, :w_cols].to(dev) if self.old_full is not None else logp.detach(),
            self.row_advantages[idx].to(dev), self.weights[idx, :w_cols].to(dev), m,
            s.clip_low, s.clip_high, s.dual_clip, ref_logp=ref.to(dev) if ref is not None else None,
            kl_coef=s.kl_coef, kl_type=s.kl_type, entropy=ent, entropy_coef=s.entropy_coef,
        )
        (loss * self.world_size).backward()
        _accumulate(sums, loss, metrics, ent, m)


def _accumulate(sums: dict[str, float], loss: torch.Tensor, metrics: dict, ent: torch.Tensor | None,
                mask: torch.Tensor) -> None:
    """Add one micro-batch's loss and metrics to ``sums``: loss terms summed, token means weighted by the
    micro-batch's token count (divided by the total at the end), the entropy as a plain token sum."""
    n = float(mask.sum())
    if ent is not None:  # plain token sum, so the logged entropy is a token mean whatever the aggregation
        sums["entropy/token_sum"] = sums.get("entropy/token_sum", 0.0) + float((ent.detach() * mask).sum())
    sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
    for key, val in metrics.items():
        scale = 1.0 if key in ("pg/loss", "kl/mean", "entropy/mean") else n
        sums[key] = sums.get(key, 0.0) + float(val) * scale
    sums["tokens"] = sums.get("tokens", 0.0) + n


def _grad_sync(model: torch.nn.Module, sync: bool):
    """Context in which a backward reduces gradients over ranks only if ``sync`` (the last micro-batch):
    DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``; a no-op for a plain module."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
