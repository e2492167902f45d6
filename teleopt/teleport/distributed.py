"""Teleporting under ``torch.distributed``: every rank ends a teleport with identical parameters.

DDP all-reduces gradients only; any other change of the parameters must be
identical on every rank (CONVENTIONS.md section 1).  A teleport is made
rank-consistent by

* broadcasting the chosen group coordinates from rank 0 (each rank searched on
  its own gradients, which DDP already made identical; the broadcast removes any
  doubt, e.g. data-dependent objectives on per-rank batches), so every rank
  applies the same element with the same deterministic arithmetic;
* evaluating general-path teleports on rank 0's batch everywhere (a
  data-dependent action is exact on the batch it was computed for, so every rank
  must use the same one), broadcasting the moved tensors from rank 0 as a
  guard, and averaging fresh gradients at the teleported point over ranks, as DDP
  would;
* taking the accept/rollback decision jointly (any rank rejects: all roll back).

FSDP2 (``fully_shard``) shards every parameter across ranks (``DTensor``), so no
rank holds the whole tensors a group action transforms.  A teleport of diagonal
sites stays on the shards: the search reads per-unit gradient statistics reduced
on each shard and communicated (O(units)), and each rank moves its own shards by
the replicated elements.  Other sites are gathered whole on every rank
(``DTensor.full_tensor()``; transiently the full size of the site members), moved
identically there, and each rank writes its own shard back
(:class:`~teleopt.teleport.fast_path.FastEvaluator`).  Either way the search runs
on identical inputs everywhere, the coordinates are broadcast and
:func:`check_identical` verifies the elements; the caps use the loss averaged
over ranks (:func:`rank_mean`), so their decisions, and the collectives they
make, agree on every rank.  The
invariance check runs the sharded model's forward pass, on every rank.  FSDP1's
``FullyShardedDataParallel`` flattens parameters into one buffer, so site
members have no names: :func:`check_supported_sharding` refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from teleopt.functional import Batch

__all__ = [
    "is_distributed",
    "rank_mean",
    "check_supported_sharding",
    "broadcast_",
    "broadcast_batch",
    "all_reduce_mean_",
    "any_rank",
    "check_identical",
]


def is_distributed() -> bool:
    """Whether a default process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_supported_sharding(model: nn.Module) -> None:
    """Raise ``TypeError`` if ``model`` uses FSDP1 (``FullyShardedDataParallel``: flat parameters have no site names).

    FSDP2 (``fully_shard``, ``DTensor`` parameters) and DDP are supported.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without distributed
        return
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            raise TypeError(
                "Teleport does not support FSDP1 (FullyShardedDataParallel): it flattens the parameters into one "
                "buffer per unit, so a site's tensors have no names. Use FSDP2 (torch.distributed.fsdp.fully_shard) "
                "or DistributedDataParallel."
            )


@torch.no_grad()
def broadcast_(tensors: Sequence[Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s values (no-op when not distributed)."""
    if not is_distributed() or not tensors:
        return
    for t in tensors:
        buf = t.detach().contiguous()
        dist.broadcast(buf, src=src)
        if buf.data_ptr() != t.data_ptr():
            t.copy_(buf)


@torch.no_grad()
def broadcast_batch(batch: Batch, src: int = 0) -> Batch:
    """Rank ``src``'s teleport batch on every rank (tensors of the same shape on all ranks)."""
    if not is_distributed():
        return batch

    def bcast(x: Any) -> Any:
        if isinstance(x, Tensor):
            buf = x.detach().clone().contiguous()
            dist.broadcast(buf, src=src)
            return buf
        if isinstance(x, (tuple, list)):
            return type(x)(bcast(v) for v in x)
        if isinstance(x, dict):  # keyword inputs and dict targets, in the same key order on every rank
            return type(x)((k, bcast(v)) for k, v in x.items())
        return x

    return Batch(bcast(batch.inputs), bcast(batch.target), None if batch.kwargs is None else bcast(batch.kwargs))


@torch.no_grad()
def all_reduce_mean_(tensors: Sequence[Tensor]) -> None:
    """Average ``tensors`` over ranks in place (no-op when not distributed)."""
    if not is_distributed():
        return
    world = dist.get_world_size()
    for t in tensors:
        buf = t.detach().contiguous()
        dist.all_reduce(buf)
        buf.div_(world)
        if buf.data_ptr() != t.data_ptr():
            t.copy_(buf)


def any_rank(flag: bool, device: torch.device | str | None = None) -> bool:
    """True if ``flag`` is true on any rank (``device``: where the backend communicates, e.g. CUDA for NCCL)."""
    if not is_distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def rank_mean(value: float, device: torch.device | str | None = None) -> float:
    """The mean of ``value`` over ranks (``value`` itself outside ``torch.distributed``), in float64."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


@torch.no_grad()
def check_identical(tensors: Sequence[Tensor], what: str) -> None:
    """Raise ``RuntimeError`` unless ``tensors`` are bitwise identical on every rank (no-op when not distributed).

    One all-reduce (MAX) of the values and their negatives: the largest and the
    smallest value over ranks agree exactly iff every rank holds the same numbers.
    Meant for small tensors such as group elements.
    """
    if not is_distributed() or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    both = torch.cat([flat, -flat])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[: flat.numel()], -both[flat.numel() :]
    if not bool(((high == low) | (high.isnan() & low.isnan())).all()):
        raise RuntimeError(f"Teleport: the {what} differ across ranks; every rank must apply the same teleport")
