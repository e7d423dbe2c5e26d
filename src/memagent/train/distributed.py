"""Multi-process training with ``torchrun``: process group, DDP wrapping, reductions.

Launch (CPU, two processes on one machine; gloo)::

    torchrun --nproc_per_node 2 -m memagent.train.cli --config configs/train_cpu_small.yaml

On GPUs the same command uses NCCL and one GPU per process (``LOCAL_RANK``); across machines add
``--nnodes N --node_rank K --rdzv_endpoint HOST:PORT``. Every rank rolls out its own share of the step's
questions (``prompts_per_step / world_size``, whole GRPO groups), computes its rows' log-probabilities and
gradients, and DDP averages the gradients; the loss's aggregation units are summed over ranks first so the
result equals one process training on all rows (tested).

FSDP for large models: replace :func:`wrap_ddp` with ``torch.distributed.fsdp.fully_shard`` (FSDP2) applied
to each decoder layer and then to the whole :class:`~memagent.train.batching.TokenLogProbs` module, with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``; shard the frozen
reference model the same way (no optimizer state); save with ``torch.distributed.checkpoint``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` with full state on rank 0). The rollout engine
then needs gathered weights. Ranks generate different numbers of tokens, so generating with the sharded
module itself deadlocks: probed here with torch 2.13 and gloo, a forward on one rank still all-gathers in the
per-module hooks after ``unshard()`` on every FSDP module, while the other rank has stopped. Rollouts therefore
need an unsharded copy (in process, loaded from the full state dict after each step) or a separate inference
server (vLLM / an OpenAI-compatible engine behind the Backend protocol) that receives the weights. Scoring
passes (old/reference log-probs, mini-batches) must also run the same number of forwards on every rank. This path is not implemented or tested here (no GPUs); the reference trains 7B with FSDP
parameter and optimizer offload on 32 GPUs (reference-memagent.md §4.1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``; ``device`` it computes on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1), else run single-process.

    Uses NCCL with one GPU per local rank when CUDA is available, gloo on CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(device="cuda" if torch.cuda.is_available() else "cpu")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return DistInfo(rank, world, local, f"cuda:{local}" if cuda else "cpu")


def wrap_ddp(module: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """DistributedDataParallel around ``module`` when distributed, else ``module`` itself."""
    if not info.enabled:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.local_rank] if info.device.startswith("cuda") else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (identity when not distributed); returns the summed tensor."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
