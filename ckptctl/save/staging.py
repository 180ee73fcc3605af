"""Host staging: the one copy made on the training thread.

One reusable uint8 buffer laid out exactly like the shard's data section, so the writer thread
writes it to storage as it is, with no second copy. It is allocated once and reused while it is
large enough; for accelerator tensors it is pinned (page-locked) so device-to-host copies run
at full bandwidth and can be issued asynchronously on a side stream.

The first snapshot pays for faulting the buffer's pages in (or, for accelerator state, for
pinning them), unless ``prepare`` did that earlier on a background thread: the training job
calls ``Checkpointer.prepare`` (or ``load_latest`` does) long before its first save.

Ordinary pages by default. Huge pages (``CKPTCTL_HUGEPAGES=1``: an anonymous mapping advised
MADV_HUGEPAGE) fault in faster when the kernel has free ones, and much slower when it must
compact memory to find them: on the 2-core dev VM a first 1 GiB copy took 63 ms into huge pages
after a free, 500-1,700 ms when compaction was needed, and a steady ~200 ms into ordinary
pages (54 ms into resident memory). A predictable first save is worth more than a fast one
now and then, and steady copies were no faster on huge pages.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from concurrent.futures import Future

import torch

from ckptctl.save.plan import Plan, view
from ckptctl.state.capture import SavedTensor

log = logging.getLogger("ckptctl")


class StagingBuffer:
    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._stream: "torch.cuda.Stream | None" = None
        self._coming: "tuple[Future[torch.Tensor], bool] | None" = None  # (buffer, pinned) from prepare

    def prepare(self, plan: Plan) -> bool:
        """Allocate the buffer for ``plan`` and fault its pages in (or pin them) on a background
        thread, so that the next snapshot only copies. Returns False when there is nothing to
        do: a large enough buffer exists or is already being prepared."""
        pin = _wants_pinned(plan)
        if self._coming is not None or self._fits(plan, pin):
            return False
        self._buf = None  # the old one is too small: free it before allocating its replacement
        ready: "Future[torch.Tensor]" = Future()
        # The current CUDA device is per thread: pin under the caller's (the rank's own GPU),
        # never under the new thread's default, device 0.
        device = torch.cuda.current_device() if pin else None

        def work() -> None:
            try:
                with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                    ready.set_result(_fault_in(_allocate(max(plan.nbytes, 1), pin), pin))
            except (MemoryError, OSError, RuntimeError) as e:  # what mmap and torch raise
                ready.set_exception(e)

        threading.Thread(target=work, name="ckptctl-prefault", daemon=True).start()
        self._coming = (ready, pin)
        return True

    def reserve(self, plan: Plan) -> torch.Tensor:
        """A buffer of at least ``plan.nbytes``, reused while it is large enough: only the first
        snapshot faults pages in (unless prepared); later ones copy into resident memory."""
        if self._coming is not None:  # wait for the prepared buffer rather than make a second
            (ready, pinned), self._coming = self._coming, None
            try:
                self._buf, self._pinned = ready.result(), pinned
            except (MemoryError, OSError, RuntimeError) as e:
                log.warning("could not prepare the staging buffer in advance (%s); allocating it now", e)
        pin = _wants_pinned(plan)
        if not self._fits(plan, pin):
            self._buf = None  # free the old one before allocating its replacement
            self._buf = _allocate(max(plan.nbytes, 1), pin)
            self._pinned = pin
        assert self._buf is not None
        return self._buf

    @property
    def held(self) -> bool:
        """Whether a buffer is held or being prepared."""
        return self._buf is not None or self._coming is not None

    def _fits(self, plan: Plan, pin: bool) -> bool:
        return self._buf is not None and self._buf.numel() >= plan.nbytes and self._pinned == pin

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
        self._coming = None  # a background preparation finishes, then its buffer is freed


def _wants_pinned(plan: Plan) -> bool:
    return plan.needs_pinned and torch.cuda.is_available()


def _fault_in(buf: torch.Tensor, pinned: bool) -> torch.Tensor:
    """Touch one byte per page so the kernel backs the whole buffer now. Pinned memory is
    resident already. torch releases the GIL while it writes, so the training thread runs on."""
    if not pinned:
        buf[:: mmap.PAGESIZE].fill_(0)
    return buf


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < (2 << 20) or os.environ.get("CKPTCTL_HUGEPAGES", "0") != "1":
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # THP disabled in this kernel: ordinary pages still work
        pass
    # The tensor keeps ``region`` alive; the mapping is unmapped when the tensor is freed.
    return torch.frombuffer(region, dtype=torch.uint8)
