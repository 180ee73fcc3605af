"""Helpers shared by the benchmark scripts: page-cache eviction, file sizes, CPU pressure,
page-cache state and the per-phase timing of a rank's shard write (``write_phases``)."""

from __future__ import annotations

import os
import time


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for d, _, names in os.walk(path):
        out.extend(os.path.join(d, n) for n in names)
    return out


def drop_cache(path: str) -> bool:
    """Evict every file under ``path`` from the page cache (fsync first: dirty pages stay).
    False when the platform cannot (no posix_fadvise): reads are then cache-hot."""
    ok = hasattr(os, "posix_fadvise")
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if ok:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return ok


class ReadCount:
    """Bytes this process read over a block, from ``/proc/self/io`` (every thread's, finished
    ones included): ``storage`` (``read_bytes``: what the block layer read for it, so a page
    cache hit counts nothing) and ``calls`` (``rchar``: every byte a read call returned, page
    cache, sockets and temporary files included); None where the kernel does not say. And
    ``cpu_s``, the process's CPU time over the block (not inflated by waiting for a CPU)."""

    storage: int | None = None
    calls: int | None = None
    cpu_s: float = 0.0

    @staticmethod
    def _now() -> dict[str, int] | None:
        try:
            with open("/proc/self/io") as f:
                return {k: int(v) for k, v in (line.split(": ") for line in f)}
        except (OSError, ValueError):
            return None

    def __enter__(self) -> "ReadCount":
        self._before = self._now()
        self._cpu = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = time.process_time() - self._cpu
        after = self._now()
        if self._before is not None and after is not None:
            self.storage = after["read_bytes"] - self._before["read_bytes"]
            self.calls = after["rchar"] - self._before["rchar"]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


def cpu_pressure_us() -> int | None:
    """Total microseconds some runnable task waited for a CPU (Linux PSI), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_memory() -> None:
    """Collect garbage and hand the heap's free memory back to the OS (glibc ``malloc_trim``),
    so that the next allocation does not reuse pages another tool just freed."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def meminfo_mib() -> tuple[float, float]:
    """(Dirty, Writeback) of the whole machine in MiB, from /proc/meminfo (NaN elsewhere)."""
    got: dict[str, float] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Dirty", "Writeback"):
                    got[key] = int(value.split()[0]) / 1024
    except (OSError, ValueError):
        pass
    return got.get("Dirty", float("nan")), got.get("Writeback", float("nan"))


def _phase_rank(mode: str, rank: int, nbytes: int, rounds: int, work: str, barrier, queue) -> None:
    """One process of ``write_phases``: hash, write and make durable ``nbytes`` per round,
    timing each phase, the way a rank's writer thread does."""
    import secrets
    import time

    import xxhash

    from ckptctl.storage.local import LocalStorage

    piece = 4 << 20
    data = memoryview(bytearray(secrets.token_bytes(1 << 20)) * (nbytes >> 20)).cast("B")
    for r in range(rounds):
        sub = os.path.join(work, f"{mode}-{r}")
        os.makedirs(sub, exist_ok=True)
        barrier.wait()
        dirty = meminfo_mib()
        t = {"hash": 0.0, "write": 0.0}
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "ckptctl":
            w = LocalStorage(sub).open_writer(f"rank{rank}")
            for pos in range(0, len(data), piece):
                a = time.perf_counter()
                xxhash.xxh3_64_intdigest(data[pos : pos + piece])
                b = time.perf_counter()
                w.write(data[pos : pos + piece])
                t["hash"] += b - a
                t["write"] += time.perf_counter() - b
            a = time.perf_counter()
            w.commit()  # fsync, rename, directory fsync (write-behind already flushed most)
            t["fsync+rename+dir fsync"] = time.perf_counter() - a
        else:  # plain: every byte into the page cache, one fsync at the end, pages kept
            dfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
            fd = os.open(f".rank{rank}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            for pos in range(0, len(data), piece):
                a = time.perf_counter()
                xxhash.xxh3_64_intdigest(data[pos : pos + piece])
                b = time.perf_counter()
                os.write(fd, data[pos : pos + piece])
                t["hash"] += b - a
                t["write"] += time.perf_counter() - b
            a = time.perf_counter()
            os.fsync(fd)
            os.close(fd)
            b = time.perf_counter()
            os.rename(f".rank{rank}.tmp", f"rank{rank}", src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            os.close(dfd)
            t["fsync"], t["rename+dir fsync"] = b - a, time.perf_counter() - b
        t["total"] = time.perf_counter() - t0
        t["cpu"] = time.process_time() - c0
        queue.put((mode, r, rank, dirty, t))
        barrier.wait()


def write_phases(ranks: int, nbytes: int, rounds: int, work: str) -> list[tuple]:
    """Where a rank's time to durable goes: ``ranks`` processes write ``nbytes`` each, ``rounds``
    times, first as a plain writer (write everything, fsync once, keep the pages), then through
    ckptctl's LocalWriter (write-behind, pages dropped once on disk). Every file is kept, as a
    job keeping its checkpoints would. Rows: (mode, round, rank, (Dirty, Writeback) MiB before,
    {phase: seconds})."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows: list[tuple] = []
    for mode in ("plain", "ckptctl"):
        barrier, queue = ctx.Barrier(ranks), ctx.Queue()
        procs = [ctx.Process(target=_phase_rank, args=(mode, r, nbytes, rounds, work, barrier, queue)) for r in range(ranks)]
        for p in procs:
            p.start()
        rows += [queue.get() for _ in range(ranks * rounds)]
        for p in procs:
            p.join()
    return sorted(rows, key=lambda x: (x[0] != "plain", x[1], x[2]))


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) used so far by process ``pid``, or None
    where /proc cannot tell (another platform, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces: count the fields after its ')'.
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def wait_quiet(pids: list[int], window_s: float = 0.3, busy: float = 0.05, timeout_s: float = 120.0) -> float:
    """Wait until the processes ``pids`` (this one included, when its own background threads
    matter) together use less than ``busy`` of a CPU over ``window_s``: the background work a
    tool left behind (a prune, a re-read, a server still serving) is over before the next
    timed section. Returns the seconds waited (``timeout_s`` at most: then it gives up)."""
    import time

    t0 = time.perf_counter()
    before = [process_cpu_s(p) for p in pids]
    while True:
        time.sleep(window_s)
        now = [process_cpu_s(p) for p in pids]
        used = sum(b - a for a, b in zip(before, now) if a is not None and b is not None)
        waited = time.perf_counter() - t0
        if used < busy * window_s or waited >= timeout_s:
            return waited
        before = now
