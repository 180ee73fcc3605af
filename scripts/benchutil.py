"""Helpers shared by the benchmark scripts: page-cache eviction, file sizes, CPU pressure."""

from __future__ import annotations

import os


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
