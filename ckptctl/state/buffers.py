"""Tensor memory as bytes: a zero-copy byte view of a tensor, one reusable buffer viewed as
tensors of any dtype and shape, and host-to-host copies as plain memcpys. Readers fill these
views with ranged reads and hash them without copying; writers stream them. (The byte view of
plain ``bytes`` objects, without torch, is ``storage.base.byte_view``.)"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from ckptctl.format import dtypes

# Bytes per memcpy: large enough that the call's overhead is noise, small enough that a few
# large tensors still spread over every thread.
_COPY_PIECE = 16 << 20


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



def copy_host(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy each ``(dst, src)`` pair of host tensors of one dtype and shape: those both dense
    in memory as plain memcpys of up to 16 MiB on one thread per CPU (``ctypes`` releases the
    GIL for the call); returns the pairs it left to the caller (a strided or non-CPU tensor,
    for ``copy_``). torch's ``copy_`` spreads each tensor over its intra-op threads instead,
    which on a busy 2-core host spent 2-4 times the CPU of one memcpy for the same bytes and
    took longer (``docs/decisions.md``, "All-or-nothing loads in one pass")."""
    moves: list[tuple[int, int, int]] = []
    rest: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        # A conjugate or negative view holds other values than its bytes: copy_ resolves it.
        if (dst.device.type != "cpu" or src.device.type != "cpu" or not (dst.is_contiguous() and src.is_contiguous())
                or src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg()):
            rest.append((dst, src))
            continue
        if dst.dtype != src.dtype or dst.numel() != src.numel():
            raise ValueError(f"copy_host: {src.dtype}{list(src.shape)} does not fit {dst.dtype}{list(dst.shape)}")
        n = dst.numel() * dst.element_size()
        moves += [(dst.data_ptr() + a, src.data_ptr() + a, min(_COPY_PIECE, n - a)) for a in range(0, n, _COPY_PIECE)]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _run(moves, max(1, min(cpus, len(moves))))
    return rest


def _run(moves: list[tuple[int, int, int]], threads: int) -> None:
    """Every memmove of ``moves``, taken in turn by the calling thread and ``threads - 1``
    helpers (whoever is free takes the next: a helper the scheduler holds back holds nothing
    up). The caller works too, and the helpers are the process's own (``_helpers``): a pool
    started for each copy, one task per piece, cost a 0.47 GiB snapshot 2-3 ms of its 15-18
    (``docs/decisions.md``, "Host copies are libc memcpys"). The caller returns once every
    piece is copied, not once every helper task ran: a task still queued behind another
    thread's copy finds nothing left, so concurrent copies never wait for each other."""
    if not moves:
        return
    lock, finished = threading.Lock(), threading.Event()
    taken, done = [0], [0]

    def drain() -> None:
        while True:
            with lock:
                i = taken[0]
                taken[0] += 1
            if i >= len(moves):
                return
            ctypes.memmove(*moves[i])  # releases the GIL for the copy
            with lock:
                done[0] += 1
                if done[0] == len(moves):
                    finished.set()

    if threads > 1:
        pool = _helpers(threads - 1)
        try:
            for _ in range(threads - 1):
                pool.submit(drain)
        except RuntimeError:  # the interpreter is shutting down: the caller copies alone
            pass
    drain()
    finished.wait()


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _helpers(n: int) -> ThreadPoolExecutor:
    """The process's copy helpers, at least ``n`` of them: made once and kept (idle threads
    cost nothing), made again when more are needed."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)  # its threads end once idle
            _pool, _pool_size = ThreadPoolExecutor(max(1, n), thread_name_prefix="ckptctl-copy"), max(1, n)
        return _pool


def _forget_helpers() -> None:
    """In a fork()ed child (a DataLoader worker): the pool came along without its threads, so
    a task given to it would never run, and its lock may have been held by a thread that is
    not there: start over."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_helpers)
