"""Tensor memory as bytes: a zero-copy byte view of a tensor, and one reusable buffer viewed
as tensors of any dtype and shape. Readers fill these views with ranged reads and hash them
without copying; writers stream them. (The byte view of plain ``bytes`` objects, without torch,
is ``storage.base.byte_view``.)"""

from __future__ import annotations

import math

import torch

from ckptctl.format import dtypes


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype), without copying."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class TensorBuffer:
    """One reusable byte buffer, grown to the largest request seen, viewed as each tensor."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def view(self, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The first bytes of the buffer as a contiguous tensor of ``dtype`` (a manifest dtype
        name) and ``shape``; valid until the next call."""
        n = math.prod(shape) * dtypes.itemsize(dtype)
        if self._buf.numel() < n:
            self._buf = torch.empty(0, dtype=torch.uint8)  # free the old one before growing
            self._buf = torch.empty(n, dtype=torch.uint8)
        return self._buf[:n].view(dtypes.torch_dtype(dtype)).view(shape)

