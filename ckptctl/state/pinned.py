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

If page-locking fails (an ``RLIMIT_MEMLOCK``, a driver without room, confidential computing,
an old torch without the binding), the already registered chunks are unregistered, a warning
is logged once per process, and the region stays usable as ordinary memory: copies into it
are then synchronous and slower, never wrong.

Three hazards of owning pinned memory, and what is done about each:

- A failed ``cudaHostRegister`` leaves its error as the CUDA runtime's *last error of the
  calling thread*, and torch's binding does not clear it (``C10_CUDA_ERROR_HANDLED`` only
  evaluates the call). The next kernel launch on that thread checks ``cudaGetLastError`` and
  raises a misleading "CUDA error" from the training's forward, or from ``src.contiguous()``
  inside a snapshot. So every register and unregister call runs on a short-lived helper
  thread (``_off_thread``): whatever error it leaves dies with that thread.
- Registered memory must never be unmapped while registered (leaked pinned pages, and once the
  address is reused a failed registration, or DMA into pages that belong to someone else). A
  region dropped without ``release`` (a Checkpointer garbage-collected without ``close``)
  is unregistered by a ``weakref.finalize`` that holds the mapping alive until it has run.
- After a ``fork()`` (non-persistent DataLoader workers) a private mapping is copy-on-write:
  the parent's next CPU write moves its pages, and on kernels or drivers without pin-aware
  COW a DMA then lands in pages the parent no longer maps (stale data under valid
  checksums). Every mapping is advised ``MADV_DONTFORK`` before it is registered: the child
  simply does not inherit it.

The CUDA calls sit behind a small ``Registrar`` interface so the whole sequence (map, fault
in, register in chunks, unregister, unmap, fall back) runs and is tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
import weakref
from typing import Callable, Protocol, TypeVar

import torch

log = logging.getLogger("ckptctl")

T = TypeVar("T")

# At most this many bytes per cudaHostRegister call: each call holds the driver's lock while
# it pins, so other threads' CUDA calls (the training loop's kernel launches) wait at most for
# one chunk, not for the whole buffer. Read when a region is made (not bound as a default at
# definition time), so a test or a host can change it; ``HostRegion(chunk=...)`` overrides it.
REGISTER_CHUNK = 1 << 30

# cudaHostRegisterPortable: the pages count as pinned for every CUDA context of the process,
# so a buffer registered under one device serves copies from any other.
_PORTABLE = 1


class Registrar(Protocol):
    """Page-locks host memory for an accelerator. Both calls return None on success, else a
    one-line reason (never raise: a failure to pin is handled by staging unpinned). A
    ``HostRegion`` makes them on a short-lived helper thread, never on its caller's."""

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
        self, nbytes: int, *, registrar: Registrar | None = None, fault_in: bool = False, chunk: int | None = None
    ) -> None:
        chunk = REGISTER_CHUNK if chunk is None else chunk
        # Chunks are whole pages: two registrations sharing a page would overlap for the driver.
        if nbytes < 0 or chunk <= 0 or chunk % mmap.PAGESIZE:
            raise ValueError(f"HostRegion: bad size {nbytes} or chunk {chunk} (a positive multiple of {mmap.PAGESIZE})")
        self.nbytes = nbytes
        self._registrar = registrar
        self._registered: list[tuple[int, int]] = []  # (start, size) of every registered chunk, in order
        self._lock = threading.Lock()
        self.failure: str | None = None  # why it is not pinned, when pinning was asked for
        self.tensor = _map(nbytes)
        self.boundaries: tuple[int, ...] = ()
        # Unregisters whatever is still registered, then lets the mapping go: run by ``release``,
        # or by the garbage collector when the region is dropped without it. Its arguments keep
        # the mapping alive (through ``tensor``) until it has run, so it is never unmapped first.
        self._finalizer = weakref.finalize(self, _unregister_all, registrar, self._registered, self.tensor, os.getpid())
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

        def pin_all() -> str | None:  # on a helper thread: a failure's CUDA error stays there
            for begin in starts:
                size = min(chunk, self.nbytes - begin)
                why = registrar.register(base + begin, size)
                if why is not None:
                    _unregister_chunks(registrar, self._registered)
                    return why
                self._registered.append((base + begin, size))
                _count(size)
            return None

        why = _off_thread(pin_all)
        if why is not None:
            self.failure = why
            _warn_once(
                f"could not page-lock {self.nbytes} bytes of host staging memory ({why}); staging "
                "into ordinary memory instead: copies from the GPU are slower and synchronous "
                "(raise `ulimit -l`, or free host memory)"
            )
            return
        self.boundaries = tuple(starts[1:])

    def release(self) -> None:
        """Unlock every chunk and drop our mapping. The caller guarantees no copy into or out
        of the region is still in flight (its streams are synchronized). The memory is unmapped
        as soon as no tensor views it any more: at once, if the caller kept no view."""
        with self._lock:
            self._finalizer()  # runs once: a second release, or the collector later, does nothing
            self.boundaries = ()
            self.tensor = torch.empty(0, dtype=torch.uint8)


def _unregister_all(registrar: Registrar | None, registered: list[tuple[int, int]], mapping: torch.Tensor, pid: int) -> None:
    """The finalizer of a ``HostRegion``: unlock its chunks (off this thread) while ``mapping``
    still holds the memory mapped; the mapping may go once this returns. In a fork()ed child
    (another ``pid``) there is nothing to unlock: the child inherited neither the pages
    (MADV_DONTFORK) nor the registration, and must not touch CUDA."""
    if registrar is not None and registered and os.getpid() == pid:
        _off_thread(lambda: _unregister_chunks(registrar, registered))
    del mapping  # held only so that the memory stays mapped until the chunks are unlocked


def _unregister_chunks(registrar: Registrar, registered: list[tuple[int, int]]) -> None:
    while registered:
        ptr, size = registered.pop()
        why = registrar.unregister(ptr)
        if why is not None:  # nothing else can be done: the pages stay locked until exit
            log.warning("could not unlock host memory at %#x: %s", ptr, why)
        else:
            _count(-size)


_held = [0]  # bytes page-locked by every HostRegion of this process now
_held_lock = threading.Lock()


def _count(delta: int) -> None:
    with _held_lock:
        _held[0] += delta


def held_bytes() -> int:
    """Bytes that ckptctl holds page-locked in this process right now, over every region
    (staging buffers, load bounce buffers): what a job should see drop to 0 after a load and
    after ``close()``."""
    with _held_lock:
        return _held[0]


def _off_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a short-lived helper thread, waited for: the CUDA runtime keeps the last
    error of a call per thread, so an error a failed (un)registration leaves behind dies with
    the helper instead of surfacing at the caller's next kernel launch. Runs inline only where
    no thread can be started (interpreter shutdown), when no training follows anyway."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller, re-raised there
            error.append(e)

    helper = threading.Thread(target=run, name="ckptctl-pin", daemon=True)
    try:
        helper.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        return fn()
    helper.join()
    if error:
        raise error[0]
    return result[0]


def _map(nbytes: int) -> torch.Tensor:
    if nbytes == 0:  # mmap refuses a zero length; nothing to own
        return torch.empty(0, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Not inherited by a fork()ed child: no copy-on-write of pages a DMA may target (see above).
    # Before registering and before faulting in, so no page is ever shared with a child.
    dontfork = getattr(mmap, "MADV_DONTFORK", None)
    if dontfork is not None:
        region.madvise(dontfork)
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


def host_wait_event() -> "torch.cuda.Event":
    """A CUDA event for the host to wait on (``event.synchronize()`` from the writer or a load
    I/O thread). Created with ``cudaEventBlockingSync``: the waiting thread sleeps until the
    GPU signals it, where the default event makes ``cudaEventSynchronize`` spin a CPU core for
    the whole wait (the overlap window of a save, a whole load). Events only waited on by
    streams (``wait_event``) need no such flag, but one event often serves both."""
    return torch.cuda.Event(blocking=True)
