"""Worker processes for tests/test_tiers.py: real ranks on gloo (CPU) saving to tiers.

``launch`` runs a scenario on real processes; each rank writes what its scenario returns as JSON
to ``OUT/rankR.json``. The S3 endpoint comes from the environment
(``AWS_ENDPOINT_URL``), as a user's job gets it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def state_for(step: int, rank: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(step)  # the same on every rank: replicated tensors agree
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "extra": {"rank": rank, "step": step}}


def save_tiers(rank: int, world: int, a: dict) -> dict:
    from ckptctl import Checkpointer, KeepLast, Tier

    ck = Checkpointer(tiers=[Tier(a["local"], retention=KeepLast(2)), Tier(a["remote"], retention=KeepLast(2))],
                      promote_timeout_s=60)
    for step in a["steps"]:
        ck.save(step, state_for(step, rank)).wait()
    flushed = ck.close()
    return {"flushed": None if flushed is None else {"complete": flushed.complete, "step": flushed.step,
                                                      "tiers": list(flushed.tiers)},
            "durable": ck.time_to_durable()}


def load_tiers(rank: int, world: int, a: dict) -> dict:
    import torch

    from ckptctl import Checkpointer, Tier

    state = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "extra": {}}
    ck = Checkpointer(tiers=[Tier(a["local"]), Tier(a["remote"])])
    step = ck.load_latest(state, prepare=False)
    ck.close(promote_timeout_s=1)
    want = state_for(step, rank) if step is not None else None
    equal = want is not None and all(torch.equal(state["model"][k], want["model"][k]) for k in ("w", "b"))
    return {"step": step, "bitwise_equal": equal, "extra": state["extra"]}


def build_fails(rank: int, world: int, a: dict) -> dict:
    """Rank 0 gives its first tier a retention rule, the others do not: every rank's
    constructor raises. What is left running of it: the ckptctl threads, and whether a
    Checkpointer built right after works."""
    import threading

    from ckptctl import Checkpointer, KeepLast, Tier
    from ckptctl.errors import UsageError

    keep = KeepLast(1) if rank == 0 else None
    try:
        Checkpointer(tiers=[Tier(a["local"], retention=keep), Tier(a["remote"])])
        raised = None
    except UsageError as e:
        raised = str(e)
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptctl"))
    ck = Checkpointer(tiers=[Tier(a["local"]), Tier(a["remote"])], promote_timeout_s=30)
    ck.save(1, state_for(1, rank)).wait()
    flushed = ck.close()
    return {"raised": raised, "threads_left": left, "flushed": None if flushed is None else flushed.complete}


def node_saves(rank: int, world: int, a: dict) -> dict:
    """Each rank its own "node" (``GROUP_RANK``) with a node-local first tier under
    ``roots[rank]``: save ``steps`` in turn, each outcome recorded (a failure does not end it)."""
    os.environ["GROUP_RANK"] = str(rank)
    from ckptctl import Checkpointer, Tier

    warned: list[str] = []

    class Warnings(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warned.append(record.getMessage())

    logging.getLogger("ckptctl").addHandler(Warnings())
    tiers = [Tier(a["roots"][rank], node_local=True, replicas=a.get("replicas", 0))]
    if "next" in a:
        tiers.append(Tier(a["next"]))
    ck = Checkpointer(tiers=tiers, timeout_s=a.get("timeout_s", 900.0))
    outcomes = []
    for step in a["steps"]:
        try:
            ck.save(step, state_for(step, rank)).wait()
            outcomes.append("ok")
        except Exception as e:  # the test reads which saves failed, and how
            outcomes.append(f"{type(e).__name__}: {e}")
    ck.close()
    return {"outcomes": outcomes, "warnings": warned}


SCENARIOS = {"save_tiers": save_tiers, "load_tiers": load_tiers, "build_fails": build_fails, "node_saves": node_saves}


def launch(scenario: str, world: int, args: dict, out: str, timeout: float = 120) -> dict[int, dict]:
    """Run ``scenario`` on ``world`` real processes (tcp:// rendezvous on a free port), forked
    from the server that imported torch once (``dist_workers.rank_context``)."""
    from dist_workers import free_port, rank_context

    port = free_port()
    os.makedirs(out, exist_ok=True)
    ctx, env = rank_context(), dict(os.environ)
    procs = [ctx.Process(target=_main, args=(scenario, r, world, port, json.dumps(args), out, env)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict[int, dict] = {}
    for r, p in enumerate(procs):
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
        path = os.path.join(out, f"rank{r}.json")
        results[r] = json.load(open(path)) if os.path.exists(path) else {"exit": p.exitcode}
    return results


def _main(scenario: str, rank: int, world: int, port: int, args: str, out: str, env: dict[str, str]) -> None:
    from dist_workers import use_env

    use_env(env)  # the S3 endpoint among it
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = SCENARIOS[scenario](rank, world, json.loads(args))
    except BaseException as e:  # the test reads the failure from the result file
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    if rank == 0:  # the c10d store lives here: keep it up until every rank is done
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(world)):
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown

