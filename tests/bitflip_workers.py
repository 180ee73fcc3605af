"""Long-lived ranks for the bit-flip sweep (tests/test_bitflip_sweep.py): two real processes on
gloo that save a real 2-rank FSDP2 checkpoint, then loop over every flip of the 2-rank and/or the
1-rank checkpoint (``families``: the sweep's parts run apart). Rank 0 flips one bit of the file
in place, all ranks load, each judges its own state against the exact state saved
(``bitflip_lib.judge``), rank 0 flips the bit back. No process is started per flip.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from typing import Any

import torch.distributed as dist

from bitflip_lib import apply_flip, flips, job_state, judge, save_two_steps, scramble, tally
from dist_workers import free_port, rank_context, use_env

WORLD = 2


def run(args: dict[str, Any], out: str, *, timeout: float) -> dict[int, Any]:
    """Start the ranks, wait for them; returns {rank: result}."""
    port = free_port()
    ctx = rank_context()
    env = dict(os.environ)
    procs = [ctx.Process(target=_main, args=(r, port, args, out, env)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results: dict[int, Any] = {}
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
        path = os.path.join(out, f"sweep-rank{r}.json")
        results[r] = json.load(open(path)) if os.path.exists(path) else {"error": f"rank {r} exited {p.exitcode}"}
    return results


def _main(rank: int, port: int, args: dict, out: str, env: dict[str, str]) -> None:
    use_env(env)
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("ckptctl").setLevel(logging.ERROR)  # every fallback warns; thousands of them
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        result = _sweep(rank, args)
    except BaseException as e:  # the test reads the failure from the result file
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    path = os.path.join(out, f"sweep-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if rank == 0:  # rank 0 hosts the store: stay up until the other rank is done
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.path.exists(os.path.join(out, "sweep-rank1.json")):
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


def _sweep(rank: int, a: dict) -> dict:
    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir

    state = job_state("fsdp", WORLD, seed=0)
    with Checkpointer(a["root2"], timeout_s=120) as ck:
        saved2 = save_two_steps(ck, state, "fsdp", rank, WORLD)
    with open(os.path.join(a["out"], f"fp2-rank{rank}.json"), "w") as f:
        json.dump({str(k): v for k, v in saved2.items()}, f)
    if rank == 0:
        shutil.copytree(a["root2"], a["sweep2"])  # flipped in place; the original stays pristine
    with open(a["fp1"]) as f:
        saved1 = {int(k): v for k, v in json.load(f).items()}
    dist.barrier()
    report = {}
    families = [("load_latest 2@2", a["sweep2"], saved2), ("load_latest 1->2", a["sweep1"], saved1)]
    for name, root, expected in (f for f in families if f[0] in a["families"]):
        ckpt = os.path.join(root, step_dir(2))
        todo = flips(ckpt, **a["density"])
        results = []
        with Checkpointer(root, timeout_s=120) as ck:
            for i, f in enumerate(todo):
                if rank == 0:
                    apply_flip(ckpt, f)
                dist.barrier()
                scramble(state, 5000 + i)
                results.append((f, judge(lambda: ck.load_latest(state, prepare=False), state, expected, before=None)))
                dist.barrier()
                if rank == 0:
                    apply_flip(ckpt, f)  # undone
        report[name] = tally(results)
    return report
