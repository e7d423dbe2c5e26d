"""Pure RL algorithm code: tensors in, ``(loss, metrics)`` out; no config objects, no I/O."""

from memagent.rl.advantages import group_advantages
from memagent.rl.kl import KL_TYPES, kl_penalty
from memagent.rl.losses import AGG_MODES, aggregation_units, aggregation_weights, clipped_pg_loss, policy_loss
from memagent.rl.multiconv import broadcast_advantages, check_rows, conversations_per_trajectory, row_loss_mask

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "aggregation_units",
    "aggregation_weights",
    "broadcast_advantages",
    "check_rows",
    "clipped_pg_loss",
    "conversations_per_trajectory",
    "group_advantages",
    "kl_penalty",
    "policy_loss",
    "row_loss_mask",
]
