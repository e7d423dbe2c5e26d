"""Multi-conversation credit assignment: one trajectory, many training rows.

A MemAgent trajectory is ``c`` independent conversations: ``c - 1`` memory updates and one final answer.
Only the final answer is rewarded; every conversation of the trajectory is trained with that trajectory's
advantage. Rows are identified by ``row_traj_index`` (row -> trajectory) and ``is_final`` (the row that
carries the reward).

Source: reference-memagent.md §4.4 (``final_mask``, ``sample_index``), §4.7 step 6, §4.10.
"""

from __future__ import annotations

import torch

from memagent.errors import DataError


def check_rows(row_traj_index: torch.Tensor, is_final: torch.Tensor, num_trajectories: int) -> None:
    """Check that every trajectory has exactly one final row and indices are in range.

    Args:
        row_traj_index: ``(R,)`` trajectory index of each row, in ``[0, num_trajectories)``.
        is_final: ``(R,)`` bool, True for a trajectory's final-answer row.
        num_trajectories: N.

    Raises:
        DataError: shape mismatch, an index out of range, or a trajectory without exactly one final row.
    """
    if row_traj_index.dim() != 1 or is_final.shape != row_traj_index.shape:
        raise DataError(
            f"row_traj_index and is_final must be 1-D of equal length, got {tuple(row_traj_index.shape)} "
            f"and {tuple(is_final.shape)}"
        )
    if row_traj_index.numel() and (int(row_traj_index.min()) < 0 or int(row_traj_index.max()) >= num_trajectories):
        raise DataError(f"row_traj_index must lie in [0, {num_trajectories}), got values outside")
    finals = torch.zeros(num_trajectories, dtype=torch.long).index_add_(
        0, row_traj_index[is_final.bool()], torch.ones(int(is_final.sum()), dtype=torch.long)
    )
    bad = (finals != 1).nonzero().flatten().tolist()
    if bad:
        raise DataError(f"trajectories {bad[:5]} do not have exactly one final row; every trajectory needs one")


def broadcast_advantages(traj_advantages: torch.Tensor, row_traj_index: torch.Tensor) -> torch.Tensor:
    """Give every row (conversation) the advantage of its trajectory.

    Args:
        traj_advantages: ``(N,)`` one advantage per trajectory.
        row_traj_index: ``(R,)`` trajectory index of each row.

    Returns:
        ``(R,)`` row advantages, ``traj_advantages[row_traj_index]``.

    Source: reference-memagent.md §4.7 step 6.
    """
    return traj_advantages[row_traj_index.long()]


def row_loss_mask(response_mask: torch.Tensor, is_final: torch.Tensor, mask_final: bool = False) -> torch.Tensor:
    """Token loss mask of every row, optionally without the final-answer rows.

    Args:
        response_mask: ``(R, T)`` 1 on generated tokens that are trained, 0 on prompt and padding.
        is_final: ``(R,)`` bool flag of final-answer rows.
        mask_final: if True, final-answer rows get an all-zero mask, so only the memory updates are trained
            (an ablation; the reference trains both).

    Returns:
        ``(R, T)`` float mask.
    """
    mask = response_mask.to(torch.float32)
    if mask_final:
        mask = mask * (~is_final.bool()).to(mask.dtype).unsqueeze(-1)
    return mask


def conversations_per_trajectory(row_traj_index: torch.Tensor, num_trajectories: int) -> torch.Tensor:
    """``(N,)`` number of rows (conversations) of each trajectory."""
    return torch.bincount(row_traj_index.long(), minlength=num_trajectories)
