"""Group-relative advantages (GRPO) from one scalar reward per trajectory.

Advantages are computed once per trajectory, before they are broadcast to the trajectory's conversations
(:mod:`memagent.rl.multiconv`), so a trajectory that read many chunks does not count more often in its
group's mean.

Source: reference-memagent.md §4.7 step 5 (``compute_1D_grpo_advantage``, ``grpo_use_adv=False``).
"""

from __future__ import annotations

from typing import Literal

import torch

from memagent.errors import DataError

SingletonRule = Literal["reward", "zero"]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    normalize_std: bool = False,
    eps: float = 1e-6,
    singleton: SingletonRule = "reward",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO advantages: each reward minus the mean reward of its group.

    Args:
        rewards: ``(N,)`` one scalar reward per trajectory.
        group_ids: ``(N,)`` integer id of each trajectory's group (the question it answers); ids need not
            be contiguous or sorted.
        normalize_std: also divide by the group's unbiased standard deviation plus ``eps`` (GRPO's original
            form; the reference runs without it, which is the default here).
        eps: added to the standard deviation before dividing.
        singleton: rule for a group of one trajectory, where mean and standard deviation are undefined.
            ``"reward"`` (the reference's rule): the group mean is taken as 0 and the std as 1, so the
            advantage is the raw reward (a REINFORCE step without baseline). ``"zero"``: advantage 0, the
            trajectory is left out of the policy gradient.

    Returns:
        ``(advantages (N,), metrics)``; metrics hold ``adv/mean``, ``adv/std``, ``adv/abs_max`` and
        ``adv/zero_frac`` (fraction of trajectories whose group had identical rewards) as 0-d tensors.

    Raises:
        DataError: shapes differ or are not 1-D, or ``singleton`` is unknown.

    Source: reference-memagent.md §4.7 step 5.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise DataError(
            f"rewards and group_ids must be 1-D of equal length, got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if singleton not in ("reward", "zero"):
        raise DataError(f"singleton must be 'reward' or 'zero', got {singleton!r}")
    scores = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(scores))
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, scores)
    means = sums / counts
    centered = scores - means[inverse]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centered**2)
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts[inverse] == 1
    if singleton == "reward":
        centered = torch.where(single, scores, centered)
        stds = torch.where(counts == 1, torch.ones_like(stds), stds)
    else:
        centered = torch.where(single, torch.zeros_like(scores), centered)
    adv = centered / (stds[inverse] + eps) if normalize_std else centered
    flat = (sq[inverse] == 0) & ~single
    metrics = {
        "adv/mean": adv.mean() if adv.numel() else adv.new_zeros(()),
        "adv/std": adv.std(unbiased=False) if adv.numel() else adv.new_zeros(()),
        "adv/abs_max": adv.abs().max() if adv.numel() else adv.new_zeros(()),
        "adv/zero_frac": flat.to(torch.float64).mean() if adv.numel() else adv.new_zeros(()),
    }
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32), metrics
