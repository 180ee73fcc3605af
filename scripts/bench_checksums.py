#!/usr/bin/env python
"""Checksum speed on this machine: GB/s per core, best of N, on one large in-memory buffer.

    .venv/bin/python scripts/bench_checksums.py [--mib 512] [--repeat 3] [--json]

Cited by ``ckptctl/format/checksum.py``: the format's checksum must hash at 10 GB/s or more
per core, so the writer thread's hashing stays small next to the disk. Each algorithm runs on
one thread ("per core"); a second figure runs one hash per core at once on separate halves of
the buffer (aggregate ≈ cores × one thread unless the GIL or memory bandwidth limits it), and a
probe measures directly whether a hash call releases the GIL: the longest pause a pure-Python
loop sees while another thread hashes (what the training thread feels while the writer hashes).

Algorithms: xxh3_64 and xxh64 (``xxhash``), crc32c (``crc32c`` module, and ``google_crc32c``
when importable; skipped when neither is), zlib.crc32, hashlib.sha256. GB = 10**9 bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
import zlib
from typing import Callable

import numpy as np


def algorithms() -> dict[str, tuple[Callable[[bytes], object], str]]:
    """name -> (hash whole buffer, note). Optional modules are skipped when absent."""
    algos: dict[str, tuple[Callable[[bytes], object], str]] = {}
    try:
        import xxhash

        algos["xxh3_64"] = (xxhash.xxh3_64_intdigest, f"xxhash {xxhash.VERSION}")
        algos["xxh64"] = (xxhash.xxh64_intdigest, f"xxhash {xxhash.VERSION}")
    except ImportError:
        print("xxhash not importable: skipped", file=sys.stderr)
    try:
        import crc32c

        hw = "hardware" if getattr(crc32c, "hardware_based", False) else "software"
        algos["crc32c"] = (crc32c.crc32c, f"crc32c {getattr(crc32c, '__version__', '?')} ({hw})")
    except ImportError:
        print("crc32c module not importable: skipped", file=sys.stderr)
    try:
        import google_crc32c

        algos["crc32c (google_crc32c)"] = (google_crc32c.value, f"google_crc32c ({google_crc32c.implementation})")
    except ImportError:
        pass
    algos["zlib.crc32"] = (zlib.crc32, f"zlib {zlib.ZLIB_RUNTIME_VERSION}")
    algos["sha256"] = (lambda b: hashlib.sha256(b).digest(), "hashlib (OpenSSL)")
    return algos


def best_time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def concurrent_time(fn: Callable[[bytes], object], parts: list[bytes]) -> float:
    """Wall time for hashing each part in its own thread, all at once."""
    barrier = threading.Barrier(len(parts) + 1)

    def work(p: bytes) -> None:
        barrier.wait()
        fn(p)

    threads = [threading.Thread(target=work, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def gil_probe(fn: Callable[[bytes], object], data: bytes, seconds: float = 0.6) -> tuple[float, float]:
    """(longest pause a pure-Python loop sees while another thread hashes ``data`` over and
    over, time of one hash call), in seconds. A hash that holds the GIL pauses the loop for a
    whole call; one that releases it leaves only the scheduler's noise (a few ms on a VM).
    The loop stands in for the training thread while the writer thread hashes."""
    stop = threading.Event()

    def hash_loop() -> None:
        while not stop.is_set():
            fn(data)

    t = threading.Thread(target=hash_loop)
    t.start()
    time.sleep(0.02)
    try:
        last = time.perf_counter()
        end, gap = last + seconds, 0.0
        while last < end:
            now = time.perf_counter()
            gap = max(gap, now - last)
            last = now
    finally:
        stop.set()
        t.join()
    t0 = time.perf_counter()
    fn(data)
    return gap, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="buffer size in MiB (default 512)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for the concurrent figure (default: CPU count; 1 disables it)")
    ap.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = ap.parse_args(argv)

    n = args.mib << 20
    # Random bytes (incompressible, no special cases), generated fast and resident before timing.
    # ``bytes``, not a memoryview: google_crc32c's C entry point accepts nothing else.
    data = np.random.default_rng(0).bytes(n)
    step = n // max(args.threads, 1)
    parts = [data[i * step : (i + 1) * step] for i in range(max(args.threads, 1))]

    rows = []
    for name, (fn, note) in algorithms().items():
        fn(data[: 1 << 20])  # warm up (imports, CPU feature dispatch)
        t = best_time(lambda: fn(data), args.repeat)
        row = {"algorithm": name, "gb_per_s_per_core": n / t / 1e9, "seconds": t, "impl": note}
        if args.threads > 1:
            tc = min(concurrent_time(fn, parts) for _ in range(args.repeat))
            row["threads"] = args.threads
            row["gb_per_s_concurrent"] = step * args.threads / tc / 1e9
        probes = [gil_probe(fn, data) for _ in range(args.repeat)]
        pause, call = min(p[0] for p in probes), min(p[1] for p in probes)
        row["python_pause_s"], row["call_s"] = pause, call
        row["releases_gil"] = pause < 0.6 * call
        rows.append(row)

    if args.json:
        json.dump({"buffer_bytes": n, "repeat": args.repeat, "cpu_count": os.cpu_count(), "results": rows}, sys.stdout, indent=2)
        print()
        return 0
    print(f"checksums on a {args.mib} MiB buffer, best of {args.repeat}, {os.cpu_count()} CPUs (GB = 1e9 bytes)")
    conc = args.threads > 1
    head = (f"{'algorithm':<24}{'GB/s/core':>10}" + (f"{f'GB/s x{args.threads} thr':>16}" if conc else "")
            + f"{'py pause/call ms':>18}{'GIL freed':>10}  implementation")
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r['algorithm']:<24}{r['gb_per_s_per_core']:>10.2f}"
        if conc:
            line += f"{r['gb_per_s_concurrent']:>16.2f}"
        pc = f"{r['python_pause_s'] * 1e3:.0f}/{r['call_s'] * 1e3:.0f}"
        print(line + f"{pc:>18}{('yes' if r['releases_gil'] else 'NO'):>10}  {r['impl']}")
    print("target for the format's checksum: >= 10 GB/s per core")
    print(f"py pause/call: longest pause of a Python loop while another thread hashes the whole "
          f"{args.mib} MiB, beside one call's time (pause ~ call: the hash holds the GIL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
