"""How one tensor is saved from this rank: its local data, where that sits in the global
tensor, and which rank writes it.

Across ranks (``SavedTensor.writer``):

- a DTensor (FSDP2 ``fully_shard``, tensor parallel) is saved as its local shard plus the
  shard's offsets in the global tensor; an empty local shard (uneven ``torch.chunk`` sharding)
  is not saved; of several replicas of one shard (HSDP), only the first on each replicated
  mesh dimension saves it;
- a plain tensor of a module or optimizer, or a fully replicated DTensor, is assumed to be the
  same on every rank (DDP) and is written once, by the rank the plan assigns it to;
- tensors of the other keys (data loader, scheduler, ``extra``...) are written by rank 0 only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ckptctl.errors import StateError

# Who writes a tensor (SavedTensor.writer): each rank its own piece, one rank chosen by size
# balancing, rank 0 only, or nobody here (empty shard, or another replica writes it).
LOCAL, REPLICATED, RANK0, NONE = "local", "replicated", "rank0", "none"


@dataclass(frozen=True)
class SavedTensor:
    """A tensor to save: the local data and where it sits in the global tensor."""

    data: torch.Tensor  # this rank's local piece (the whole tensor when not sharded)
    group: str  # "model", "optimizer" or "other"
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    writer: str = LOCAL  # LOCAL, REPLICATED, RANK0 or NONE (see above)



def saved_tensor(t: torch.Tensor, group: str, shared_writer: str) -> SavedTensor:
    """How one tensor is saved from this rank. ``shared_writer`` applies to tensors every rank
    holds whole (REPLICATED or RANK0); DTensors are saved by their placements."""
    if not isinstance(t, DTensor):
        t = t.detach()
        return SavedTensor(t, group, tuple(t.shape), tuple(0 for _ in t.shape), shared_writer)
    # Detaching the local shard, not the DTensor: the same memory, without a DTensor dispatch
    # per tensor on the training thread (thousands of tensors per save).
    local = _local_of(t).detach()
    shape, placements = tuple(t.shape), tuple(t.placements)
    offsets, first_replica, replicated = _placement(shape, t.device_mesh, placements)
    if replicated:
        return SavedTensor(local, group, shape, offsets, shared_writer)
    writer = LOCAL if first_replica and local.numel() > 0 else NONE
    return SavedTensor(local, group, shape, offsets, writer)


def _local_of(t: DTensor) -> torch.Tensor:
    # ``to_local()`` is an autograd Function (~8 us per call), which buys nothing here: the
    # result is detached. The DTensor's own local tensor is the same memory. Private, so only
    # used where torch still has it.
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


@functools.lru_cache(maxsize=1 << 16)
def _placement(shape: tuple[int, ...], mesh: Any, placements: tuple) -> tuple[tuple[int, ...], bool, bool]:
    """(global offsets of this rank's shard, whether this rank holds the first replica of it,
    whether the tensor is fully replicated). Cached: the same for every save of a structure."""
    if any(not isinstance(p, (Shard, Replicate)) for p in placements):
        raise StateError(
            f"DTensor with placements {placements} cannot be saved: only Shard and Replicate are supported",
            hint="reduce Partial placements (e.g. dtensor.redistribute) before saving",
        )
    if all(isinstance(p, Replicate) for p in placements):
        return tuple(0 for _ in shape), True, True
    _, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    coord = mesh.get_coordinate() or []
    # Of the replicas of this shard (HSDP's replicate dimension), the first one writes it.
    first = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
    return tuple(int(o) for o in offsets), first, False


