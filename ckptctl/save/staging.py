"""Host staging: the one copy made on the training thread.

One reusable uint8 buffer laid out exactly like the shard's data section, so the writer thread
writes it to storage as it is, with no second copy. It is allocated once and reused while it is
large enough; for accelerator tensors it is pinned (page-locked) so device-to-host copies run
at full bandwidth and can be issued asynchronously on a side stream.
"""

from __future__ import annotations

import torch

from ckptctl.save.plan import Plan, view
from ckptctl.state.capture import SavedTensor


class StagingBuffer:
    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._stream: "torch.cuda.Stream | None" = None

    def reserve(self, plan: Plan) -> torch.Tensor:
        """A buffer of at least ``plan.nbytes``. Its pages are faulted in by the first snapshot
        only; every later snapshot copies into resident memory (the steady-state stall)."""
        pin = plan.needs_pinned and torch.cuda.is_available()
        if self._buf is None or self._buf.numel() < plan.nbytes or self._pinned != pin:
            self._buf = None  # free the old one before allocating its replacement
            self._buf = torch.empty(max(plan.nbytes, 1), dtype=torch.uint8, pin_memory=pin)
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
