"""Host memory we own, page-locked for an accelerator when we can: the save path's staging
buffer and the load path's bounce buffers.

It lives below both ``save/`` and ``load/`` (which may not import each other) because both
move a state's tensors through it on their way to or from a GPU.

Why not ``torch.empty(pin_memory=True)``: that goes through torch's caching host allocator,
which rounds every request up to a power of two (a 140 GB shard would pin 256 GiB), pins it in
one ``cudaHostAlloc`` (a global driver lock: other threads and processes block in CUDA calls
for the whole pin), and on "free" keeps the block pinned in its cache for the life of the
process. Instead a ``HostRegion`` maps exactly the bytes asked for (anonymous ``mmap``), faults
them in, and page-locks them with ``cudaHostRegister`` in chunks of at most ``REGISTER_CHUNK``
(1 GiB), so the driver lock is taken and dropped many times instead of held for the whole
buffer. ``release`` unregisters every chunk; the mapping is unmapped as soon as the last view
of it is gone (torch keeps the mapping alive while any tensor views it, so nothing can read
unmapped memory).

A device-to-host copy must not cross from one registration into the next (each is its own
pinned range for the driver): callers split copies at ``HostRegion.boundaries``
(``split_at``).

If page-locking fails (an ``RLIMIT_MEMLOCK``, a driver without room, an old torch without
the binding), the already registered chunks are unregistered, a warning is logged once per
process, and the region stays usable as ordinary memory: copies into it are then synchronous
and slower, never wrong.

The CUDA calls sit behind a small ``Registrar`` interface so the whole sequence (map, fault
in, register in chunks, unregister, unmap, fall back) runs and is tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
from typing import Protocol

import torch

log = logging.getLogger("ckptctl")

# At most this many bytes per cudaHostRegister call: each call holds the driver's lock while
# it pins, so other threads' CUDA calls (the training loop's kernel launches) wait at most for
# one chunk, not for the whole buffer.
REGISTER_CHUNK = 1 << 30

# cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process,
# so a buffer registered under one device serves copies from any other.
_PORTABLE = 1


class Registrar(Protocol):
    """Page-locks host memory for an accelerator. Both calls return None on success, else a
    one-line reason (never raise: a failure to pin is handled by staging unpinned)."""

    def register(self, ptr: int, nbytes: int) -> str | None: ...

    def unregister(self, ptr: int) -> str | None: ...


class CudaRegistrar:
    """``cudaHostRegister``/``cudaHostUnregister`` through torch's binding of the CUDA runtime,
    called with ``device`` current, so no context is created on another GPU (device 0 by
    default in a new thread)."""

    def __init__(self, device: int) -> None:
        self.device = device

    def register(self, ptr: int, nbytes: int) -> str | None:
        try:
            with torch.cuda.device(self.device):
                code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
        except (RuntimeError, AttributeError, AssertionError) as e:  # no CUDA, or no binding in this torch
            return f"cudaHostRegister unavailable: {type(e).__name__}: {e}"
        return None if code == 0 else f"cudaHostRegister failed with CUDA error {code}"

    def unregister(self, ptr: int) -> str | None:
        try:
            with torch.cuda.device(self.device):
                code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        except (RuntimeError, AttributeError, AssertionError) as e:
            return f"cudaHostUnregister unavailable: {type(e).__name__}: {e}"
        return None if code == 0 else f"cudaHostUnregister failed with CUDA error {code}"


_warned = threading.Event()  # the pin failure is logged at WARNING once per process


def _warn_once(message: str) -> None:
    if _warned.is_set():
        log.debug("%s", message)
        return
    _warned.set()
    log.warning("%s", message)


class HostRegion:
    """``nbytes`` of anonymous host memory mapped for us, faulted in if asked (on a background
    thread, before the first copy needs it), and page-locked through
    ``registrar`` in chunks of at most ``chunk`` bytes (unpinned when ``registrar`` is None or
    fails). ``tensor`` is a flat uint8 view of exactly ``nbytes``.

        >>> region = HostRegion(64 << 20, registrar=CudaRegistrar(0))   # doctest: +SKIP
        >>> region.tensor[:4].copy_(gpu_bytes[:4], non_blocking=True)    # doctest: +SKIP
        >>> region.release()                                             # doctest: +SKIP
    """

    def __init__(
        self, nbytes: int, *, registrar: Registrar | None = None, fault_in: bool = False, chunk: int = REGISTER_CHUNK
    ) -> None:
        if nbytes < 0 or chunk <= 0:
            raise ValueError(f"HostRegion: bad size {nbytes} or chunk {chunk}")
        self.nbytes = nbytes
        self._registrar = registrar
        self._registered: list[int] = []  # start pointer of every registered chunk, in order
        self._lock = threading.Lock()
        self.failure: str | None = None  # why it is not pinned, when pinning was asked for
        self.tensor = _map(nbytes)
        self.boundaries: tuple[int, ...] = ()
        if nbytes:
            if fault_in:  # else the first copy into it faults pages in (or registering does)
                _fault_in(self.tensor)
            if registrar is not None:
                self._pin(registrar, chunk)

    @property
    def pinned(self) -> bool:
        """Whether every byte is page-locked."""
        return bool(self._registered)

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked by this region now (0 once released or after a failure)."""
        return self.nbytes if self._registered else 0

    def _pin(self, registrar: Registrar, chunk: int) -> None:
        base = self.tensor.data_ptr()
        starts = list(range(0, self.nbytes, chunk))
        for begin in starts:
            why = registrar.register(base + begin, min(chunk, self.nbytes - begin))
            if why is not None:
                self._unregister_all(registrar)
                self.failure = why
                _warn_once(
                    f"could not page-lock {self.nbytes} bytes of host staging memory ({why}); staging "
                    "into ordinary memory instead: copies from the GPU are slower and synchronous "
                    "(raise `ulimit -l`, or free host memory)"
                )
                return
            self._registered.append(base + begin)
        self.boundaries = tuple(starts[1:])

    def _unregister_all(self, registrar: Registrar) -> None:
        while self._registered:
            ptr = self._registered.pop()
            why = registrar.unregister(ptr)
            if why is not None:  # nothing else can be done: the pages stay locked until exit
                log.warning("could not unlock host memory at %#x: %s", ptr, why)

    def release(self) -> None:
        """Unlock every chunk and drop our mapping. The caller guarantees no copy into or out
        of the region is still in flight (its streams are synchronized). The memory is unmapped
        as soon as no tensor views it any more: at once, if the caller kept no view."""
        with self._lock:
            if self._registrar is not None:
                self._unregister_all(self._registrar)
            self.boundaries = ()
            self.tensor = torch.empty(0, dtype=torch.uint8)


def _map(nbytes: int) -> torch.Tensor:
    if nbytes == 0:  # mmap refuses a zero length; nothing to own
        return torch.empty(0, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= (2 << 20) and os.environ.get("CKPTCTL_HUGEPAGES", "0") == "1":
        try:
            region.madvise(advice)
        except OSError:  # THP disabled in this kernel: ordinary pages still work
            pass
    # The tensor (and every view of it) keeps ``region`` alive: the mapping is unmapped when
    # the last one is freed, never under a live view.
    return torch.frombuffer(region, dtype=torch.uint8)


def _fault_in(t: torch.Tensor) -> None:
    """Touch one byte per page so the kernel backs the whole mapping now (and registration
    then only locks resident pages). torch releases the GIL while it writes."""
    t[:: mmap.PAGESIZE].fill_(0)


def split_at(begin: int, end: int, boundaries: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[begin, end)`` cut at every boundary strictly inside it: the pieces a copy must be
    split into so that each stays within one registered chunk."""
    pieces, at = [], begin
    for b in boundaries[bisect.bisect_right(boundaries, begin):]:
        if b >= end:
            break
        pieces.append((at, b))
        at = b
    pieces.append((at, end))
    return pieces
