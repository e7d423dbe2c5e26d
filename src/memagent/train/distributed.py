"""Multi-process training with ``torchrun``: process group, DDP wrapping, reductions.

Launch (CPU, two processes on one machine; gloo)::

    torchrun --nproc_per_node 2 -m memagent.train.cli --config configs/train_cpu_small.yaml

On GPUs the same command uses NCCL and one GPU per process (``LOCAL_RANK``); across machines add
``--nnodes N --node_rank K --rdzv_endpoint HOST:PORT``. Every rank rolls out its own share of the step's
questions (``prompts_per_step / world_size``, whole GRPO groups), computes its rows' log-probabilities and
gradients, and DDP averages the gradients; the loss's aggregation units are summed over ranks first so the
result equals one process training on all rows (tested).

With ``run.distributed=fsdp`` the policy and the reference model are sharded with FSDP2 instead
(:func:`shard_fsdp`: ``torch.distributed.fsdp.fully_shard`` on every decoder layer, then on the
:class:`~memagent.train.batching.TokenLogProbs` wrapper as the root), so each rank holds ``1 / world_size`` of
the parameters, gradients and AdamW state. Three things make this work with a memory agent's rollouts:

- Rollouts run on an unsharded copy of the policy (one per rank, no gradients, no optimizer state). Ranks
  generate different numbers of tokens, and a forward on the sharded module all-gathers in every layer, so
  generating on it would deadlock. After each training step's optimizer steps the full weights are
  gathered (``get_model_state_dict(full_state_dict=True)``) and loaded into the copy.
- Scoring and training passes run the same number of forwards on every rank: each pass first agrees on the
  largest micro-batch count (:func:`all_reduce_max`), and a rank with fewer micro-batches runs forwards (and
  backwards with loss 0) on a 2-token dummy row.
- Checkpoints hold full (unsharded) state dicts in the single-process layout, written by rank 0
  (``torch.distributed.checkpoint.state_dict``), so a run saved under FSDP resumes under DDP or in one
  process and the other way round.

Tested on CPU with gloo: 2 FSDP processes give the same gradients and weights as 1 process. The reference
trains 7B with FSDP parameter and optimizer offload on 32 GPUs (reference-memagent.md §4.1); CPU offload and
mixed-precision policies are not wired up here.
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


def init_distributed(timeout_s: float | None = None) -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1), else run single-process.

    Uses NCCL with one GPU per local rank when CUDA is available, gloo on CPU. ``timeout_s``: how long a
    collective waits (``None``: torch's default, 10 minutes with NCCL and 30 with gloo).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(device="cuda" if torch.cuda.is_available() else "cpu")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group(backend="nccl" if cuda else "gloo",
                                timeout=timedelta(seconds=timeout_s) if timeout_s is not None else None)
    return DistInfo(rank, world, local, f"cuda:{local}" if cuda else "cpu")


def wrap_ddp(module: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """DistributedDataParallel around ``module`` when distributed, else ``module`` itself."""
    if not info.enabled:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.local_rank] if info.device.startswith("cuda") else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def all_reduce_max(n: int) -> int:
    """The largest ``n`` over ranks (``n`` itself when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([n], dtype=torch.int64, device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())
    return n


def _comm_device() -> str:
    """Where collective tensors must live: NCCL reduces CUDA tensors only, gloo CPU ones."""
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def shard_fsdp(scorer: torch.nn.Module) -> torch.nn.Module:
    """Shard a :class:`~memagent.train.batching.TokenLogProbs` with FSDP2, in place: one FSDP unit per
    decoder layer (``scorer.model.model.layers``, the transformers layout), the rest (embeddings, final norm,
    tied LM head) in the root unit on ``scorer``, whose ``forward`` is the one the trainer calls.

    Raises:
        ConfigError: the model has no ``model.layers`` list of decoder layers.
    """
    from torch.distributed.fsdp import fully_shard

    from memagent.errors import ConfigError

    layers = getattr(getattr(scorer.model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ConfigError(f"run.distributed=fsdp: cannot find the decoder layers of {type(scorer.model).__name__} "
                          "(expected model.model.layers); use run.distributed=ddp")
    for layer in layers:
        fully_shard(layer)
    fully_shard(scorer)
    return scorer


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (identity when not distributed); returns ``t``. ``t`` may live on the CPU
    under NCCL too: it is reduced on the GPU and copied back."""
    if dist.is_available() and dist.is_initialized():
        dev = _comm_device()
        if t.device == torch.device(dev):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        else:
            moved = t.to(dev)
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            t.copy_(moved)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
