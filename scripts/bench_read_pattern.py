#!/usr/bin/env python
"""How a load should read a local file: ranges spread over threads, or long sequential runs.

    .venv/bin/python scripts/bench_read_pattern.py [--size-mib 480] [--repeat 7] [--dir PATH]

Writes one file of random bytes, then reads it into a pre-faulted buffer, evicted from the page
cache before every read, in each pattern below, hashing every piece read (XXH3, as a load
does). The patterns run in a new random order every round; each is reported as the median over
rounds of (the reference's time / its time) in the same round, with its process CPU time:

* ``ranges``: the reference, ``bench_save``'s "raw read (load's threads)": 16 MiB ranges, one
  pread each, on ``CKPTCTL_IO_THREADS`` threads;
* ``run R step S, T threads``: the file cut into runs of R MiB, each read front to back in S MiB
  calls by one of T threads (what ``load.staged`` and ``CheckpointReader.verify_many`` do with
  ``settings.SEQUENTIAL_RUN`` and ``READ_STEP``).

GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import xxhash

from benchutil import drop_cache

MiB = 1 << 20


def main() -> None:
    from ckptctl.settings import IO_THREADS, READ_STEP, SEQUENTIAL_RUN

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=480)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where the file is written (default: $TMPDIR)")
    args = ap.parse_args()
    size = args.size_mib * MiB
    fd_, path = tempfile.mkstemp(prefix="ckptctl-read-pattern-", dir=args.dir)
    try:
        with os.fdopen(fd_, "wb") as f:
            for _ in range(0, size, 64 * MiB):
                f.write(os.urandom(min(64 * MiB, size - f.tell())))
            f.flush()
            os.fsync(f.fileno())
        buf = torch.empty(size, dtype=torch.uint8)
        buf.fill_(1)  # pre-faulted, as a held staging buffer
        mem = memoryview(buf.numpy()).cast("B")

        def pattern(run: int, step: int, threads: int) -> Callable[[], None]:
            def go() -> None:
                fd = os.open(path, os.O_RDONLY)

                def one(lo: int) -> None:
                    hi = min(lo + run, size)
                    for pos in range(lo, hi, step):
                        view = mem[pos : min(pos + step, hi)]
                        os.preadv(fd, [view], pos)
                        xxhash.xxh3_64_intdigest(view)

                try:
                    with ThreadPoolExecutor(threads) as pool:
                        list(pool.map(one, range(0, size, run)))
                finally:
                    os.close(fd)
            return go

        cases = {"ranges: 16 MiB, one pread each, %d threads" % IO_THREADS: pattern(16 * MiB, 16 * MiB, IO_THREADS)}
        for run, step, threads in [(SEQUENTIAL_RUN, READ_STEP, IO_THREADS), (16 * MiB, READ_STEP, IO_THREADS),
                                   (SEQUENTIAL_RUN, 16 * MiB, IO_THREADS), (size, READ_STEP, 1),
                                   (-(-size // 2), READ_STEP, 2), (SEQUENTIAL_RUN, READ_STEP // 4, IO_THREADS)]:
            cases[f"run {run // MiB} MiB, step {step / MiB:g} MiB, {threads} threads"] = pattern(run, step, threads)
        wall: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(args.repeat):
            order = list(cases)
            random.shuffle(order)
            for name in order:
                drop_cache(path)
                c0, t0 = time.process_time(), time.perf_counter()
                cases[name]()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            print(f"[bench] round {r} done", file=sys.stderr, flush=True)
        ref = wall[next(iter(cases))]
        print(f"{args.size_mib} MiB, evicted before every read, {args.repeat} rounds; load average "
              f"{os.getloadavg()[0]:.1f} at the end")
        print(f"{'pattern':48s} {'median':>8s} {'GB/s':>6s} {'CPU':>8s}  ref/this (median, min-max)")
        for name in cases:
            pairs = [a / b for a, b in zip(ref, wall[name])]
            t = statistics.median(wall[name])
            print(f"{name:48s} {t * 1e3:6.0f}ms {size / t / 1e9:6.2f} {statistics.median(cpu[name]) * 1e3:6.0f}ms  "
                  f"{statistics.median(pairs):.2f} ({min(pairs):.2f}-{max(pairs):.2f})")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
