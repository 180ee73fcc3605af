"""``state.buffers.copy_host``: the save's snapshot and the staged load's final copies, done
as memmoves by the calling thread and the process's kept helper threads."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import torch

from ckptctl.state import buffers
from ckptctl.state.buffers import copy_host


def _pairs(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.zeros(n, dtype=torch.float32), torch.randn(n, generator=g)) for n in sizes]


def test_every_byte_lands_whatever_the_pieces() -> None:
    # Tensors smaller than a piece, exactly one, and several pieces with a ragged end; one
    # strided pair is left to the caller, untouched.
    sizes = [1, 1000, buffers._COPY_PIECE // 4, 3 * buffers._COPY_PIECE // 4 + 17]
    pairs = _pairs(sizes, 0)
    strided = (torch.zeros(8, 8).t(), torch.randn(8, 8))
    rest = copy_host([*pairs, strided])
    assert len(rest) == 1 and rest[0][0] is strided[0] and not rest[0][0].any()
    for dst, src in pairs:
        assert torch.equal(dst, src)
    again = _pairs(sizes, 1)  # the kept helpers serve the next copy too
    copy_host(again)
    assert all(torch.equal(d, s) for d, s in again)


def _child(q) -> None:
    # numpy makes the data: torch's own kernels may hang in a forked child whose parent ran
    # its thread pool, which is not what this test is about.
    rng = np.random.default_rng(2)
    n = buffers._COPY_PIECE // 4
    pairs = [(torch.from_numpy(np.zeros(n, np.float32)), torch.from_numpy(rng.random(n, np.float32))) for _ in range(6)]
    copy_host(pairs)
    q.put(all(np.array_equal(d.numpy(), s.numpy()) for d, s in pairs))


def test_a_forked_child_copies_with_helpers_of_its_own() -> None:
    """A fork()ed child (a DataLoader worker) inherits the parent's helper pool but none of its
    threads: a copy that queued work there would wait for ever."""
    copy_host(_pairs([buffers._COPY_PIECE // 4] * 6, 3))  # the parent's helpers exist now
    assert buffers._pool is not None
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join()
        raise AssertionError("the forked child's copy never finished")
    assert p.exitcode == 0 and q.get(timeout=5) is True


def test_a_copy_does_not_wait_for_busy_helpers() -> None:
    """Two threads copying at once (two Checkpointers in one process) share the helpers: a
    copy returns once its own pieces are in, never waiting for a helper busy elsewhere (here
    held by a task that blocks until released)."""
    import threading

    pool = buffers._helpers(1)
    release = threading.Event()
    blockers = [pool.submit(release.wait) for _ in range(4)]  # every helper taken, more queued
    pairs = _pairs([buffers._COPY_PIECE // 4] * 3, 6)
    t = threading.Thread(target=copy_host, args=(pairs,))
    try:
        t.start()
        t.join(60)
        assert not t.is_alive(), "the copy waited for a helper busy with another thread's work"
        assert all(torch.equal(d, s) for d, s in pairs)
    finally:
        release.set()
        for b in blockers:
            b.result(timeout=60)
        t.join(60)
