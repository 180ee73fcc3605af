"""Throughput and peak memory of ``ckptctl reshard`` and ``ckptctl convert``, against a plain
copy of the same bytes (``cp -r``) and DCP's own ``dcp_to_torch_save``, measured in one run.

    python scripts/bench_reshard.py [--size-mib 1024] [--tensor-mib 64] [--dir /fast/disk]

Every command runs as its own process (as a user runs it); peak RSS is that process's own
(measured from a small parent, so the parent's memory is not counted) minus the baseline of a
process that only imports torch and ckptctl. Each figure is the best of ``--repeat`` runs with
a warm page cache (``cp`` warms it first): the comparison is of the tools' work, not the disk's
first read. reshard's time includes verifying the source (as pass 1 reads it, no read of its
own) and the result (one more read) because the command always does both, and ckptctl fsyncs
what it writes (``cp`` does not; the ``cp -r + sync`` row is the durable copy to compare with).
``--only reshard`` runs the reshard rows (and the cp rows) alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_MEASURE = (
    "import resource, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "dt = time.perf_counter() - t\n"
    "sys.stderr.write(p.stderr[-2000:] if p.returncode else '')\n"
    "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, dt)\n"
)


def run(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of ``cmd`` run as a grandchild of a bare interpreter."""
    p = subprocess.run([sys.executable, "-S", "-c", _MEASURE, *cmd], capture_output=True, text=True)
    code, kib, dt = p.stdout.split()
    if int(code) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr}")
    return float(dt), int(kib) / 1024


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--only", action="append", default=[],
                    help="run only the rows whose label contains this (repeatable); the two cp rows always run")
    args = ap.parse_args()

    import torch

    from ckptctl import Checkpointer

    work = tempfile.mkdtemp(prefix="bench-reshard-", dir=args.dir)
    try:
        n = args.tensor_mib * (1 << 20) // 4
        count = max(1, args.size_mib // args.tensor_mib)
        with Checkpointer(os.path.join(work, "root")) as ck:
            src = ck.save(1, {"model": {f"layer{i:03d}.weight": torch.randn(n // 1024, 1024) for i in range(count)},
                              "extra": {"note": "bench"}}).wait()
        size = du(src)
        py = [sys.executable]
        ckptctl = [*py, "-m", "ckptctl"]
        _, base = run([*py, "-c", "import torch, ckptctl.cli.app, ckptctl.ops.verify.engine, safetensors, torch.distributed.checkpoint"])
        dcp_dir = os.path.join(work, "dcp-src")
        subprocess.run([*ckptctl, "convert", src, dcp_dir, "--to", "dcp"], check=True, capture_output=True)

        startup = min(run([*ckptctl, "--help"])[0] for _ in range(3))  # interpreter + imports
        cases: list[tuple[str, list[str], str]] = [
            ("cp -r (reference)", ["cp", "-r", src, "{out}"], ""),
            ("cp -r + sync", ["sh", "-c", 'cp -r "$0" "$1" && sync', src, "{out}"], ""),
            ("reshard 1 -> 4", [*ckptctl, "reshard", src, "{out}", "--world-size", "4"], ""),
            ("reshard 1 -> 3", [*ckptctl, "reshard", src, "{out}", "--world-size", "3"], ""),
            ("convert -> safetensors", [*ckptctl, "convert", src, "{out}", "--to", "safetensors"], ""),
            ("convert -> torch", [*ckptctl, "convert", src, "{out}", "--to", "torch"], ".pt"),
            ("convert -> dcp", [*ckptctl, "convert", src, "{out}", "--to", "dcp"], ""),
            ("convert dcp -> torch", [*ckptctl, "convert", dcp_dir, "{out}", "--to", "torch"], ".pt"),
            ("dcp_to_torch_save", [*py, "-c", "import sys, warnings; warnings.simplefilter('ignore');"
                                   "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
                                   "dcp_to_torch_save(sys.argv[1], sys.argv[2])", dcp_dir, "{out}"], ".pt"),
        ]
        if args.only:
            cases = [c for c in cases if c[0].startswith("cp") or any(o in c[0] for o in args.only)]
        results = []
        for label, cmd, suffix in cases:
            best_t, best_m = float("inf"), 0.0
            for i in range(args.repeat):
                out = os.path.join(work, f"out-{len(results)}-{i}{suffix}")
                t, m = run([c.replace("{out}", out) for c in cmd])
                best_t, best_m = min(best_t, t), max(best_m, m)
                shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else os.unlink(out)
            results.append((label, best_t, best_m))
        cp_t, sync_t = results[0][1], results[1][1]
        print(f"checkpoint {size / 2**20:.0f} MiB in {count} tensors of {args.tensor_mib} MiB; {os.cpu_count()} CPUs; "
              f"baseline RSS (interpreter + torch + ckptctl + DCP imported) {base:.0f} MiB; "
              f"python startup {startup:.2f}s (subtracted from the python rows' 'work' column)")
        print(f"{'operation':<24}{'seconds':>9}{'work s':>8}{'MiB/s':>8}{'vs cp':>7}{'vs cp+sync':>11}{'peak RSS':>10}{'above base':>12}")
        for label, t, m in results:
            work_t = t if label.startswith("cp") else max(t - startup, 1e-3)
            rate = size / 2**20 / work_t
            print(f"{label:<24}{t:>9.2f}{work_t:>8.2f}{rate:>8.0f}{cp_t / work_t:>7.2f}{sync_t / work_t:>11.2f}"
                  f"{m:>8.0f}Mi{m - base:>10.0f}Mi")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
