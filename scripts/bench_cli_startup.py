#!/usr/bin/env python
"""Start-up time of ``ckptctl`` commands, next to a bare interpreter and ``import torch``.

    .venv/bin/python scripts/bench_cli_startup.py [--repeat 7] [--root DIR] [--json]

Commands used in shell loops, cron retention jobs and pre-resume checks (``ls``, ``latest``,
``interval``, ``verify``, ``prune``) should cost about an interpreter start, not a torch
import. Each command runs ``--repeat`` times as ``python -m ckptctl ...`` in a fresh process;
the runs are interleaved round-robin (one untimed warm-up round first), so a change in the
machine's load touches every command alike. Printed: the median wall time of each, and its
ratio to ``python -c pass`` and to ``python -c "import torch"`` measured in the same run.

Without ``--root`` a scratch root with three small committed checkpoints is made (in a child
process) and removed at the end. ``prune`` runs ``--dry-run`` after an untimed first prune has
recorded its full verification, as in a cron job with nothing new saved since the last run;
``verify --load`` decodes tensors with torch and is there for reference.

To compare with another checkout (e.g. before a change), run with ``PYTHONPATH=/that/checkout``
(the commands run in a directory outside any checkout, so ``-m`` does not pick up the current
directory's ``ckptctl`` instead).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_MAKE = """
import sys, torch
from ckptctl import Checkpointer
with Checkpointer(sys.argv[1]) as ck:
    for step in (100, 200, 300):
        state = {"model": {f"w{i}": torch.full((4096,), float(step + i)) for i in range(8)}, "extra": {"step": step}}
        ck.save(step, state).wait()
"""


def commands(root: str) -> dict[str, list[str]]:
    py = [sys.executable]
    cli = py + ["-m", "ckptctl"]
    ckpt = os.path.join(root, "step-0000000300")
    return {
        "python -c pass": py + ["-c", "pass"],
        "python -c 'import torch'": py + ["-c", "import torch"],
        "ckptctl --help": cli + ["--help"],
        "ckptctl ls ROOT": cli + ["ls", root],
        "ckptctl latest ROOT": cli + ["latest", root],
        "ckptctl interval --cost 30s --mtbf 1d": cli + ["interval", "--cost", "30s", "--mtbf", "1d"],
        "ckptctl verify CKPT --quick": cli + ["verify", ckpt, "--quick"],
        "ckptctl verify CKPT": cli + ["verify", ckpt],
        "ckptctl inspect CKPT": cli + ["inspect", ckpt],
        "ckptctl prune ROOT --keep-last 2 --dry-run": cli + ["prune", root, "--keep-last", "2", "--dry-run"],
        "ckptctl verify CKPT --load (torch)": cli + ["verify", ckpt, "--load"],
    }


def run_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    elapsed = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stderr}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7, help="timed runs of each command (default 7)")
    ap.add_argument("--root", help="an existing checkpoint root with step-0000000300 committed")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()

    scratch = None
    root = args.root
    if root is None:
        scratch = tempfile.mkdtemp(prefix="ckptctl-bench-startup-")
        root = os.path.join(scratch, "root")
        subprocess.run([sys.executable, "-c", _MAKE, root], check=True, cwd=scratch)
    try:
        cmds = commands(root)
        for argv in cmds.values():  # warm-up: page cache, .pyc files, prune's recorded verification
            run_once(argv)
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(args.repeat):
            for name, argv in cmds.items():
                times[name].append(run_once(argv))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    bare, torch_ = med["python -c pass"], med["python -c 'import torch'"]
    rows = [{"command": name, "median_s": m, "x_python": m / bare, "x_import_torch": m / torch_} for name, m in med.items()]
    if args.json:
        print(json.dumps({"repeat": args.repeat, "python": sys.executable, "rows": rows}, indent=2))
        return
    width = max(len(r["command"]) for r in rows)
    print(f"median of {args.repeat} runs each, interleaved; python: {sys.executable}")
    print(f"{'command':<{width}}  {'median':>8}  {'/ python':>8}  {'/ import torch':>14}")
    for r in rows:
        print(f"{r['command']:<{width}}  {r['median_s']:7.3f}s  {r['x_python']:7.2f}x  {r['x_import_torch']:13.2f}x")


if __name__ == "__main__":
    main()
