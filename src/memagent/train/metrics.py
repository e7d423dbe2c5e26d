"""A training step's metrics: rewards, conversations, tokens, the loss terms and throughput, over all processes."""

from __future__ import annotations

from typing import Any

import torch

from memagent.rl.multiconv import conversations_per_trajectory
from memagent.train.distributed import all_reduce_max, all_reduce_sum

#: Metrics of :func:`memagent.train.update.mini_batch_backward` that are means over this process's response tokens.
TOKEN_MEANS = ("pg/clip_frac", "pg/dual_clip_frac", "pg/ratio_mean", "pg/approx_kl")


def reduce_mini_batch(m: dict[str, float]) -> dict[str, float]:
    """One mini-batch's metrics over all processes: loss terms and token sums are summed (each process's
    loss is its share of the global loss: the aggregation weights use the global unit counts), token means are
    re-weighted by each process's token count. Every process calls this (a collective)."""
    keys = sorted(m)
    tokens = m.get("tokens", 0.0)
    red = all_reduce_sum(torch.tensor([m[k] * tokens if k in TOKEN_MEANS else m[k] for k in keys], dtype=torch.float64))
    total = max(float(red[keys.index("tokens")]), 1.0) if "tokens" in keys else 1.0
    return {k: float(v) / total if k in TOKEN_MEANS else float(v) for k, v in zip(keys, red.tolist())}


def step_metrics(step: int, ro, rewards: torch.Tensor, groups: torch.Tensor, row_traj: torch.Tensor, ent,
                 adv_metrics: dict[str, Any], sums: dict[str, float], norms: list[float], lr: float, update_s: float,
                 mini_batches: int, skipped_updates: int) -> dict[str, float]:
    """The metrics row of one training step (a collective under torchrun: sums and maxima over processes).

    Args:
        step: the step number after the update.
        ro: the step's :class:`memagent.train.rollout.Rollout`.
        rewards, groups: ``(N,)`` reward and global group id of each trajectory.
        row_traj: ``(R,)`` trajectory of each row.
        ent: per row ``(T_resp,)`` entropies from the old-policy pass, or ``None`` (then from the training forward).
        adv_metrics: from :func:`memagent.rl.advantages.group_advantages`.
        sums: the mini-batches' metrics, summed.
        norms: gradient norm of every mini-batch.
        lr: the learning rate of the step.
        update_s: seconds of the update.
        mini_batches: ``rl.mini_batches``.
        skipped_updates: optimizer steps skipped so far (non-finite gradient norm).
    """
    nb = max(1, mini_batches)
    conv = conversations_per_trajectory(row_traj, len(ro.rewards)).float()
    group_best = torch.zeros(int(groups.max()) + 1).scatter_reduce_(0, groups, rewards, "amax", include_self=False)
    red = all_reduce_sum(torch.tensor([
        float(rewards.sum()), float((rewards >= 1).sum()), float(len(rewards)), float(conv.sum()),
        float(ro.response_tokens), float((group_best[torch.unique(groups)] >= 1).sum()),
        float(torch.unique(groups).numel()),
        sum(float(e.sum()) for e in ent) if ent is not None else 0.0, sum(len(e) for e in ent) if ent is not None else 0,
    ], dtype=torch.float64))
    if ent is not None:
        entropy = float(red[7] / max(1.0, float(red[8])))
    else:  # from the training forward (already summed over ranks): the same token mean, whatever rl.agg_mode
        entropy = sums.get("entropy/token_sum", 0.0) / max(1.0, sums.get("tokens", 0.0))
    conv_min, conv_max = -all_reduce_max(-int(conv.min())), all_reduce_max(int(conv.max()))
    m = {
        "step": step, "lr": lr,
        "reward/mean": float(red[0] / red[2]), "reward/accuracy": float(red[1] / red[2]),
        "reward/group_pass": float(red[5] / red[6]),
        "conv/per_traj_mean": float(red[3] / red[2]), "conv/per_traj_min": float(conv_min),
        "conv/per_traj_max": float(conv_max),
        "response_tokens/mean": float(red[4] / red[3]),
        "entropy/mean": entropy,
        "grad_norm": float(sum(norms) / len(norms)) if norms else 0.0, "skipped_updates": skipped_updates,
        "time/rollout_s": ro.seconds, "time/update_s": update_s,
        "tokens/rollout_per_s": ro.response_tokens / max(ro.seconds, 1e-9),
        "tokens/update_per_s": sum(r.num_tokens for r in ro.rows) / max(update_s, 1e-9),
    }
    m.update({k: float(v) for k, v in adv_metrics.items()})
    for k in ("loss", "pg/loss", "kl/mean", *TOKEN_MEANS):
        if k in sums:
            m[k] = sums[k] / nb
    if "update/rows_kept_frac" in sums:  # the share of rows the update computed (< 1: rl.drop_uniform_groups)
        m["update/rows_kept_frac"] = sums["update/rows_kept_frac"]
    return m
