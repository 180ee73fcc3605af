"""Host staging: the one copy made on the training thread.

One reusable uint8 buffer laid out exactly like the shard's data section, so the writer thread
writes it to storage as it is, with no second copy. It is allocated once and reused while it is
large enough; for accelerator tensors it is pinned (page-locked) so device-to-host copies run
at full bandwidth and can be issued asynchronously on a side stream.

The first snapshot pays for faulting the buffer's pages in. On Linux the (unpinned) buffer is
an anonymous mapping advised MADV_HUGEPAGE, so that costs one fault per 2 MiB instead of per
4 KiB: measured on the 2-core dev VM, a first 1 GiB copy took 830 ms into ``torch.empty``
memory, 144 ms into a huge-page mapping, and 66 ms into already-faulted memory. On a loaded
machine with fragmented memory the kernel may compact memory to find huge pages, and single
first saves were seen slower than without; set ``CKPTCTL_HUGEPAGES=0`` to use ordinary pages.
"""

from __future__ import annotations

import mmap
import os

import torch

from ckptctl.save.plan import Plan, view
from ckptctl.state.capture import SavedTensor


class StagingBuffer:
    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._stream: "torch.cuda.Stream | None" = None

    def reserve(self, plan: Plan) -> torch.Tensor:
        """A buffer of at least ``plan.nbytes``, reused while it is large enough: only the first
        snapshot faults pages in; later ones copy into resident memory (the steady stall)."""
        pin = plan.needs_pinned and torch.cuda.is_available()
        if self._buf is None or self._buf.numel() < plan.nbytes or self._pinned != pin:
            self._buf = None  # free the old one before allocating its replacement
            self._buf = _allocate(max(plan.nbytes, 1), pin)
            self._pinned = pin
        return self._buf

    def snapshot(self, plan: Plan, tensors: dict[str, SavedTensor]) -> torch.Tensor:
        """Copy every tensor into the buffer; returns when the copies are complete, so the
        training loop may modify its tensors as soon as this returns."""
        buf = self.reserve(plan)
        if not plan.needs_pinned:
            for slot in plan.slots:
                view(buf, slot).copy_(tensors[slot.name].data)
            return buf
        self._snapshot_device(plan, tensors, buf)
        return buf

    def _snapshot_device(self, plan: Plan, tensors: dict[str, SavedTensor], buf: torch.Tensor) -> None:
        # Copies go on a side stream that first waits for the compute stream (so pending
        # kernels that write the tensors finish first); non_blocking D2H into pinned memory
        # overlaps copies; one synchronize at the end makes the snapshot consistent.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for slot in plan.slots:
                src = tensors[slot.name].data
                view(buf, slot).copy_(src, non_blocking=src.device.type == "cuda")
        self._stream.synchronize()

    def release(self) -> None:
        self._buf = None
        self._stream = None


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < (2 << 20) or os.environ.get("CKPTCTL_HUGEPAGES", "1") == "0":
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # THP disabled in this kernel: ordinary pages still work
        pass
    # The tensor keeps ``region`` alive; the mapping is unmapped when the tensor is freed.
    return torch.frombuffer(region, dtype=torch.uint8)
