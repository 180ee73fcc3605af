#!/usr/bin/env python
"""Save/load benchmark: ckptctl beside DCP, torch.save and the machine's own limits.

    .venv/bin/python scripts/bench_save.py [--size-gib 1.0] [--state model|flat] [--tensors 300]
                                           [--dir PATH] [--repeat 5] [--json] [--skip dcp,dcp_cached,torch_save]
    .venv/bin/python scripts/bench_save.py --ranks 1,2,4 [--size-gib 0.25]   # multi-rank: bench_dist.py

One run builds one state and measures, on that state and the same disk. The headline state
(``--state model``) is a real model (blocks of Linear(1024, 4096), GELU, Linear(4096, 1024),
LayerNorm) and its AdamW state after one step, saved through the helpers a user's code goes
through: ckptctl ``save({"model": model, "optimizer": opt})``, DCP ``get_state_dict`` (inside
the timed stall) / ``set_state_dict``, torch.save of ``state_dict()`` / ``load_state_dict``.
``--state flat`` is the secondary line: a flat dict of ``--tensors`` tensors (fp32 and bf16,
varied shapes) that every tool saves as is.

* machine limits: memcpy of every tensor into a pre-faulted buffer (and into a fresh one: the
  first save's case); sequential write + fsync of the same bytes in 64 MiB pieces to a fresh
  file (one thread, as each rank's writer); sequential read of that file after evicting it
  from the page cache with 1 thread, with verify's thread count and with load's
  (``CKPTCTL_VERIFY_THREADS``, ``CKPTCTL_IO_THREADS``), and cache-hot;
* ckptctl: first save() stall (a fresh Checkpointer on which the job called only
  ``load_latest``, finding nothing, as the README's loop does, and whose background preparation
  had the time to end, as it has before a job's first save; no ``prepare()``), and beside it
  the first stall of a Checkpointer whose first call is ``save()``; steady stall, time to
  durable (save start -> wait() return), background write (and write_s from the manifest),
  verify (checksums level), load into the live state (in a fresh Checkpointer, as a resume;
  its ``close()``, which a resuming job calls only at its end, is not timed), and again with a
  Checkpointer kept across the rounds that holds its staging buffer (it prepared once, untimed:
  a job that saved or prepared before it loads), and the bytes each load read
  (``/proc/self/io``: from storage, and through read calls);
* DCP*, the reference of the targets: ``async_save`` with one ``DefaultStager`` kept across
  saves, so its host copies are reused (DCP at its best on this host; first save with a fresh
  stager), fsyncing (``sync_files=True``, its default); DCP default (a fresh stager every
  save, fresh host copies) beside it; DCP load (+ set_state_dict) into the live state;
* torch.save (synchronous: its stall is its whole time) + fsync, and torch.load(weights_only=True)
  followed by load_state_dict (or copy_) into the same live state: every load ends with the
  bytes in the same existing tensors; torch.load also allocates its own on the way.

Measurements are interleaved and the tool order rotates every round: each save round runs every
tool once, each read round reads every checkpoint once, cold. Round 0 holds the first saves.
On a shared machine the disk and the CPUs swing by 2-3x from one second to the next, so each
ratio is the median over rounds of ckptctl's sample divided by the reference sampled beside it
in the same round, shown with its min and max; PASS/MISS is given on the median. A
pre-faulted memcpy is taken right before each ckptctl save as its paired limit. The output
shows every sample, the process CPU time of each stall (not inflated by waiting for a CPU) and
the CPU pressure (Linux PSI) during each tool's timed sections, so a noisy run says so.

Cold reads: files are fsynced and evicted with posix_fadvise(DONTNEED); the output says how
much of each file was still cached when its read began (mincore). On a VM a "fresh" buffer
can cost more than on bare metal: pages freed to the guest are handed back to the host (free
page reporting) and fault there again. GB = 1e9 bytes; sizes in GiB/MiB.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

import torch

from benchutil import ReadCount, cpu_pressure_us, dir_bytes, drop_cache, files_under

PIECE = 64 << 20  # raw I/O piece size (the shard writer's piece size too)
ALIGN = 64

# Targets: (key, label, op, bound). DCP* = DCP at its best on this host: async_save with one
# DefaultStager kept across saves (reused host copies), fsyncing (sync_files=True, its default).
TARGETS = [
    ("steady_stall_vs_memcpy", "steady stall / memcpy (pre-faulted)", "<=", 1.3),
    ("steady_stall_vs_dcp", "steady stall / DCP* steady stall", "<=", 1.0),
    ("first_stall_vs_dcp", "first stall / DCP* first stall (both cold)", "<=", 0.5),
    ("durable_vs_dcp", "time to durable / DCP* time to durable", "<=", 1.0),
    ("write_vs_raw", "write throughput / raw write+fsync (1 thread)", ">=", 0.9),
    ("verify_vs_raw_read", "verify thr. / raw read (verify's threads)", ">=", 0.8),
    ("load_vs_raw_read", "load thr. / raw read (load's threads)", ">=", 0.9),
    ("load_vs_dcp", "load throughput / DCP load", ">=", 1.5),
    ("load_storage_vs_size", "bytes read from storage per load / checkpoint", "<=", 1.05),
]
# Same-run comparisons without a stated target (shown, never PASS/MISS).
INFO = [
    ("steady_stall_vs_dcp_default", "steady stall / DCP default steady stall"),
    ("first_stall_vs_dcp_default", "first stall / DCP default first stall"),
    ("durable_vs_dcp_default", "time to durable / DCP default"),
    ("first_stall_vs_memcpy_fresh", "first stall / memcpy (fresh buffer)"),
    ("bare_first_stall_vs_dcp", "first stall, save() the first call / DCP* first"),
    ("write_s_vs_raw", "write thr. (manifest write_s) / raw write+fsync"),
    ("verify_vs_raw_read_1", "verify thr. / raw read (1 thread)"),
    ("verify_hot_vs_read_hot", "verify thr. / raw read (both cache-hot, 1 thread)"),
    ("load_vs_torch", "load throughput / torch.load + load_state_dict"),
    ("held_load_vs_raw_read", "load, buffer held / raw read (load's threads)"),
    ("load_cpu_vs_raw", "CPU time: load / raw read (load's threads)"),
    ("held_load_cpu_vs_raw", "CPU time: load, buffer held / raw read"),
    ("load_cpu_vs_dcp", "CPU time: load / DCP load"),
    ("held_load_vs_dcp", "load, buffer held / DCP load"),
    # What any reader could gain over DCP on this disk: near the disk's speed, DCP's load sets
    # a ceiling on load / DCP load that no reader (ours included) can pass.
    ("raw_read_vs_dcp", "fastest raw read / DCP load: the ceiling"),
    ("held_storage_vs_size", "load, buffer held: storage bytes / checkpoint"),
    ("held_calls_vs_size", "load, buffer held: read-call bytes / checkpoint"),
    ("load_calls_vs_size", "read-call bytes per load / checkpoint"),
    ("dcp_storage_vs_size", "DCP: storage bytes per load / checkpoint"),
    ("torch_storage_vs_size", "torch.load: storage bytes / checkpoint"),
    # CPU time is not inflated by waiting for a CPU: a cross-check when the machine is busy.
    ("cpu_steady_vs_memcpy", "CPU time: steady stall / memcpy"),
    ("cpu_steady_vs_dcp", "CPU time: steady stall / DCP* steady stall"),
]

_libc = ctypes.CDLL(None, use_errno=True)


# --- helpers -------------------------------------------------------------------------------

def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def gbps(nbytes: float, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def free_memory() -> None:
    gc.collect()
    try:
        _libc.malloc_trim(0)  # hand freed heap back to the OS so phases do not inherit it
    except AttributeError:
        pass


def resident_fraction(path: str) -> float | None:
    """Share of the bytes of the files under ``path`` that are in the page cache (mincore)."""
    try:
        page = mmap.PAGESIZE
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        total = resident = 0
        for f in files_under(path):
            size = os.path.getsize(f)
            if size == 0:
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    pages = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * pages)()
                    if _libc.mincore(addr, size, vec) != 0:
                        return None
                    resident += sum(v & 1 for v in bytes(vec)) * page
                    total += pages * page
                finally:
                    _libc.munmap(addr, size)
            finally:
                os.close(fd)
        return resident / total if total else None
    except (OSError, AttributeError, ValueError):
        return None


# --- the state -----------------------------------------------------------------------------


def build_specs(size_bytes: int, n: int, seed: int = 0) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """~``n`` tensors adding up to ~``size_bytes``: a third small 1-D (norms, biases), the
    rest 2-D matrices of log-normally spread sizes, about a quarter of those bf16."""
    rnd = random.Random(seed)
    n_small = max(n // 3, 0)
    n_big = max(n - n_small, 1)
    small = [(f"layers.{i // 2}.norm{i % 2}.weight", (rnd.choice([1024, 2048, 4096, 8192]),), torch.float32) for i in range(n_small)]
    small_bytes = sum(s[1][0] * 4 for s in small)
    left = max(size_bytes - small_bytes, n_big * 4096)
    weights = [rnd.lognormvariate(0, 1.0) for _ in range(n_big)]
    scale = left / sum(weights)
    big = []
    for i, w in enumerate(weights):
        dtype = torch.bfloat16 if rnd.random() < 0.25 else torch.float32
        elems = max(int(w * scale) // (2 if dtype == torch.bfloat16 else 4), 1)
        cols = rnd.choice([512, 1024, 2048, 4096, 5120, 11008])
        rows = max(round(elems / cols), 1)
        big.append((f"layers.{i // 4}.{['q', 'k', 'mlp_up', 'mlp_down'][i % 4]}.weight", (rows, cols), dtype))
    return big + small


def build_state(specs) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    model = {}
    for name, shape, dtype in specs:
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(generator=g)
        model[name] = t.to(dtype) if dtype != torch.float32 else t
    return {"model": model}


class FlatState:
    """The secondary state: a flat dict of tensors, saved as is by every tool."""

    kind = "flat dict of tensors"

    def __init__(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.state = state

    def tensors(self) -> list[torch.Tensor]:
        return [t for d in self.state.values() for t in d.values()]

    def ck_state(self) -> dict:
        return self.state

    def dcp_state(self) -> dict:
        return self.state

    def torch_state(self) -> dict:
        return self.state

    def target(self) -> "FlatState":
        return FlatState(empty_like_state(self.state))

    def dcp_load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.state, checkpoint_id=path)

    def torch_load_into(self, loaded: dict) -> None:
        for k, d in self.state.items():
            for n, t in d.items():
                t.copy_(loaded[k][n])


class ModelState:
    """The headline state: a real model and its AdamW state after one step, saved through the
    helpers a user's code goes through (ckptctl: the objects; DCP: get_state_dict /
    set_state_dict; torch.save: state_dict() / load_state_dict())."""

    kind = "model + AdamW"

    def __init__(self, blocks: int, dim: int, seed: int = 0) -> None:
        from torch import nn

        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.LayerNorm(dim)]
        self.blocks, self.dim = blocks, dim
        self.model = nn.Sequential(*layers)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.randn(4, dim)).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    @staticmethod
    def blocks_for(size_bytes: int, dim: int) -> int:
        per_block = (8 * dim * dim + 7 * dim) * 4 * 3  # params, exp_avg, exp_avg_sq; fp32
        return max(1, round(size_bytes / per_block))

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for p in self.model.parameters():
            out.append(p.data)
            for k in sorted(self.opt.state[p]):
                v = self.opt.state[p][k]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out.append(v)
        return out

    def ck_state(self) -> dict:
        return {"model": self.model, "optimizer": self.opt}

    def dcp_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optimizer": osd}

    def torch_state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def target(self) -> "ModelState":
        out = ModelState(self.blocks, self.dim, seed=1)  # every tensor exists and is touched
        zero_tensors(out.tensors())
        return out

    def dcp_load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = self.dcp_state()
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])

    def torch_load_into(self, loaded: dict) -> None:
        self.model.load_state_dict(loaded["model"])
        self.opt.load_state_dict(loaded["optimizer"])


def zero_tensors(ts: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in ts:
            t.zero_()


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def empty_like_state(state, touch: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Pre-allocated targets of the same shapes; ``touch`` faults their pages in now, as a
    live model's would be, so a load is not charged for first-touch page faults."""
    out = {k: {n: torch.empty_like(t) for n, t in d.items()} for k, d in state.items()}
    if touch:
        for d in out.values():
            for t in d.values():
                t.zero_()
    return out


def layout(tensors: list[torch.Tensor]) -> tuple[list[tuple[torch.Tensor, int, int]], int]:
    pos, out = 0, []
    for t in tensors:
        nb = t.numel() * t.element_size()
        out.append((t, pos, nb))
        pos = (pos + nb + ALIGN - 1) // ALIGN * ALIGN
    return out, pos


def copy_into(buf: torch.Tensor, lay) -> None:
    """The memcpy limit: every tensor's bytes with libc's memmove, 16 MiB at a time, on one
    thread per CPU (torch's ``copy_`` spreads each tensor over its intra-op threads and costs
    several times the CPU on a busy host)."""
    from concurrent.futures import ThreadPoolExecutor

    base = buf.data_ptr()
    moves = [(base + pos + a, t.data_ptr() + a, min(16 << 20, nb - a)) for t, pos, nb in lay for a in range(0, nb, 16 << 20)]
    with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        list(pool.map(lambda m: ctypes.memmove(*m), moves))




# --- the tools, one save and one read at a time ----------------------------------------


class Timer:
    """Accumulates wall time and CPU pressure (PSI "some") over a tool's timed sections."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.pressure = 0.0

    def __enter__(self) -> "Timer":
        self._p0, self._t0 = cpu_pressure_us(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._t0
        p1 = cpu_pressure_us()
        if self._p0 is not None and p1 is not None:
            self.pressure += (p1 - self._p0) / 1e6

    @property
    def share(self) -> float | None:
        return self.pressure / self.wall if self.wall else None


def timed_read(path: str, data: memoryview, piece: int, threads: int = 1, step: int | None = None) -> float:
    """Read a whole file into ``data`` as ``piece``-byte pieces handed to ``threads`` readers in
    turn, each piece front to back in calls of ``step`` bytes (None: as large as the rest of
    the piece); returns the seconds taken."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def one(start: int) -> None:
            pos, end = start, min(start + piece, size)
            while pos < end:
                n = os.preadv(fd, [data[pos : end if step is None else min(pos + step, end)]], pos)
                if n == 0:
                    raise IOError(f"{path}: short read")
                pos += n

        if threads == 1:
            for start in range(0, size, piece):
                one(start)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(0, size, piece)))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: str, data: memoryview) -> float:
    """One reader, 64 MiB pieces: the plain sequential read."""
    return timed_read(path, data, PIECE)


def raw_read_threads(path: str, data: memoryview, threads: int) -> float:
    """``threads`` readers, each taking VERIFY_PIECE ranges in turn (as verify and a load's
    ranged reads spread them): the limit for a tool that uses that many threads."""
    from ckptctl.settings import VERIFY_PIECE

    return timed_read(path, data, VERIFY_PIECE, threads)


def raw_read_runs(path: str, data: memoryview, threads: int) -> float:
    """Read a whole file as the load reads a local shard: runs of ``SEQUENTIAL_RUN`` bytes, each
    front to back in ``READ_STEP`` calls by one of ``threads`` readers (the kernel reads ahead
    of each): on this kind of disk the fastest plain read found, so the ceiling for a loader."""
    from ckptctl.settings import READ_STEP, SEQUENTIAL_RUN

    return timed_read(path, data, SEQUENTIAL_RUN, threads, READ_STEP)


class Bench:
    def __init__(self, kit, nbytes: int, work: str, repeat: int, skip: set[str], log, t_start: float) -> None:
        self.kit, self.nbytes, self.work, self.repeat, self.skip, self.log = kit, nbytes, work, repeat, skip, log
        self.t_start = t_start
        self.res: dict[str, Any] = {"errors": {}}
        self.timers: dict[str, Timer] = {}
        self.paths: dict[str, str] = {}  # the newest checkpoint (or raw file) of each tool

    def timer(self, tool: str) -> Timer:
        return self.timers.setdefault(tool, Timer())

    def rec(self, tool: str) -> dict[str, Any]:
        return self.res.setdefault(tool, {})

    def add(self, tool: str, key: str, value: Any) -> None:
        self.rec(tool).setdefault(key, []).append(value)

    def attempt(self, tool: str, fn: Callable[[], None]) -> None:
        """Run one step of ``tool``; on failure record the error and drop the tool."""
        if tool in self.skip:
            return
        try:
            fn()
        except Exception as e:  # keep the other tools' figures
            traceback.print_exc(file=self.log)
            self.res["errors"][tool] = f"{type(e).__name__}: {e}"
            self.skip.add(tool)

    def keep_newest(self, tool: str, new: str | None) -> None:
        """One checkpoint per tool stays on disk: the newest (None: remove it too)."""
        old = self.paths.pop(tool, None)
        if new:
            self.paths[tool] = new
        if old and old != new:
            shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)
            # Outside any timed section: on a filesystem mounted with `discard` the freed
            # blocks are trimmed at the next journal commit, which would otherwise land in the
            # next tool's fsync.
            os.sync()

    def progress(self, what: str) -> None:
        print(f"[bench] {what} ({time.perf_counter() - self.t_start:.0f}s)", file=self.log)

    # --- limits -------------------------------------------------------------------------

    def memcpy(self) -> torch.Tensor:
        lay, total = layout(self.kit.tensors())
        fresh, fresh_cpu = [], []
        for _ in range(self.repeat):
            buf = torch.empty(total, dtype=torch.uint8)  # untouched: the copy faults every page in
            t0, c0 = time.perf_counter(), time.process_time()
            copy_into(buf, lay)
            fresh.append(time.perf_counter() - t0)
            fresh_cpu.append(time.process_time() - c0)
            del buf
            free_memory()
        buf = torch.empty(total, dtype=torch.uint8)
        buf.fill_(1)  # pre-faulted
        self.res["memcpy"] = {"fresh_s": fresh, "fresh_cpu_s": fresh_cpu}
        self._lay = lay
        for _ in range(self.repeat):
            self.memcpy_prefaulted(buf)
        return buf

    def memcpy_prefaulted(self, buf: torch.Tensor, in_round: bool = False) -> None:
        """One sample. Also taken in every save round right before ckptctl's save, so that
        the limit and the stall are paired: sampled under the same conditions."""
        with self.timer("memcpy"):
            t0, c0 = time.perf_counter(), time.process_time()
            copy_into(buf, self._lay)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.add("memcpy", "prefaulted_s", wall)
        self.add("memcpy", "prefaulted_cpu_s", cpu)
        if in_round:
            self.add("memcpy", "round_s", wall)
            self.add("memcpy", "round_cpu_s", cpu)

    def raw_write(self, r: int, data: memoryview) -> None:
        path = os.path.join(self.work, f"raw-{r}.bin")
        with self.timer("raw"):
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for pos in range(0, len(data), PIECE):
                    piece = data[pos : pos + PIECE]
                    done = 0
                    while done < len(piece):
                        done += os.write(fd, piece[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
            self.add("raw", "write_s", time.perf_counter() - t0)
        self.keep_newest("raw", path)

    # --- saves --------------------------------------------------------------------------

    def ckptctl_save(self, r: int) -> None:
        from ckptctl.ops.inspect import inspect_checkpoint
        from ckptctl.storage import open_storage

        with self.timer("ckptctl"):
            t0, c0 = time.perf_counter(), time.process_time()
            h = self._ck.save(r + 1, self.kit.ck_state())
            t1, c1 = time.perf_counter(), time.process_time()
            path = h.wait()
            t2 = time.perf_counter()
        stats = inspect_checkpoint(open_storage(path)).stats
        self.add("ckptctl", "stall_s", t1 - t0)
        self.add("ckptctl", "stall_cpu_s", c1 - c0)
        self.add("ckptctl", "bg_s", t2 - t1)
        self.add("ckptctl", "write_s", stats.get("write_s"))
        self.add("ckptctl", "manifest_stall_s", stats.get("stall_s"))
        self.rec("ckptctl")["file_bytes"] = dir_bytes(path)
        self.keep_newest("ckptctl", path)

    def bare_first_save(self) -> None:
        """A first save with nothing before it: a new Checkpointer whose first call is save(),
        so its staging buffer is mapped and faulted in during the stall."""
        from ckptctl import Checkpointer

        with Checkpointer(os.path.join(self.work, "ckptctl-bare")) as ck:
            with self.timer("ckptctl_bare"):
                t0, c0 = time.perf_counter(), time.process_time()
                h = ck.save(1, self.kit.ck_state())
                t1, c1 = time.perf_counter(), time.process_time()
                path = h.wait()
        self.add("ckptctl_bare", "stall_s", t1 - t0)
        self.add("ckptctl_bare", "stall_cpu_s", c1 - c0)
        shutil.rmtree(path)
        os.sync()

    def dcp_save(self, r: int, tool: str) -> None:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.work, f"{tool}-{r}")
        kw = {"async_stager": self._stager} if tool == "dcp_cached" else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            with self.timer(tool):
                t0, c0 = time.perf_counter(), time.process_time()
                fut = dcp.async_save(self.kit.dcp_state(), checkpoint_id=path, **kw)  # with get_state_dict
                t1, c1 = time.perf_counter(), time.process_time()
                fut.result()
                t2 = time.perf_counter()
        self.add(tool, "stall_s", t1 - t0)
        # includes DCP's writer thread once it has started: an upper bound on the stall's CPU
        self.add(tool, "stall_cpu_s", c1 - c0)
        self.add(tool, "bg_s", t2 - t1)
        self.rec(tool)["file_bytes"] = dir_bytes(path)
        self.keep_newest(tool, path)

    def torch_save(self, r: int) -> None:
        path = os.path.join(self.work, f"torch-{r}.pt")
        with self.timer("torch_save"):
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(self.kit.torch_state(), f)
                t1 = time.perf_counter()
                f.flush()
                os.fsync(f.fileno())
            t2 = time.perf_counter()
        self.add("torch_save", "stall_s", t1 - t0)  # synchronous: training waits all along
        self.add("torch_save", "bg_s", t2 - t1)  # the fsync after it (durability)
        self.rec("torch_save")["file_bytes"] = os.path.getsize(path)
        self.keep_newest("torch_save", path)

    def save_rounds(self) -> None:
        from ckptctl import Checkpointer

        self.progress("memcpy")
        buf = self.memcpy()
        data = memoryview(buf.numpy()).cast("B")[: self.nbytes]
        self._ck = Checkpointer(os.path.join(self.work, "ckptctl"))
        # A job starts as the README's loop does: load_latest (nothing to resume here), which
        # prepares the staging buffer in the background once every optimizer has stepped. No
        # prepare() call. "ckptctl_bare" below saves with no call before save().
        self._ck.load_latest(self.kit.ck_state())
        # A job's first save comes minutes after its start: let the background preparation end
        # (untimed; the process's CPU is otherwise idle meanwhile, for every tool alike).
        t0 = time.perf_counter()
        staging = self._ck._saver.staging
        while staging.held and not staging.ready and time.perf_counter() - t0 < 60:
            time.sleep(0.01)
        self.res["prepared_in_background_s"] = time.perf_counter() - t0
        self._stager = None
        if "dcp_cached" not in self.skip:
            # Kept across saves, a stager reuses its host copies (StateDictStager caches
            # storages). FileSystemWriter(cache_staged_state_dict=True) would too, but it pins
            # memory, which needs an accelerator. Synchronous staging: async_save returns after
            # the copy, as ckptctl's save() does.
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            for r in range(1 + self.repeat):
                self.progress(f"save round {r}" + (" (first saves)" if r == 0 else ""))

                def ck() -> None:
                    self.memcpy_prefaulted(buf, in_round=True)  # its paired limit, right before
                    self.ckptctl_save(r)

                steps = [("raw", lambda: self.raw_write(r, data)), ("ckptctl", ck),
                         ("dcp", lambda: self.dcp_save(r, "dcp")), ("dcp_cached", lambda: self.dcp_save(r, "dcp_cached")),
                         ("torch_save", lambda: self.torch_save(r))]
                if r == 0:
                    steps.append(("ckptctl_bare", self.bare_first_save))
                order = steps[r % len(steps):] + steps[: r % len(steps)]  # who goes first rotates
                self.res.setdefault("save_order", []).append([t for t, _ in order])
                for tool, fn in order:
                    if r == 0:
                        # Every cold first save starts from the same heap: what an earlier tool
                        # freed goes back to the OS, so nobody reuses another tool's warm pages.
                        free_memory()
                    self.attempt(tool, fn)
        finally:
            self.attempt("ckptctl", self._ck.close)  # releases its staging buffer
            if self._stager is not None:
                self._stager.close()
            self._ck = self._stager = None
            del data, buf
            free_memory()
        self.keep_newest("dcp_cached", None)  # same format as "dcp": one read-back is enough

    # --- reads --------------------------------------------------------------------------

    def read_rounds(self) -> None:
        from ckptctl import Checkpointer
        from ckptctl.ops.verify.engine import verify_checkpoint
        from ckptctl.storage import open_storage

        from ckptctl.settings import IO_THREADS, VERIFY_THREADS

        self.res["threads"] = {"verify": VERIFY_THREADS, "load": IO_THREADS}
        target = self.kit.target()  # pre-allocated and touched, like a live model
        want = self.kit.tensors()
        raw_size = os.path.getsize(self.paths["raw"]) if "raw" in self.paths else 0
        data_buf = torch.empty(max(self.nbytes, raw_size, 1), dtype=torch.uint8)
        data_buf.fill_(0)
        data = memoryview(data_buf.numpy()).cast("B")

        def cold(tool: str, path: str) -> None:
            drop_cache(path)
            self.add(tool, "resident_before_read", resident_fraction(path))

        def raw() -> None:
            path = self.paths["raw"]
            cold("raw", path)
            with self.timer("raw"):
                self.add("raw", "read_s", raw_read(path, data))
            # The limits with the thread counts the tools use: verify's and load's.
            for key, n in (("read_verify_threads_s", VERIFY_THREADS), ("read_load_threads_s", IO_THREADS)):
                cold("raw", path)
                with self.timer("raw"), ReadCount() as count:
                    self.add("raw", key, raw_read_threads(path, data, n))
            counted("raw", count)
            cold("raw", path)
            with self.timer("raw"):
                self.add("raw", "read_runs_s", raw_read_runs(path, data, IO_THREADS))

        def verify() -> None:
            path = self.paths["ckptctl"]
            cold("ckptctl", path)
            with self.timer("ckptctl"):
                rep = verify_checkpoint(open_storage(path), "checksums")
            if not rep.ok:
                raise RuntimeError(f"verify found problems: {[str(p) for p in rep.problems]}")
            self.add("ckptctl", "verify_s", rep.seconds)
            self.rec("ckptctl")["verify_bytes"] = rep.bytes_read

        def counted(tool: str, n: ReadCount) -> None:
            self.add(tool, "load_read_storage", n.storage)
            self.add(tool, "load_read_calls", n.calls)
            self.add(tool, "load_cpu_s", n.cpu_s)

        def ck_load() -> None:
            path = self.paths["ckptctl"]
            zero_tensors(target.tensors())
            cold("ckptctl", path)
            with self.timer("ckptctl"), ReadCount() as n:
                t0 = time.perf_counter()
                ck = Checkpointer(os.path.dirname(path))  # a resume: a new Checkpointer...
                ck.load(path, target.ck_state())
                self.add("ckptctl", "load_s", time.perf_counter() - t0)
            ck.close()  # ...which the job keeps for its saves: unmapping its buffer is no part of the load
            counted("ckptctl", n)
            self.rec("ckptctl")["load_correct"] = same_tensors(want, target.tensors())

        held: list[Any] = []  # a Checkpointer kept across the rounds, holding its staging buffer

        def ck_load_held() -> None:
            path = self.paths["ckptctl"]
            if not held:  # untimed: a job that prepared (or saved) before it loads
                held.append(Checkpointer(os.path.dirname(path)))
                held[0].prepare(target.ck_state())
                staging = held[0]._saver.staging  # prepare() faults the buffer in the background:
                t0 = time.perf_counter()  # let it end, or the first timed load waits for it
                while staging.held and not staging.ready and time.perf_counter() - t0 < 60:
                    time.sleep(0.01)
            zero_tensors(target.tensors())
            cold("ckptctl_held", path)
            with self.timer("ckptctl_held"), ReadCount() as n:
                t0 = time.perf_counter()
                held[0].load(path, target.ck_state())
                self.add("ckptctl_held", "load_s", time.perf_counter() - t0)
            counted("ckptctl_held", n)
            self.rec("ckptctl_held")["file_bytes"] = self.rec("ckptctl").get("file_bytes")
            self.rec("ckptctl_held")["load_correct"] = same_tensors(want, target.tensors())

        def dcp_load() -> None:
            path = self.paths["dcp"]
            zero_tensors(target.tensors())
            cold("dcp", path)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with self.timer("dcp"), ReadCount() as n:
                    t0 = time.perf_counter()
                    target.dcp_load(path)  # get_state_dict + dcp.load (+ set_state_dict)
                    self.add("dcp", "load_s", time.perf_counter() - t0)
            counted("dcp", n)
            self.rec("dcp")["load_correct"] = same_tensors(want, target.tensors())

        def torch_load() -> None:
            path = self.paths["torch_save"]
            zero_tensors(target.tensors())
            cold("torch_save", path)
            with self.timer("torch_save"), ReadCount() as n:
                t0 = time.perf_counter()
                # Into the same live tensors as the others: torch.load allocates its own
                # copies, then load_state_dict (or copy_) puts them in place.
                loaded = torch.load(path, weights_only=True)
                target.torch_load_into(loaded)
                self.add("torch_save", "load_s", time.perf_counter() - t0)
            counted("torch_save", n)
            del loaded
            self.rec("torch_save")["load_correct"] = same_tensors(want, target.tensors())
            free_memory()

        steps = [("raw", raw), ("ckptctl", verify), ("ckptctl", ck_load), ("ckptctl", ck_load_held), ("dcp", dcp_load),
                 ("torch_save", torch_load)]
        for r in range(self.repeat):
            self.progress(f"read round {r}")
            order = steps[r % len(steps):] + steps[: r % len(steps)]  # who goes first rotates
            self.res.setdefault("read_order", []).append([fn.__name__ for _, fn in order])
            for tool, fn in order:
                if tool in self.paths:
                    self.attempt(tool, fn)
        for ck in held:
            ck.close()
        # cache-hot: once more without evicting
        if "raw" in self.paths:
            self.attempt("raw", lambda: self.rec("raw").__setitem__("read_hot_s", raw_read(self.paths["raw"], data)))
        if "ckptctl" in self.paths:
            self.attempt("ckptctl", lambda: self.rec("ckptctl").__setitem__(
                "verify_hot_s", verify_checkpoint(open_storage(self.paths["ckptctl"]), "checksums").seconds))
        del target, data, data_buf
        free_memory()


# --- report --------------------------------------------------------------------------------


def best(xs) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return min(xs) if xs else None


def median(xs) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return statistics.median(xs) if xs else None


def durable(r: dict) -> list:
    """Save start -> durable per round: the stall plus the wait for the background write."""
    return [a + b for a, b in zip(r.get("stall_s") or [], r.get("bg_s") or [])]


def figures(res: dict, nbytes: int) -> dict[str, float | None]:
    """The compared figures: each tool's median of its rounds (steady = rounds after the first);
    min and max are shown beside the samples."""
    m, raw, c = res.get("memcpy", {}), res.get("raw", {}), res.get("ckptctl", {})
    d, dc, ts = res.get("dcp", {}), res.get("dcp_cached", {}), res.get("torch_save", {})

    def first(r, key="stall_s"):
        return (r.get(key) or [None])[0]

    def steady(r, key="stall_s"):
        return median((r.get(key) or [])[1:])

    f = {
        "memcpy_s": median(m.get("prefaulted_s")), "memcpy_fresh_s": median(m.get("fresh_s")),
        "raw_write_s": median(raw.get("write_s")), "raw_read_s": median(raw.get("read_s")), "raw_read_hot_s": raw.get("read_hot_s"),
        "raw_read_v_s": median(raw.get("read_verify_threads_s")), "raw_read_l_s": median(raw.get("read_load_threads_s")),
        "ck_first_s": first(c), "ck_steady_s": steady(c), "ck_bg_s": median(c.get("bg_s")), "ck_write_s": median(c.get("write_s")),
        "ck_durable_s": median(durable(c)[1:]),
        "ck_verify_s": median(c.get("verify_s")), "ck_verify_hot_s": c.get("verify_hot_s"), "ck_load_s": median(c.get("load_s")),
        "dcp_first_s": first(d), "dcp_steady_s": steady(d), "dcp_bg_s": median(d.get("bg_s")), "dcp_load_s": median(d.get("load_s")),
        "dcp_durable_s": median(durable(d)[1:]),
        "dcpc_first_s": first(dc), "dcpc_steady_s": steady(dc), "dcpc_bg_s": median(dc.get("bg_s")),
        "dcpc_durable_s": median(durable(dc)[1:]),
        "ts_save_s": median(ts.get("stall_s")), "ts_load_s": median(ts.get("load_s")),
        "memcpy_cpu_s": median(m.get("prefaulted_cpu_s")), "memcpy_fresh_cpu_s": median(m.get("fresh_cpu_s")),
        "ck_first_cpu_s": first(c, "stall_cpu_s"), "ck_steady_cpu_s": steady(c, "stall_cpu_s"),
        "dcp_first_cpu_s": first(d, "stall_cpu_s"), "dcp_steady_cpu_s": steady(d, "stall_cpu_s"),
        "dcpc_first_cpu_s": first(dc, "stall_cpu_s"), "dcpc_steady_cpu_s": steady(dc, "stall_cpu_s"),
    }
    vb = c.get("verify_bytes", nbytes)
    f["ck_verify_gbps"] = gbps(vb, f["ck_verify_s"])
    f["ck_verify_hot_gbps"] = gbps(vb, f["ck_verify_hot_s"])
    return f


def paired(num: list | None, den: list | None) -> list[float]:
    """Per-round ratios num[r] / den[r] (both lists in round order; a tool that failed has a
    shorter list, so pairs stop there)."""
    return [a / b for a, b in zip(num or [], den or []) if a is not None and b]


def ratios(res: dict, f: dict, nbytes: int) -> dict[str, dict[str, Any]]:
    """Each ratio as the per-round pairs (each ckptctl sample over the reference measured beside
    it in the same round), their median (the verdict uses it), min and max; ``best`` = best
    over best, for reference."""
    m, raw, c = res.get("memcpy", {}), res.get("raw", {}), res.get("ckptctl", {})
    d, dc, ts = res.get("dcp", {}), res.get("dcp_cached", {}), res.get("torch_save", {})
    h = res.get("ckptctl_held", {})

    def bdiv(a, b):
        a, b = best(a), best(b)
        return a / b if a is not None and b else None

    def steady(r: dict, key: str = "stall_s") -> list:
        return (r.get(key) or [])[1:]

    def first(r: dict, key: str = "stall_s") -> list:
        return (r.get(key) or [])[:1]

    vb = c.get("verify_bytes", nbytes)
    scale = nbytes / vb if vb else 1.0  # verify reads the header too: compare bytes per second
    rv, rl = raw.get("read_verify_threads_s"), raw.get("read_load_threads_s")
    out: dict[str, tuple[list[float], float | None]] = {
        # stalls and times: lower is better, ratio = ckptctl / reference
        "steady_stall_vs_memcpy": (paired(steady(c), steady(m, "round_s")), bdiv(steady(c), m.get("prefaulted_s"))),
        "steady_stall_vs_dcp": (paired(steady(c), steady(dc)), bdiv(steady(c), steady(dc))),
        "first_stall_vs_dcp": (paired(first(c), first(dc)), None),
        "bare_first_stall_vs_dcp": (paired(first(res.get("ckptctl_bare", {})), first(dc)), None),
        "durable_vs_dcp": (paired(durable(c)[1:], durable(dc)[1:]), bdiv(durable(c)[1:], durable(dc)[1:])),
        "steady_stall_vs_dcp_default": (paired(steady(c), steady(d)), bdiv(steady(c), steady(d))),
        "first_stall_vs_dcp_default": (paired(first(c), first(d)), None),
        "durable_vs_dcp_default": (paired(durable(c)[1:], durable(d)[1:]), bdiv(durable(c)[1:], durable(d)[1:])),
        "first_stall_vs_memcpy_fresh": ([], bdiv(first(c), m.get("fresh_s"))),
        "cpu_steady_vs_memcpy": (paired(steady(c, "stall_cpu_s"), steady(m, "round_cpu_s")), None),
        "cpu_steady_vs_dcp": (paired(steady(c, "stall_cpu_s"), steady(dc, "stall_cpu_s")), None),
        # throughputs: higher is better, ratio = reference time / ckptctl time
        "write_vs_raw": (paired(raw.get("write_s"), c.get("bg_s")), bdiv(raw.get("write_s"), c.get("bg_s"))),
        "write_s_vs_raw": (paired(raw.get("write_s"), c.get("write_s")), bdiv(raw.get("write_s"), c.get("write_s"))),
        "verify_vs_raw_read": ([x / scale for x in paired(rv, c.get("verify_s"))], None),
        "verify_vs_raw_read_1": ([x / scale for x in paired(raw.get("read_s"), c.get("verify_s"))], None),
        "verify_hot_vs_read_hot": ([], div_(f["ck_verify_hot_gbps"], gbps(nbytes, f["raw_read_hot_s"]))),
        "load_vs_raw_read": (paired(rl, c.get("load_s")), None),
        "load_vs_dcp": (paired(d.get("load_s"), c.get("load_s")), None),
        "load_vs_torch": (paired(ts.get("load_s"), c.get("load_s")), None),
        "held_load_vs_raw_read": (paired(rl, h.get("load_s")), None),
        "load_cpu_vs_raw": (paired(c.get("load_cpu_s"), raw.get("load_cpu_s")), None),
        "held_load_cpu_vs_raw": (paired(h.get("load_cpu_s"), raw.get("load_cpu_s")), None),
        "load_cpu_vs_dcp": (paired(c.get("load_cpu_s"), d.get("load_cpu_s")), None),
        "held_load_vs_dcp": (paired(d.get("load_s"), h.get("load_s")), None),
        "raw_read_vs_dcp": (paired(d.get("load_s"), [min(a, b) for a, b in zip(rl or [], raw.get("read_runs_s") or [])]), None),
        "held_storage_vs_size": (per_size(h, "load_read_storage"), None),
        "held_calls_vs_size": (per_size(h, "load_read_calls"), None),
        # bytes: lower is better, ratio = bytes read / the checkpoint's bytes on disk
        "load_storage_vs_size": (per_size(c, "load_read_storage"), None),
        "load_calls_vs_size": (per_size(c, "load_read_calls"), None),
        "dcp_storage_vs_size": (per_size(d, "load_read_storage"), None),
        "torch_storage_vs_size": (per_size(ts, "load_read_storage"), None),
    }
    return {k: {"paired": pr, "median": statistics.median(pr) if pr else None,
                "min": min(pr) if pr else None, "max": max(pr) if pr else None, "best": b}
            for k, (pr, b) in out.items()}


def per_size(r: dict, key: str) -> list[float]:
    """Each round's bytes read (``key``) over the tool's checkpoint size on disk."""
    size = r.get("file_bytes")
    return [x / size for x in (r.get(key) or []) if x is not None and size]


def div_(a, b):
    return a / b if a is not None and b else None


def headline(r: dict[str, Any]) -> float | None:
    """The figure a verdict is given on: the paired median, or best/best without pairs."""
    return r["median"] if r["median"] is not None else r["best"]


def verdict(value: float | None, op: str, bound: float) -> str:
    if value is None:
        return "n/a"
    return "PASS" if (value <= bound if op == "<=" else value >= bound) else "MISS"


def print_report(res: dict, nbytes: int, out=sys.stdout) -> None:
    def p(*a):
        print(*a, file=out)

    def ms(s):
        return f"{s * 1e3:9.1f} ms" if s is not None else "      n/a   "

    def thr(s, nb=nbytes):
        v = gbps(nb, s)
        return f"{v:7.2f} GB/s" if v is not None else "      n/a  "

    def samples(xs):
        return "[" + " ".join(f"{x:.2f}" if x is not None else "-" for x in (xs or [])) + "] s"

    def resid(xs):
        xs = [x for x in (xs or []) if x is not None]
        if not xs:
            return "cache state unknown"
        hi = max(xs)
        return "cold (0% cached)" if hi < 0.01 else f"up to {hi:.0%} cached" + (" = HOT" if hi > 0.9 else "")

    info, f = res["info"], res["figures"]
    m, raw, c = res.get("memcpy", {}), res.get("raw", {}), res.get("ckptctl", {})
    d, dc, ts = res.get("dcp", {}), res.get("dcp_cached", {}), res.get("torch_save", {})
    p(f"state: {info['kind']}, {gib(nbytes)} in {info['tensors']} tensors ({info['fp32']} fp32, {info['bf16']} bf16; "
      f"largest {info['largest'] / 2**20:.0f} MiB, smallest {info['smallest'] / 2**10:.0f} KiB)")
    p(f"  saved as: {info['saved_as']}")
    p("tools: DCP* = async_save with one DefaultStager kept across saves (reused host copies: DCP at its")
    p("  best, the reference of the targets); DCP default = async_save with its default stager (fresh")
    p("  host copies every save). Both fsync (sync_files=True). First saves are cold for every tool:")
    p("  a fresh Checkpointer (no prepare), a fresh stager. Tool order rotates every round.")
    p("durability when 'durable': ckptctl fsyncs each file, renames it and fsyncs the directory, marker")
    p("  last; DCP fsyncs its data files and .metadata, renames .metadata, no directory fsync;")
    p("  torch.save + fsync here fsyncs the one file. Raw write: 64 MiB pieces + one fsync, no rename.")
    p(f"machine: {info['cpus']} CPUs, torch {info['torch']} ({info['torch_threads']} intra-op threads), "
      f"disk: {info['fs']}; rounds: 1 first + {info['repeat']} steady saves, {info['repeat']} cold reads")
    cp = res.get("cpu_pressure") or {}
    if cp:
        busy = max(cp.values()) > 0.2
        p("cpu pressure (share of each tool's timed sections in which some task waited for a CPU):")
        p("  " + ", ".join(f"{k} {v:.0%}" for k, v in cp.items())
          + ("  -> OTHER WORK COMPETED FOR THE CPUs: trust the paired ratios and CPU times, not single samples" if busy else "  -> quiet"))
    p(f"load average (1 min): {info['loadavg_start']:.2f} at start, {info.get('loadavg_end', float('nan')):.2f} at end")
    p("GB = 1e9 bytes; throughput = state bytes / time; stall = time until the save call returns;")
    p("figures are each tool's median of its rounds (steady: after the first); all samples in [brackets],")
    p("first round first; the ratios at the end pair samples round by round (median, min, max)")
    if res.get("prepared_in_background_s") is not None:
        p(f"ckptctl's first save: load_latest found nothing; its background preparation ended "
          f"{res['prepared_in_background_s']:.2f} s later (waited for, untimed)")
    if res.get("save_order"):
        p("save order per round: " + " | ".join(",".join(o) for o in res["save_order"]))
    p()
    p("MACHINE LIMITS (this run, same state, same disk)")
    p(f"  memcpy into pre-faulted buffer   {ms(f['memcpy_s'])} {thr(f['memcpy_s'])}   {samples(m.get('prefaulted_s'))}")
    p(f"  memcpy into fresh buffer         {ms(f['memcpy_fresh_s'])} {thr(f['memcpy_fresh_s'])}   {samples(m.get('fresh_s'))} page faults incl.")
    p(f"  write 64 MiB pieces + fsync      {ms(f['raw_write_s'])} {thr(f['raw_write_s'])}   {samples(raw.get('write_s'))}")
    p(f"  read, evicted first              {ms(f['raw_read_s'])} {thr(f['raw_read_s'])}   {samples(raw.get('read_s'))} {resid(raw.get('resident_before_read'))}")
    th = res.get("threads", {})
    p(f"  read, evicted, {th.get('verify', '?')} threads (verify) {ms(f['raw_read_v_s'])} {thr(f['raw_read_v_s'])}   {samples(raw.get('read_verify_threads_s'))}")
    p(f"  read, evicted, {th.get('load', '?')} threads (load)   {ms(f['raw_read_l_s'])} {thr(f['raw_read_l_s'])}   {samples(raw.get('read_load_threads_s'))}")
    p(f"  read, evicted, runs as load reads {ms(median(raw.get('read_runs_s')))} {thr(median(raw.get('read_runs_s')))}   {samples(raw.get('read_runs_s'))}")
    p(f"  read, page-cache hot             {ms(f['raw_read_hot_s'])} {thr(f['raw_read_hot_s'])}")
    p()
    p("SAVE STALL (lower is better)           first    steady best  steady median   samples")
    for label, r in (("ckptctl save()", c), ("ckptctl, save() first call", res.get("ckptctl_bare", {})),
                     ("DCP* async_save (kept stager)", dc), ("DCP async_save (default)", d)):
        if r.get("stall_s"):
            st = r["stall_s"]
            p(f"  {label:<30}{ms(st[0])}{ms(best(st[1:]))}{ms(median(st[1:]))}   {samples(st)}")
    if ts.get("stall_s"):
        p(f"  {'torch.save (synchronous)':<30}{ms(ts['stall_s'][0])}{ms(best(ts['stall_s'][1:]))}{ms(median(ts['stall_s'][1:]))}   {samples(ts['stall_s'])}")
    if c.get("manifest_stall_s"):
        ks = c["manifest_stall_s"]
        p(f"  {'ckptctl stall_s (manifest)':<30}{ms(ks[0])}{ms(best(ks[1:]))}{ms(median(ks[1:]))}   capture + copy only")
    p("  CPU time of the process during the stall (not inflated by waiting for a CPU):")
    p(f"  {'  memcpy (fresh / pre-faulted)':<30}{ms(f['memcpy_fresh_cpu_s'])}{ms(f['memcpy_cpu_s'])}")
    for label, r in (("  ckptctl save()", c), ("  DCP* (kept stager)", dc), ("  DCP default", d)):
        xs = r.get("stall_cpu_s")
        if xs:
            p(f"  {label:<30}{ms(xs[0])}{ms(best(xs[1:]))}{ms(median(xs[1:]))}   {samples(xs)}")
    p()
    p("TIME TO DURABLE: save start -> durable (lower is better)  first  steady median   samples")
    for label, r in (("ckptctl (save + wait())", c), ("DCP* (async_save + result())", dc), ("DCP default", d)):
        du = durable(r)
        if du:
            p(f"  {label:<30}{ms(du[0])}{ms(median(du[1:]))}   {samples(du)}")
    if ts.get("stall_s"):
        whole = durable(ts)
        p(f"  {'torch.save + fsync':<30}{ms(whole[0])}{ms(median(whole[1:]))}   {samples(whole)}")
    p()
    p("WRITE: save() return -> durable (higher is better)")
    if c.get("bg_s"):
        p(f"  ckptctl background (wait())      {ms(f['ck_bg_s'])} {thr(f['ck_bg_s'])}   {samples(c['bg_s'])}")
        p(f"  ckptctl write_s (manifest)       {ms(f['ck_write_s'])} {thr(f['ck_write_s'])}   {samples(c.get('write_s'))} hash+shard+fsync, no commit")
    for label, r, k in (("DCP default (result())", d, "dcp_bg_s"), ("DCP kept stager (result())", dc, "dcpc_bg_s")):
        if r.get("bg_s"):
            p(f"  {label:<33}{ms(f[k])} {thr(f[k])}   {samples(r['bg_s'])}")
    if ts.get("stall_s"):
        whole = [a + b for a, b in zip(ts["stall_s"], ts["bg_s"])]
        p(f"  torch.save + fsync, whole        {ms(best(whole))} {thr(best(whole))}   {samples(whole)}")
    p(f"  raw write + fsync                {ms(f['raw_write_s'])} {thr(f['raw_write_s'])}")
    p()
    p("VERIFY / READ, evicted first (higher is better)")
    if c.get("verify_s"):
        vb = c.get("verify_bytes", nbytes)
        p(f"  ckptctl verify (checksums)       {ms(f['ck_verify_s'])} {thr(f['ck_verify_s'], vb)}   {samples(c['verify_s'])} {vb / 2**30:.2f} GiB read")
        p(f"  ckptctl verify, cache-hot        {ms(f['ck_verify_hot_s'])} {thr(f['ck_verify_hot_s'], vb)}")
    p(f"  raw read                         {ms(f['raw_read_s'])} {thr(f['raw_read_s'])}")
    p(f"  raw read, cache-hot              {ms(f['raw_read_hot_s'])} {thr(f['raw_read_hot_s'])}")
    p()
    p("LOAD into the live (pre-allocated, touched) state, evicted first (higher is better)")
    h = res.get("ckptctl_held", {})
    f["ck_held_load_s"] = median(h.get("load_s"))
    for label, r, k in (("ckptctl load(), new Checkpointer", c, "ck_load_s"), ("ckptctl load(), buffer held", h, "ck_held_load_s"),
                        ("DCP load (+ set_state_dict)", d, "dcp_load_s"), ("torch.load + load_state_dict *", ts, "ts_load_s")):
        if r.get("load_s"):
            ok = "ok" if r.get("load_correct") else "DATA MISMATCH"
            p(f"  {label:<33}{ms(f[k])} {thr(f[k])}   {samples(r['load_s'])} {ok}")
    p("  * torch.load allocates its own tensors (page faults included), then they are copied in place")
    p(f"  raw read, {th.get('load', '?')} threads               {ms(f['raw_read_l_s'])} {thr(f['raw_read_l_s'])}")
    resids = [x for r in (c, d, ts) for x in r.get("resident_before_read", []) if x is not None]
    p(f"  checkpoint files cached when their reads began: at most {max(resids):.0%}" if resids else "  cache state unknown")
    p("  bytes read per load (/proc/self/io: storage = read_bytes, calls = rchar), median over rounds:")

    def mib(xs):
        v = median(xs)
        return f"{v / 2**20:8.1f} MiB" if v is not None else "     n/a    "

    for label, r in (("ckptctl load(), new Checkpointer", c), ("ckptctl load(), buffer held", h), ("DCP load", d),
                     ("torch.load", ts), ("raw read (load's threads)", raw)):
        if r.get("load_read_storage"):
            size = r.get("file_bytes", nbytes)
            p(f"  {label:<33}storage {mib(r['load_read_storage'])}  calls {mib(r.get('load_read_calls'))}  "
              f"of {size / 2**20:.1f} MiB on disk")
    p()
    p("ON DISK: " + ", ".join(f"{k} {gib(r['file_bytes'])}" for k, r in (("ckptctl", c), ("DCP", d), ("torch.save", ts)) if "file_bytes" in r))
    p()
    rat = res["ratios"]

    def fmt(v):
        return f"{v:6.2f}" if v is not None else "   n/a"

    def row(key: str, label: str, target: str = "") -> str:
        r = rat[key]
        each = " ".join(f"{x:.2f}" for x in r["paired"])
        return (f"  {label:<48}{fmt(r['median']):>8}{fmt(r['min']):>7}{fmt(r['max']):>7}{fmt(r['best']):>7}  {target:<15}"
                + (f"[{each}]" if each else ""))

    p(f"  {'TARGETS':<48}{'median':>8}{'min':>7}{'max':>7}{'best/':>7}  {'target  result':<15}per-round ratios")
    p(f"  {'':<48}{'':>8}{'':>7}{'':>7}{'best':>7}")
    for key, label, op, bound in TARGETS:
        p(row(key, label, f"{op} {bound:<4} {verdict(headline(rat[key]), op, bound)}"))
    p("  OTHER RATIOS (no target)")
    for key, label in INFO:
        p(row(key, label))
    p("median/min/max: over rounds of (ckptctl / the reference measured beside it in the same round);")
    p("the verdict uses the median (best/best when there are no pairs). Stall and time ratios: lower")
    p("is better; throughput ratios: higher is better.")
    if res.get("errors"):
        p()
        for tool, err in res["errors"].items():
            p(f"ERROR in {tool}: {err}")


def fs_of(path: str) -> str:
    best, found = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, found = mnt, f"{fstype} on {dev} ({mnt})"
    except OSError:
        pass
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ckptctl save/load benchmark against DCP, torch.save and machine limits")
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    ap.add_argument("--tensors", type=int, default=300, help="number of tensors (default 300)")
    ap.add_argument("--dir", default=None, help="where to write (a temporary directory is made inside it; default under /tmp)")
    ap.add_argument("--repeat", type=int, default=5, help="steady-state save rounds and cold read rounds (default 5)")
    ap.add_argument("--state", choices=("model", "flat"), default="model",
                    help="model: a real model + AdamW through the state-dict helpers (default, the headline); "
                         "flat: a flat dict of --tensors tensors (the secondary line)")
    ap.add_argument("--json", action="store_true", help="machine-readable results on stdout (the table goes to stderr)")
    ap.add_argument("--skip", default="", help="comma-separated tools to leave out: dcp, dcp_cached, torch_save")
    ap.add_argument("--ranks", default=None,
                    help="run the multi-rank comparison instead: torchrun with N ranks for each N of this "
                         "comma-separated list, an FSDP2 model of --size-gib (scripts/bench_dist.py)")
    args = ap.parse_args(argv)
    if args.ranks:
        from bench_dist import main as bench_dist_main

        extra = (["--dir", args.dir] if args.dir else []) + (["--json"] if args.json else [])
        return bench_dist_main(["--ranks", args.ranks, "--size-mib", str(args.size_gib * 1024),
                                "--steady", str(max(args.repeat - 1, 1)), *extra])
    repeat = max(args.repeat, 1)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {"dcp", "dcp_cached", "torch_save"}
    if unknown:
        ap.error(f"--skip: unknown tools {sorted(unknown)}")
    log = sys.stderr

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckptctl-bench-", dir=args.dir or "/tmp")
    t_start = time.perf_counter()
    try:
        if args.state == "model":
            dim = 1024
            kit: Any = ModelState(ModelState.blocks_for(int(args.size_gib * 2**30), dim), dim)
            saved_as = ("ckptctl save({'model': model, 'optimizer': opt}); DCP get_state_dict(model, opt) in the "
                        "stall; torch.save({model/opt .state_dict()})")
        else:
            kit = FlatState(build_state(build_specs(int(args.size_gib * 2**30), args.tensors)))
            saved_as = "the same dict {'model': {name: tensor}} by every tool"
        tensors = kit.tensors()
        sizes = [t.numel() * t.element_size() for t in tensors]
        nbytes = sum(sizes)
        bench = Bench(kit, nbytes, work, repeat, skip, log, t_start)
        res = bench.res
        res["info"] = {
            "kind": kit.kind, "saved_as": saved_as, "tensors": len(sizes), "bytes": nbytes, "largest": max(sizes), "smallest": min(sizes),
            "fp32": sum(t.dtype == torch.float32 for t in tensors),
            "bf16": sum(t.dtype == torch.bfloat16 for t in tensors),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "dir": work, "fs": fs_of(os.path.realpath(work)), "repeat": repeat,
            "loadavg_start": os.getloadavg()[0],
        }
        del tensors
        print(f"[bench] state: {gib(nbytes)} in {len(sizes)} tensors; working in {work}", file=log)
        # Import time is nobody's stall.
        import ckptctl.checkpointer as _ck  # noqa: F401
        import torch.distributed.checkpoint as _dcp  # noqa: F401

        bench.save_rounds()
        bench.read_rounds()
        res["info"]["loadavg_end"] = os.getloadavg()[0]
        res["cpu_pressure"] = {k: t.share for k, t in bench.timers.items() if t.share is not None}
        res["figures"] = figures(res, nbytes)
        res["ratios"] = ratios(res, res["figures"], nbytes)
        res["verdicts"] = {k: verdict(headline(res["ratios"][k]), op, b) for k, _, op, b in TARGETS}
        res["elapsed_s"] = time.perf_counter() - t_start
        print_report(res, nbytes, out=log if args.json else sys.stdout)
        print(f"[bench] done in {res['elapsed_s']:.0f}s", file=log)
        if args.json:
            json.dump(res, sys.stdout, indent=2, default=str)
            print()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
