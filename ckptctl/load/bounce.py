"""Reusable page-locked bounce buffers for loads onto a GPU.

A host-to-device copy runs at full speed (and asynchronously) only from page-locked memory.
Allocating a pinned temporary per tensor goes through torch's caching host allocator: one
locked ``cudaHostAlloc`` per new size (other threads' CUDA calls wait on it), sizes rounded up
to a power of two, and every block stays pinned in the cache after the load. Instead a
``BouncePool`` owns a few buffers (``count`` x ``nbytes``, 64-256 MiB each, page-locked by us,
see ``ckptctl.state.pinned``) and streams every tensor through them in chunks:

1. take a free buffer; wait for the event recorded after its last copy (so a copy still
   reading it is never overwritten);
2. copy the next chunk of *already verified* host bytes into it (a CPU memcpy);
3. queue the chunk's host-to-device copy on the stream that was current on the caller's
   thread when the pool was made, and record the buffer's event after it.

Ordering: the copies are queued on the caller's own current stream, not on the I/O threads'
default streams, so they run after every kernel the caller queued before the load and before
every kernel it queues after (no extra synchronisation needed to use the tensors). The host
source may be freed as soon as ``upload`` returns: its bytes are in a bounce buffer by then.

    >>> pool = BouncePool(torch.device("cuda", local_rank))      # doctest: +SKIP
    >>> try:
    ...     for name, target in targets.items():                  # from any number of threads
    ...         host = read_and_verify(name)                      # CPU tensor, checksum checked
    ...         pool.upload(host, target)                         # chunked, stream-ordered
    ... finally:
    ...     pool.close()                                          # waits, unpins, unmaps

On a CPU target the same bookkeeping runs with synchronous copies (and no pinning unless a
``registrar`` is given), which is how it is tested without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ckptctl.state.pinned import CudaRegistrar, HostRegion, Registrar, host_wait_event, split_at

# Big enough that per-copy overhead (~10 us) is noise against a chunk's transfer (~2.5 ms at
# 50 GB/s), small enough that a few of them are a rounding error next to a host's memory.
DEFAULT_NBYTES = 128 << 20
# Two let one buffer be filled while the other's copy runs; a few more absorb several I/O
# threads finishing reads at once.
DEFAULT_COUNT = 4


@dataclass
class BounceStats:
    """What the pool did: buffers mapped, chunks copied, how often a buffer was reused."""

    mapped: int = 0
    chunks: int = 0
    reuses: int = 0
    bytes: int = 0
    uploads: int = 0
    pinned_failures: list[str] = field(default_factory=list)


@dataclass
class _Buffer:
    region: HostRegion
    event: "torch.cuda.Event | None"
    used: bool = False


class BouncePool:
    """A few reusable page-locked buffers through which host bytes reach ``device``.

    Make it on the thread whose current stream the copies must be ordered against (the
    training thread); ``upload`` may then be called from any thread. ``registrar`` injects
    how buffers are page-locked (default: ``cudaHostRegister`` under ``device`` for a CUDA
    device, none for the CPU); ``register_chunk``: bytes per registration (default
    ``pinned.REGISTER_CHUNK``)."""

    def __init__(
        self,
        device: "torch.device | str | int",
        *,
        count: int = DEFAULT_COUNT,
        nbytes: int = DEFAULT_NBYTES,
        registrar: Registrar | None = None,
        register_chunk: int | None = None,
    ) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"BouncePool needs count >= 1 and nbytes >= 1, got {count} and {nbytes}")
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.count, self.nbytes = count, nbytes
        self._chunk = register_chunk
        self._cuda = self.device.type == "cuda"
        self._registrar = registrar if registrar is not None or not self._cuda else CudaRegistrar(self.device.index)
        # The caller's stream, captured on the caller's thread (current streams are per thread).
        self.stream = torch.cuda.current_stream(self.device) if self._cuda else None
        self._free: "collections.deque[_Buffer]" = collections.deque()  # oldest given back first
        self._all: list[_Buffer] = []
        self._making = 0  # buffers being mapped right now (outside the lock)
        self._lock = threading.Lock()  # stats and the buffer lists
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self.stats = BounceStats()

    def upload(self, host: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the CPU tensor ``host`` (already verified) into ``target`` on the pool's device,
        through the bounce buffers, ordered on the caller's stream. Same dtype and number of
        elements; ``target`` may be non-contiguous."""
        if host.device.type != "cpu" or target.device != self.device:
            raise ValueError(f"BouncePool.upload: host must be on cpu and target on {self.device}, got {host.device} and {target.device}")
        if host.dtype != target.dtype or host.numel() != target.numel():
            raise ValueError(f"BouncePool.upload: {host.dtype}{list(host.shape)} does not fit {target.dtype}{list(target.shape)}")
        if self._closed:
            raise RuntimeError("BouncePool is closed")
        src = host.contiguous().reshape(-1).view(torch.uint8)

        def fill(out: torch.Tensor, offset: int) -> None:
            out.copy_(src[offset : offset + out.numel()])

        with self._on_stream():
            # A non-contiguous target gets a dense temporary on the caller's stream (as torch's
            # own copy_ would), filled chunk by chunk, then scattered with one copy.
            dense = target if target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype, device=self.device)
            self._through(fill, src.numel(), dense)
            if dense is not target:
                target.copy_(dense)

    def upload_from(self, fill: "Callable[[torch.Tensor, int], None]", target: torch.Tensor) -> None:
        """Fill the contiguous ``target`` on the pool's device with bytes that ``fill(out,
        offset)`` writes straight into a page-locked buffer (``out``, a flat uint8 tensor: the
        bytes ``[offset, offset + out.numel())`` of the target), in order, one buffer at a
        time; each buffer's copy is queued on the caller's stream. A file read lands in pinned
        memory directly: no pageable temporary of the tensor and no second memcpy."""
        if target.device != self.device or not target.is_contiguous():
            raise ValueError(f"BouncePool.upload_from: target must be contiguous on {self.device}, got {target.device}")
        if self._closed:
            raise RuntimeError("BouncePool is closed")
        with self._on_stream():
            self._through(fill, target.numel() * target.element_size(), target)

    def _through(self, fill: "Callable[[torch.Tensor, int], None]", total: int, dense: torch.Tensor) -> None:
        """``total`` bytes from ``fill`` into the contiguous ``dense``, buffer by buffer (under
        ``_on_stream``)."""
        dst = dense.reshape(-1).view(torch.uint8) if total else dense
        for begin in range(0, total, self.nbytes):
            end = min(begin + self.nbytes, total)
            buf = self._take()
            try:
                staged = buf.region.tensor[: end - begin]
                fill(staged, begin)
                # Split where the buffer's registrations meet (a register_chunk smaller than
                # the buffer): one copy never spans two pinned ranges.
                for a, b in split_at(0, end - begin, buf.region.boundaries):
                    dst[begin + a : begin + b].copy_(staged[a:b], non_blocking=self._cuda)
                if buf.event is not None:
                    buf.event.record(self.stream)
            finally:
                self._give(buf)
            with self._lock:
                self.stats.chunks += 1
                self.stats.bytes += end - begin
        with self._lock:
            self.stats.uploads += 1

    def _on_stream(self) -> contextlib.ExitStack:
        # A host-to-device copy_ is queued on the current stream of the *target's* device:
        # make both the device and the caller's stream current on this (I/O) thread.
        stack = contextlib.ExitStack()
        if self._cuda:
            stack.enter_context(torch.cuda.device(self.device.index))
            stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def _take(self) -> _Buffer:
        """A buffer whose last copy has completed: a free one whose copy is done if any, else
        a new one while fewer than ``count`` exist, else the free one used longest ago (its
        copy is waited for), else wait for one to be given back."""
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("BouncePool is closed")
                buf = next((b for b in self._free if b.event is None or b.event.query()), None)
                if buf is not None:
                    self._free.remove(buf)
                    break
                if len(self._all) + self._making < self.count:
                    self._making += 1
                    break
                if self._free:
                    buf = self._free.popleft()
                    break
                self._cond.wait()
        if buf is None:  # map and pin outside the lock: other threads keep copying meanwhile
            try:
                buf = self._map()
            finally:
                with self._cond:
                    self._making -= 1
                    self._cond.notify()
        with self._lock:
            if buf.used:
                self.stats.reuses += 1
        buf.used = True
        if buf.event is not None:
            buf.event.synchronize()  # the copy that last read this buffer has finished
        return buf

    def _map(self) -> _Buffer:
        region = HostRegion(self.nbytes, registrar=self._registrar, chunk=self._chunk)
        # Waited on by the I/O threads (``_take``, ``close``): a blocking event sleeps there
        # instead of spinning a core for the length of a copy.
        buf = _Buffer(region, host_wait_event() if self._cuda else None)
        with self._cond:
            if region.failure is not None:
                self.stats.pinned_failures.append(region.failure)
            self._all.append(buf)
            self.stats.mapped += 1
        return buf

    def _give(self, buf: _Buffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    @property
    def pinned_bytes(self) -> int:
        """Bytes the pool holds page-locked now."""
        with self._lock:
            return sum(b.region.pinned_bytes for b in self._all)

    def close(self) -> None:
        """Wait for every queued copy, then unlock and unmap every buffer. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            buffers, self._all = self._all, []
            self._free.clear()
            self._cond.notify_all()
        for b in buffers:
            if b.event is not None:
                b.event.synchronize()
            b.region.release()

    def __enter__(self) -> "BouncePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
