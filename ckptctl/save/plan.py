"""Where each tensor goes in a rank's shard, decided once and reused while the state's
structure does not change.

Tensors are laid out by element size, largest first, then by name: every offset is then a
multiple of its tensor's element size (so the staging buffer can be viewed as each dtype), and
the layout does not depend on dict order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ckptctl.format import dtypes
from ckptctl.state.capture import SavedTensor


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]  # the local piece's shape
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    group: str
    begin: int
    end: int


@dataclass(frozen=True)
class Plan:
    slots: tuple[Slot, ...]
    nbytes: int
    signature: tuple  # what must not change for the plan to be reused
    needs_pinned: bool  # any tensor lives on an accelerator


def signature_of(tensors: dict[str, SavedTensor]) -> tuple:
    """Cheap structural fingerprint: names, dtypes, shapes, placement. No data is read."""
    return tuple(
        (n, t.data.dtype, tuple(t.data.shape), t.data.device.type, t.global_shape, t.offsets, t.group)
        for n, t in tensors.items()
    )


def make_plan(tensors: dict[str, SavedTensor], signature: tuple | None = None) -> Plan:
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].data.element_size(), kv[0]))
    slots, pos = [], 0
    for name, t in order:
        n = t.data.numel() * t.data.element_size()
        slots.append(Slot(name, dtypes.name_of(t.data.dtype), tuple(t.data.shape), t.global_shape, t.offsets, t.group, pos, pos + n))
        pos += n
    return Plan(
        slots=tuple(slots),
        nbytes=pos,
        signature=signature if signature is not None else signature_of(tensors),
        needs_pinned=any(t.data.device.type != "cpu" for t in tensors.values()),
    )


def view(buf: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The part of the uint8 staging buffer that holds ``slot``, viewed as its dtype and shape."""
    return buf[slot.begin : slot.end].view(dtypes.torch_dtype(slot.dtype)).view(slot.shape)
