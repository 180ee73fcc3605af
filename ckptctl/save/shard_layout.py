"""Where each tensor goes in a rank's shard, decided once and reused while the state's
structure does not change.

Tensors are laid out by element size, largest first, then by name: every offset is then a
multiple of its tensor's element size (so the staging buffer can be viewed as each dtype), and
the layout does not depend on dict order.

In the host staging buffer, a tensor copied from an accelerator starts at a multiple of
``settings.STAGING_ALIGN`` (``Slot.host``): the copy engine's destination is then aligned. The
shard on disk stays packed (its entries must tile the data section); the writer gathers the
file's bytes from the buffer (``file_pieces``), without a copy wherever the buffer is
contiguous.

Across ranks, the layout also decides who writes what (``assign_replicated``): every rank's own
DTensor shards, and for tensors that every rank holds whole, exactly one writer chosen by size
balancing. The choice is a pure function of the names and sizes, which every rank sees alike,
so all ranks agree without communicating; the coordinator checks the result once per layout
(every tensor covered exactly, see ``coordination``).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ckptctl import settings
from ckptctl.format import dtypes
from ckptctl.state.placement import NONE, RANK0, REPLICATED, SavedTensor


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]  # the local piece's shape
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    group: str
    begin: int  # the bytes [begin, end) of the shard's data section
    end: int
    host: int | None = None  # where they start in the host staging buffer, when not at ``begin``

    @property
    def staged(self) -> int:
        """Offset of this slot's bytes in the host staging buffer."""
        return self.begin if self.host is None else self.host


@dataclass(frozen=True)
class GlobalTensor:
    """What the manifest says of one global tensor; the same on every rank."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    group: str


@dataclass(frozen=True)
class ShardLayout:
    slots: tuple[Slot, ...]
    nbytes: int
    signature: tuple  # what must not change for the layout to be reused
    needs_pinned: bool  # any tensor lives on an accelerator
    # Every global tensor of the state, sorted by name (whether or not this rank writes it),
    # and a digest of that table: ranks compare digests, never the tables themselves.
    table: tuple[GlobalTensor, ...] = ()
    structure: str = ""
    # Per table entry, (chunks, elements, regular, owner + 1) this rank writes: summed over
    # ranks by the coordinator to count each tensor's chunks, check that it is covered
    # exactly, and derive the manifest's placement hints (``placement_columns``).
    coverage: tuple[tuple[int, int, int, int], ...] = field(default=(), repr=False)
    staged_nbytes: int | None = None  # size of the host staging buffer, when not ``nbytes``

    @property
    def buffer_nbytes(self) -> int:
        """Bytes of host staging buffer this layout needs (``nbytes`` plus alignment padding)."""
        return self.nbytes if self.staged_nbytes is None else self.staged_nbytes


def signature_of(tensors: dict[str, SavedTensor]) -> tuple:
    """Cheap structural fingerprint: names, dtypes, shapes, placement. No data is read."""
    return tuple(
        (n, t.data.dtype, tuple(t.data.shape), t.data.device.type, t.global_shape, t.offsets, t.group, t.writer)
        for n, t in tensors.items()
    )


def assign_replicated(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Writer rank for each replicated tensor: largest first, each to the least loaded rank
    (ties to the lower rank). Deterministic from names and sizes alone."""
    loads = [(0, r) for r in range(world_size)]  # a heap of (bytes, rank)
    out: dict[str, int] = {}
    for name, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        load, r = heapq.heappop(loads)
        out[name] = r
        heapq.heappush(loads, (load + n, r))
    return out


def writes_here(tensors: dict[str, SavedTensor], rank: int, world_size: int) -> dict[str, SavedTensor]:
    """The tensors this rank writes into its shard."""
    replicated = {n: t.data.numel() * t.data.element_size() for n, t in tensors.items() if t.writer == REPLICATED}
    owner = assign_replicated(replicated, world_size) if world_size > 1 else {}
    out = {}
    for n, t in tensors.items():
        if t.writer == NONE:
            continue
        if world_size > 1 and t.writer == RANK0 and rank != 0:
            continue
        if t.writer == REPLICATED and owner.get(n, 0) != rank:
            continue
        out[n] = t
    return out


def make_layout(
    tensors: dict[str, SavedTensor], signature: tuple | None = None, *, rank: int = 0, world_size: int = 1,
    align: int | None = None,
) -> ShardLayout:
    """``align``: where accelerator tensors start in the host buffer (default
    ``settings.STAGING_ALIGN``, a power of two; host tensors stay packed)."""
    align = settings.STAGING_ALIGN if align is None else align
    if align < 1 or align & (align - 1):
        raise ValueError(f"make_layout: alignment {align} is not a power of two")
    mine = writes_here(tensors, rank, world_size)
    order = sorted(mine.items(), key=lambda kv: (-kv[1].data.element_size(), kv[0]))
    slots, pos, at = [], 0, 0  # at: the host buffer's offset, >= pos once padding was added
    for name, t in order:
        n = t.data.numel() * t.data.element_size()
        if t.data.device.type != "cpu":
            # A power of two >= 1: the offset stays a multiple of every smaller element size.
            at = -(-at // align) * align
        host = at if at != pos else None
        slots.append(Slot(name, dtypes.name_of(t.data.dtype), tuple(t.data.shape), t.global_shape, t.offsets, t.group, pos, pos + n, host))
        pos, at = pos + n, at + n
    table = tuple(
        GlobalTensor(n, dtypes.name_of(t.data.dtype), tuple(t.global_shape), t.group) for n, t in sorted(tensors.items())
    )
    coverage = tuple(
        (1, mine[m.name].data.numel(), *placement_columns(mine[m.name], rank, world_size)) if m.name in mine else (0, 0, 0, 0)
        for m in table
    )
    return ShardLayout(
        slots=tuple(slots),
        nbytes=pos,
        signature=signature if signature is not None else signature_of(tensors),
        needs_pinned=any(t.data.device.type != "cpu" for t in mine.values()),
        table=table,
        structure=structure_digest(table),
        coverage=coverage,
        staged_nbytes=at if at != pos else None,
    )


def placement_columns(t: SavedTensor, rank: int, world_size: int) -> tuple[int, int]:
    """(regular, owner + 1) for the chunk this rank writes of ``t``. ``regular`` is 1 when the
    chunk is exactly rank ``rank``'s block of an even split of dim 0 (FSDP2 ``Shard(0)``:
    rows [r*b, (r+1)*b), b = ceil(rows / world_size)); ``owner + 1`` is nonzero when it is the
    whole tensor. Summed over ranks, they prove a placement rule for every chunk at once, so
    rank 0 records it in the manifest from O(tensors) numbers (``coordination``)."""
    shape, local, offs = tuple(t.global_shape), tuple(t.data.shape), tuple(t.offsets)
    owner = rank + 1 if local == shape and not any(offs) else 0
    regular = 0
    if shape and shape[0] > 0:
        b = -(-shape[0] // max(world_size, 1))
        rows = max(0, min(b, shape[0] - rank * b))
        regular = int(local == (rows, *shape[1:]) and offs == (rank * b, *(0,) * (len(shape) - 1)))
    return regular, owner


def placement_hints(shape: tuple[int, ...], chunks: int, regular: int, owner1: int, world_size: int) -> tuple[int | None, tuple[int, int] | None]:
    """The manifest's (owner, split) for one tensor from the ranks' summed placement columns,
    once coverage is exact: one whole chunk names its owner; every chunk on its own rank's
    block of dim 0 proves the split."""
    owner = int(owner1) - 1 if chunks == 1 and owner1 > 0 else None
    if owner is None and chunks > 0 and regular == chunks and shape:
        return None, (0, -(-shape[0] // max(world_size, 1)))
    return owner, None


def structure_digest(table: tuple[GlobalTensor, ...]) -> str:
    h = hashlib.sha256()
    for m in table:
        h.update(f"{m.name}\0{m.dtype}\0{','.join(map(str, m.shape))}\0{m.group}\n".encode())
    return h.hexdigest()


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def view(buf: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The part of the uint8 staging buffer that holds ``slot``, viewed as its dtype and shape."""
    at = slot.staged
    return buf[at : at + slot.end - slot.begin].view(dtypes.torch_dtype(slot.dtype)).view(slot.shape)


def file_pieces(data: memoryview, layout: ShardLayout, piece: int) -> Iterator[tuple[int, memoryview]]:
    """The shard's data section, in file order, as ``(offset, bytes)`` pieces of at most
    ``piece`` bytes, read from the host staging buffer ``data``. Where the buffer holds the
    bytes contiguously (a packed layout; any tensor of at least ``piece // 16`` bytes) the
    pieces are views of it: no copy. Runs of smaller tensors separated by alignment padding
    are gathered into one scratch buffer, so they still go out in few large writes; such a
    piece is valid until the next one is asked for (consume it first)."""
    runs: list[tuple[int, int, int]] = []  # (file begin, buffer begin, length): contiguous in both
    for s in layout.slots:
        n = s.end - s.begin
        if runs and runs[-1][0] + runs[-1][2] == s.begin and runs[-1][1] + runs[-1][2] == s.staged:
            f, b, m = runs[-1]
            runs[-1] = (f, b, m + n)
        elif n:
            runs.append((s.begin, s.staged, n))
    small = piece // 16
    scratch = memoryview(bytearray(piece)) if any(m < small for _, _, m in runs) and len(runs) > 1 else None
    start, fill = 0, 0  # the gathered piece: its file offset and how many bytes it holds
    for f, b, m in runs:
        if scratch is None or m >= small:
            if fill:
                yield start, scratch[:fill]
                fill = 0
            for off in range(0, m, piece):
                yield f + off, data[b + off : b + min(off + piece, m)]
            continue
        if fill and fill + m > piece:
            yield start, scratch[:fill]
            fill = 0
        if not fill:
            start = f
        scratch[fill : fill + m] = data[b : b + m]
        fill += m
    if fill:
        yield start, scratch[:fill]
