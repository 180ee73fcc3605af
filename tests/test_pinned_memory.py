"""Owning pinned host memory safely, on the CPU: where (un)registration runs, what happens to a
region dropped without ``release``, what a ``fork()``ed child inherits, and the registration
chunk as a real parameter.

A recording registrar stands in for ``cudaHostRegister`` (the injection point ``HostRegion``
has for exactly this); everything else is ckptctl's own code against the real kernel: real
mappings, real ``madvise``, a real ``fork``. ``tests/test_gpu.py`` runs the same paths on a GPU.
"""

from __future__ import annotations

import gc
import mmap
import os
import threading

import pytest
import torch

from ckptctl.load.bounce import BouncePool
from ckptctl.state import pinned
from ckptctl.state.pinned import HostRegion

MiB = 1 << 20


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


class ThreadRecordingRegistrar:
    """Registers like the driver (a set of live ranges) and records, for every call, the thread
    it ran on and whether the memory was still mapped at that moment."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.live: dict[int, int] = {}
        self.log: list[tuple[str, int, int, bool]] = []  # (call, ptr, thread ident, mapped)
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def _note(self, what: str, ptr: int) -> None:
        self.log.append((what, ptr, threading.get_ident(), _mapped(ptr)))
        self.threads.append(threading.current_thread())

    def register(self, ptr: int, nbytes: int) -> str | None:
        with self.lock:
            n, self.calls = self.calls, self.calls + 1
            self._note("register", ptr)
            if n == self.fail_at:
                return "cudaHostRegister failed with CUDA error 2"
            assert ptr not in self.live
            self.live[ptr] = nbytes
        return None

    def unregister(self, ptr: int) -> str | None:
        with self.lock:
            self._note("unregister", ptr)
            if self.live.pop(ptr, None) is None:
                return "cudaHostUnregister failed with CUDA error 1"
        return None


# --- 1. a failed registration's CUDA error never reaches the caller's thread ------------------


@pytest.mark.parametrize("fail_at", [None, 0, 2])
def test_register_and_unregister_run_on_a_short_lived_helper_thread(fail_at):
    reg = ThreadRecordingRegistrar(fail_at=fail_at)
    region = HostRegion(5 * MiB, registrar=reg, chunk=2 * MiB)
    region.release()
    me = threading.get_ident()
    assert reg.log and all(ident != me for _, _, ident, _ in reg.log), reg.log
    # The helpers are gone once the call returns: an error they left cannot outlive them.
    assert not any(t.is_alive() for t in reg.threads)
    assert reg.live == {}
    assert (region.failure is None) == (fail_at is None)


def test_bounce_buffers_are_registered_off_the_callers_thread_too():
    reg = ThreadRecordingRegistrar(fail_at=0)  # the load side's pin failure
    with BouncePool("cpu", count=1, nbytes=MiB, registrar=reg) as pool:
        src = torch.arange(3 * MiB // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        pool.upload(src, dst)  # still loads, through ordinary memory
        assert torch.equal(dst, src) and pool.stats.pinned_failures
    assert all(ident != threading.get_ident() for _, _, ident, _ in reg.log)


# --- 3. a region dropped without release is unregistered before it is unmapped ---------------


def test_a_region_dropped_without_release_is_unregistered_before_it_is_unmapped():
    reg = ThreadRecordingRegistrar()
    region = HostRegion(5 * MiB, registrar=reg, chunk=2 * MiB, fault_in=True)
    base = region.tensor.data_ptr()
    assert len(reg.live) == 3
    del region  # a Checkpointer garbage-collected without close()
    gc.collect()
    assert reg.live == {}, "pinned pages leaked: the region was unmapped while registered"
    unregs = [(ptr, mapped) for what, ptr, _, mapped in reg.log if what == "unregister"]
    assert len(unregs) == 3 and all(mapped for _, mapped in unregs)  # still mapped when unlocked
    assert not _mapped(base)  # and unmapped after


def test_a_region_in_a_reference_cycle_is_unregistered_by_the_collector():
    reg = ThreadRecordingRegistrar()
    region = HostRegion(3 * MiB, registrar=reg, chunk=MiB)
    region.cycle = region  # type: ignore[attr-defined]
    del region
    gc.collect()
    assert reg.live == {} and all(mapped for what, _, _, mapped in reg.log if what == "unregister")


def test_release_then_collection_unregisters_exactly_once():
    reg = ThreadRecordingRegistrar()
    region = HostRegion(4 * MiB, registrar=reg, chunk=MiB)
    region.release()
    region.release()
    del region
    gc.collect()
    assert [what for what, *_ in reg.log].count("unregister") == 4 and reg.live == {}


# --- 4. a fork()ed child does not inherit the mapping ----------------------------------------


def _vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``addr`` (``dc``: do not copy on fork)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_pinned_memory_is_not_inherited_by_a_forked_child():
    region = HostRegion(4 * MiB, registrar=ThreadRecordingRegistrar(), chunk=MiB, fault_in=True)
    addr = region.tensor.data_ptr()
    assert "dc" in _vm_flags(addr)  # MADV_DONTFORK
    pid = os.fork()
    if pid == 0:  # the child: is the parent's staging memory mapped here?
        os._exit(3 if _mapped(addr) else 0)
    _, status = os.waitpid(pid, 0)
    region.release()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child inherited the pinned pages (copy-on-write)"


# --- the registration chunk is a real parameter ----------------------------------------------


def test_the_registration_chunk_is_read_when_a_region_is_made(monkeypatch):
    monkeypatch.setattr(pinned, "REGISTER_CHUNK", MiB)  # the module's setting, not a bound default
    reg = ThreadRecordingRegistrar()
    region = HostRegion(3 * MiB + 5, registrar=reg)
    assert region.boundaries == (MiB, 2 * MiB, 3 * MiB) and len(reg.live) == 4
    region.release()
    with pytest.raises(ValueError, match="multiple of"):
        HostRegion(MiB, registrar=reg, chunk=mmap.PAGESIZE + 1)  # two chunks would share a page


def test_the_bounce_pool_registers_in_chunks_of_its_register_chunk():
    reg = ThreadRecordingRegistrar()
    with BouncePool("cpu", count=1, nbytes=3 * MiB, registrar=reg, register_chunk=MiB) as pool:
        src = torch.randn(7 * MiB // 4)
        dst = torch.empty_like(src)
        pool.upload(src, dst)
        assert torch.equal(dst, src)
        buf = pool._all[0].region
        assert buf.boundaries == (MiB, 2 * MiB) and len(reg.live) == 3


def test_held_bytes_counts_every_region_and_drops_to_zero_after_a_load_through_the_bounce_pool():
    from ckptctl.state.pinned import held_bytes

    before = held_bytes()
    reg = ThreadRecordingRegistrar()
    region = HostRegion(3 * MiB, registrar=reg, chunk=MiB)
    with BouncePool("cpu", count=2, nbytes=MiB, registrar=reg) as pool:
        src = torch.randn(5 * MiB // 4)
        pool.upload(src, torch.empty_like(src))
        assert held_bytes() - before == 3 * MiB + pool.pinned_bytes
    assert held_bytes() - before == 3 * MiB  # the pool's buffers were unlocked on close
    del region
    gc.collect()
    assert held_bytes() == before


def test_a_forked_child_releasing_the_parents_region_does_not_unregister_it():
    reg = ThreadRecordingRegistrar()
    region = HostRegion(2 * MiB, registrar=reg, chunk=MiB)
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the object: the parent's registration is not the child's
        region.release()
        os._exit(0 if not any(what == "unregister" for what, *_ in reg.log) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert len(reg.live) == 2  # still registered in the parent
    region.release()
    assert reg.live == {}
