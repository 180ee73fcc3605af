"""Worker processes for tests/test_distributed.py: real ranks on gloo, on CPU.

Each scenario is a function ``(rank, world_size, args) -> dict`` run in its own process by
``launch``; what it returns is written as JSON to ``{out}/rank{r}.json`` for the test to read.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, world_size: int, args: dict[str, Any], out: str, *, timeout: float = 180) -> dict[int, Any]:
    """Run ``scenario`` on ``world_size`` real processes; returns {rank: result or exit code}.

    ``args["store"] == "launcher"``: the c10d store lives in this process, as torchrun's lives
    in its agent, and outlives any rank; otherwise rank 0 hosts it (tcp:// init)."""
    port = free_port()
    store = None
    if args.get("store") == "launcher":
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    env = dict(os.environ)
    procs = [ctx.Process(target=_main, args=(scenario, r, world_size, port, args, out, env)) for r in range(world_size)]
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
            results[r] = {"exit": "timeout"}
            continue
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[r] = json.load(f)
        else:
            results[r] = {"exit": p.exitcode}
    del store  # served until every rank is done
    return results


def rank_context() -> Any:
    """Where ranks come from: forked from a server process that imported torch once (a fresh
    interpreter per rank, as ``spawn`` gave, paid a torch import of ~1.6 s of CPU per rank and
    launch, seconds of every multi-process test on 2 cores). The server imports nothing else
    and starts no thread, so each rank still begins with no process group, no state of the test
    process and no threads; ``use_env`` gives it the launching process's environment as it is
    at launch (a forked server keeps its own from when it started)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def use_env(env: dict[str, str]) -> None:
    """Make this rank's environment the launching process's at launch, as a spawned rank's was."""
    os.environ.clear()
    os.environ.update(env)


def _main(scenario: str, rank: int, world_size: int, port: int, args: dict, out: str, env: dict[str, str]) -> None:
    use_env(env)
    import warnings

    warnings.filterwarnings("ignore")
    os.makedirs(out, exist_ok=True)
    if args.get("store") == "launcher":
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = SCENARIOS[scenario](rank, world_size, args)
    except BaseException as e:  # the test reads the failure from the result file
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json") + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out, f"rank{rank}.json") + ".tmp", os.path.join(out, f"rank{rank}.json"))
    if rank == 0:
        # With tcp:// init the c10d store lives in rank 0's process (torchrun's lives in its
        # agent): keep it up until the other ranks are done, as a real job's rank 0 would be.
        deadline = time.monotonic() + args.get("linger", 60)
        while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(world_size)):
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: a killed peer would make it hang


# --- a small training job, FSDP2 or DDP or plain ---------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 7 and 3 rows: uneven sharding on 2, 3 and 4 ranks, and empty shards on 4.
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.c = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def build(mode: str, world_size: int, seed: int, *, wide: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    if wide:  # a different architecture: layer a has 9 outputs instead of 7
        model.a, model.b = nn.Linear(5, 9), nn.Linear(9, 3)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model.a, model.b, model.c):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world_size: int, mode: str) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g)
    y = torch.randn(GLOBAL_BATCH, 1, generator=g)
    per = GLOBAL_BATCH // world_size
    xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    local = ((model(xs) - ys) ** 2).sum() / GLOBAL_BATCH
    opt.zero_grad(set_to_none=True)
    (local * world_size).backward()  # FSDP2 and DDP average gradients over ranks
    opt.step()
    total = local.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    return float(total)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, whole and on CPU, keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v.clone() for k, v in get_model_state_dict(model, options=o).items()}
    for p, st in get_optimizer_state_dict(model, opt, options=o)["state"].items():
        for k, v in st.items():
            out[f"optimizer/{p}/{k}"] = v.clone()
    return out


def compare(ref_path: str, model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Names of tensors that are not bitwise equal to the reference."""
    ref = torch.load(ref_path, weights_only=True)
    now = full_state(model, opt)
    bad = [k for k in ref if k not in now or now[k].dtype != ref[k].dtype or not torch.equal(now[k], ref[k])]
    return bad + [k for k in now if k not in ref]


# --- scenarios -------------------------------------------------------------------------------


def train_save(rank: int, world_size: int, a: dict) -> dict:
    """Train, save at ``save_step``, write the reference state, keep training."""
    from ckptctl import Checkpointer

    model, opt = build(a["mode"], world_size, seed=0)
    ckpt = Checkpointer(a["root"], timeout_s=60)
    for s in range(1, a["save_step"] + 1):
        train_step(model, opt, s, rank, world_size, a["mode"])
    handle = ckpt.save(a["save_step"], {"model": model, "optimizer": opt, "extra": {"rank": rank, "note": f"r{rank}"}})
    ref = full_state(model, opt)  # the training thread may go on at once: the snapshot is taken
    losses = [train_step(model, opt, s, rank, world_size, a["mode"]) for s in range(a["save_step"] + 1, a["save_step"] + 4)]
    path = handle.wait()
    if rank == 0:
        torch.save(ref, a["ref"])
    ckpt.close()
    return {"path": path, "losses": losses}


def load_check(rank: int, world_size: int, a: dict) -> dict:
    """Load the newest checkpoint into a differently initialised job; compare with the
    reference; optionally train on (losses) and save again under ``resave``."""
    from ckptctl import Checkpointer

    model, opt = build(a["mode"], world_size, seed=123)
    extra: dict = {"rank": -1, "note": ""}
    ckpt = Checkpointer(a["root"], timeout_s=60)
    step = ckpt.load_latest({"model": model, "optimizer": opt, "extra": extra})
    bad = compare(a["ref"], model, opt)
    out: dict = {"step": step, "bad": bad, "extra": extra}
    if a.get("resave") is not None:
        out["path"] = ckpt.save(a["resave"], {"model": model, "optimizer": opt, "extra": extra}).wait()
    if a.get("train_from") is not None:  # the same batches as the run that saved the reference
        first = a["train_from"]
        out["losses"] = [train_step(model, opt, s, rank, world_size, a["mode"]) for s in range(first, first + 3)]
    ckpt.close()
    return out


def kill_mid_write(rank: int, world_size: int, a: dict) -> dict:
    """Commit step 1; in step 2, rank ``victim`` is SIGKILLed while writing its shard (or,
    with ``how="hang"``, stops writing for three timeouts, then exits). ``liveness_s``, if
    given, goes to the Checkpointer."""
    from ckptctl import Checkpointer

    model, opt = build("fsdp", world_size, seed=0)
    liveness = {"liveness_s": a["liveness_s"]} if "liveness_s" in a else {}
    ckpt = Checkpointer(a["root"], timeout_s=a["timeout_s"], **liveness)
    state = {"model": model, "optimizer": opt}
    train_step(model, opt, 1, rank, world_size, "fsdp")
    first = ckpt.save(1, state).wait()
    if rank == a["victim"]:

        class Dying:  # wraps the writer: the first data piece is written, then the rank dies
            def __init__(self, w):
                self.w = w

            def __enter__(self):
                self.w.__enter__()
                return self

            def expect(self, size):
                self.w.expect(size)

            def write(self, b):
                self.w.write(b)
                if len(b) and not isinstance(b, bytes):  # header written as bytes, data as a view
                    if a.get("how") == "hang":  # a stuck write (a hung NFS server, say); still beating
                        time.sleep(3 * a["timeout_s"])
                        os._exit(3)
                    os.kill(os.getpid(), signal.SIGKILL)

            def __exit__(self, *exc):
                return self.w.__exit__(*exc)

        cls = type(ckpt.root)
        orig = cls.open_writer

        def open_writer(self, name, *args, **kw):
            return Dying(orig(self, name, *args, **kw))

        cls.open_writer = open_writer  # this process only: it is about to die
    train_step(model, opt, 2, rank, world_size, "fsdp")
    t0 = time.monotonic()
    handle = ckpt.save(2, state)
    try:
        handle.wait()
        return {"first": first, "second": "committed"}
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        waited = time.monotonic() - t0
        return {"first": first, "error": f"{type(e).__name__}: {e}", "cause": repr(e.__cause__), "waited": waited}


def failing_write(rank: int, world_size: int, a: dict) -> dict:
    """Rank ``victim``'s shard path is a directory, so its write fails for real."""
    from ckptctl import Checkpointer
    from ckptctl.format.layout import shard_name, step_dir

    model, opt = build("fsdp", world_size, seed=0)
    ckpt = Checkpointer(a["root"], timeout_s=60)
    state = {"model": model, "optimizer": opt}
    train_step(model, opt, 1, rank, world_size, "fsdp")
    if rank == a["victim"]:
        os.makedirs(os.path.join(a["root"], step_dir(5), shard_name(rank, world_size)), exist_ok=True)
    out: dict = {}
    try:
        ckpt.save(5, state).wait()
        out["first"] = "committed"
    except Exception as e:  # noqa: BLE001
        out["first"] = f"{type(e).__name__}: {e}"
    # The group is still usable after a failed write: the next save commits on every rank.
    out["second"] = ckpt.save(6, state).wait()
    try:
        ckpt.save(6, state)
        out["again"] = "accepted"
    except Exception as e:  # noqa: BLE001
        out["again"] = f"{type(e).__name__}: {e}"
    ckpt.close()
    return out


def back_to_back(rank: int, world_size: int, a: dict) -> dict:
    """Several saves issued without waiting: each commits whole, none mixes with another."""
    from ckptctl import Checkpointer
    from ckptctl.save.coordination import Coordinator

    rounds = []
    real = Coordinator._plan_round

    def counted(self, *args):
        rounds.append(args[0])
        return real(self, *args)

    Coordinator._plan_round = counted  # this process only
    model, opt = build("fsdp", world_size, seed=0)
    ckpt = Checkpointer(a["root"], timeout_s=60)
    handles = []
    for s in range(1, 5):
        train_step(model, opt, s, rank, world_size, "fsdp")
        handles.append(ckpt.save(s, {"model": model, "optimizer": opt}))
    paths = [h.wait() for h in handles]
    ckpt.close()
    return {"paths": paths, "plan_rounds": rounds}


def _layout_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "tp": torch.arange(60, dtype=torch.float32).reshape(6, 10),
        "hsdp": torch.randn(5, 3, generator=g),  # 5 rows on 2 shards: uneven
        "rep": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def dtensor_layouts(rank: int, world_size: int, a: dict) -> dict:
    """Save DTensors of a 2x2 mesh (2-D sharding, HSDP-style replicate+shard, fully
    replicated) at 4 ranks; load them as 1-D shardings at 3 ranks or as plain tensors at 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptctl import Checkpointer

    full = _layout_tensors()
    ckpt = Checkpointer(a["root"], timeout_s=60)
    if a["phase"] == "save":
        mesh = init_device_mesh("cpu", (2, 2))
        state = {
            "tp": distribute_tensor(full["tp"], mesh, [Shard(0), Shard(1)]),
            "hsdp": distribute_tensor(full["hsdp"], mesh, [Replicate(), Shard(0)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate(), Replicate()]),
        }
        path = ckpt.save(1, state).wait()
        ckpt.close()
        return {"path": path}
    if world_size == 1:
        state = {k: torch.zeros_like(v) for k, v in full.items()}
        ckpt.load_latest(state)
        got = state
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        place = {"tp": [Shard(1)], "hsdp": [Shard(0)], "rep": [Replicate()]}
        state = {k: distribute_tensor(torch.zeros_like(v), mesh, place[k]) for k, v in full.items()}
        ckpt.load_latest(state)
        got = {k: v.full_tensor() for k, v in state.items()}
    ckpt.close()
    return {"equal": {k: bool(torch.equal(got[k], full[k])) for k in full}}


def mismatch(rank: int, world_size: int, a: dict) -> dict:
    """Load into a model whose layer shapes differ: strict names the tensor; strict=False
    loads the rest and reports what it skipped."""
    from ckptctl import Checkpointer
    from ckptctl.errors import StateError
    from ckptctl.load.reader import CheckpointReader
    from ckptctl.load.into_state import load_into
    from ckptctl.storage import open_storage

    model, opt = build("fsdp", world_size, seed=5, wide=True)
    ckpt = Checkpointer(a["root"], timeout_s=60)
    out: dict = {}
    try:
        ckpt.load_latest({"model": model, "optimizer": opt})
        out["strict"] = "loaded"
    except StateError as e:
        out["strict"] = str(e)
    with CheckpointReader(open_storage(a["path"])) as reader:
        report = load_into(reader, {"model": model, "optimizer": opt}, strict=False, rank=rank)
    out["skipped"] = sorted(report.skipped)
    ref = torch.load(a["ref"], weights_only=True)
    now = full_state(model, opt)
    out["c_equal"] = all(torch.equal(now[k], ref[k]) for k in ref if "c." in k)
    ckpt.close()
    return out


def two_saves(rank: int, world_size: int, a: dict) -> dict:
    """Save steps 1 and 2; the reference file holds the state of step 1."""
    from ckptctl import Checkpointer

    model, opt = build("fsdp", world_size, seed=0)
    ckpt = Checkpointer(a["root"], timeout_s=60)
    state = {"model": model, "optimizer": opt, "extra": {"rank": rank, "note": f"r{rank}"}}
    train_step(model, opt, 1, rank, world_size, "fsdp")
    ckpt.save(1, state).wait()
    ref = full_state(model, opt)
    train_step(model, opt, 2, rank, world_size, "fsdp")
    path = ckpt.save(2, state).wait()
    if rank == 0:
        torch.save(ref, a["ref"])
    ckpt.close()
    return {"path": path}


def subgroups(rank: int, world_size: int, a: dict) -> dict:
    """Ranks {0, 1} and {2, 3} checkpoint separately under their own roots (process_group=)."""
    from ckptctl import Checkpointer

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank creates both
    mine = groups[rank // 2]
    root = os.path.join(a["root"], f"group{rank // 2}")
    ckpt = Checkpointer(root, process_group=mine, timeout_s=60)
    w = torch.full((6, 4), float(rank // 2))
    path = ckpt.save(1, {"w": w, "extra": {"rank": rank}}).wait()
    loaded = {"w": torch.zeros(6, 4), "extra": {}}
    ckpt.load_latest(loaded)
    ckpt.close()
    return {"path": path, "rank": ckpt.rank, "world_size": ckpt.world_size, "w_ok": bool(torch.equal(loaded["w"], w)), "extra": loaded["extra"]}


def _loader(rank: int, world_size: int):
    import warnings

    warnings.filterwarnings("ignore")
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.arange(64, dtype=torch.float32)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=3)
    return StatefulDataLoader(data, batch_size=2, sampler=sampler)


def loader_positions(rank: int, world_size: int, a: dict) -> dict:
    """Each rank's data loader is at a different position; a resume puts each back at its own."""
    from ckptctl import Checkpointer

    ckpt = Checkpointer(a["root"], timeout_s=60)
    loader = _loader(rank, world_size)
    if a["phase"] == "save":
        it = iter(loader)
        for _ in range(rank + 1):  # rank r has consumed r + 1 batches
            next(it)
        ckpt.save(1, {"loader": loader, "w": torch.ones(3)}).wait()
        upcoming = next(it).tolist()
    else:
        ckpt.load_latest({"loader": loader, "w": torch.zeros(3)})
        upcoming = next(iter(loader)).tolist()
    ckpt.close()
    return {"next": upcoming}


class _RaisesOnRank:
    """A stateful object whose state_dict() raises on one rank at one step: a real failure
    inside capture, on one rank only, before that rank hands its save to its writer."""

    def __init__(self, rank: int, victim: int) -> None:
        self.rank, self.victim, self.step = rank, victim, 0

    def state_dict(self) -> dict:
        if self.rank == self.victim and self.step == 5:
            raise TypeError("state_dict() of the victim failed")
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def raising_state(rank: int, world_size: int, a: dict) -> dict:
    """Rank ``victim`` fails inside save() itself; the others must learn it at once (not after
    timeout_s), and the next save must commit on every rank."""
    from ckptctl import Checkpointer

    from ckptctl.storage.local import LocalStorage

    class FailsAtStep5(LocalStorage):
        """A storage whose writes under step 5 raise a type no storage is expected to raise."""

        def open_writer(self, key: str):
            if "0000000005" in self.url:
                raise KeyError(f"unexpected failure opening {key}")
            return super().open_writer(key)

    model, opt = build("fsdp", world_size, seed=0)
    fault = a.get("fault", "state_dict")
    storage = FailsAtStep5(a["root"]) if fault == "storage" and rank == a["victim"] else None
    ckpt = Checkpointer(a["root"], timeout_s=a.get("timeout_s", 120), storage=storage)
    thing = _RaisesOnRank(rank, a["victim"] if fault == "state_dict" else -1)
    state = {"model": model, "optimizer": opt, "thing": thing}
    if fault == "meta_tensor" and rank == a["victim"]:
        state["bad"] = torch.empty(3, device="meta")
    train_step(model, opt, 1, rank, world_size, "fsdp")
    thing.step = 5
    out: dict = {}
    t0 = time.monotonic()
    try:
        ckpt.save(5, state).wait()
        out["first"] = "committed"
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        out["first"] = f"{type(e).__name__}: {e}"
    out["waited"] = time.monotonic() - t0
    thing.step = 6
    state.pop("bad", None)
    out["second"] = ckpt.save(6, state).wait()
    ckpt.close()
    return out


def new_group_during_barrier(rank: int, world_size: int, a: dict) -> dict:
    """Rank 0's writer waits in the save barrier while rank 1 is still busy (it starts its save
    late); rank 0's training thread meanwhile creates a process group, which talks to the
    default c10d store. That must not queue behind the barrier's blocking wait."""
    from ckptctl import Checkpointer

    ckpt = Checkpointer(a["root"], timeout_s=120)
    state = {"w": torch.ones(4) * rank}
    out: dict = {}
    if rank == 0:
        handle = ckpt.save(1, state)
        time.sleep(1.0)  # the writer has written and now waits for rank 1 in the barrier
        t0 = time.monotonic()
        dist.new_group([0], use_local_synchronization=True)
        out["new_group_s"] = time.monotonic() - t0
        out["url"] = handle.wait()
    else:
        time.sleep(a["delay"])
        out["url"] = ckpt.save(1, state).wait()
    ckpt.close()
    return out


def save_per_rank(rank: int, world_size: int, a: dict) -> dict:
    """Save step 5 with a per-rank ``extra`` (each rank's own data position)."""
    from ckptctl import Checkpointer

    with Checkpointer(a["root"]) as ckpt:
        url = ckpt.save(5, {"w": torch.arange(4.0), "extra": {"pos": 100 + rank}}).wait()
    return {"url": url}


def load_warnings(rank: int, world_size: int, a: dict) -> dict:
    """Load a checkpoint saved by fewer ranks; report the warnings the ckptctl logger gave."""
    import logging

    from ckptctl import Checkpointer

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("ckptctl").addHandler(Keep(logging.WARNING))
    state = {"w": torch.zeros(4), "extra": {"pos": -1}}
    with Checkpointer(a["root"]) as ckpt:
        step = ckpt.load_latest(state, prepare=False)
    return {"step": step, "extra": state["extra"], "warnings": seen}


def shard0_load_latest(rank: int, world_size: int, a: dict) -> dict:
    """``load_latest`` into ``Shard(0)`` DTensors of a 1-D mesh: each rank reads part of every
    saved chunk (a re-sharding load). Returns the step and this rank's local rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptctl import Checkpointer

    mesh = init_device_mesh("cpu", (world_size,))
    state = {"w": distribute_tensor(torch.zeros(a["rows"], a["cols"]), mesh, [Shard(0)]), "extra": {}}
    with Checkpointer(a["root"], timeout_s=60) as ckpt:
        step = ckpt.load_latest(state, prepare=False)
    return {"step": step, "w": state["w"].full_tensor().tolist(), "extra": state["extra"]}


# --- reads proportional to what a rank loads (issue 14 §1) ------------------------------------

SHARDED = {"w": (37, 6), "v": (8, 3)}  # rows not divisible by 3, 4 or 8: uneven and empty blocks
WHOLE = {"b": (5,), "c": (7, 2)}
OPENED: list[str] = []  # files this process opened through CountingStorage


def _counting_storage(root: str):
    from ckptctl.storage.local import LocalStorage

    class CountingStorage(LocalStorage):
        """The local backend, noting every file opened for reading (headers and data)."""

        def open_reader(self, key: str):
            OPENED.append(self.url_of(key))
            return super().open_reader(key)

    return CountingStorage(root)


def _reads_full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) * 0.5 + len(name)).reshape(shape)


def _reads_state(world_size: int, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state: dict = {}
    for name, shape in SHARDED.items():
        full = _reads_full(name, shape) if fill else torch.zeros(shape)
        state[name] = distribute_tensor(full, mesh, [Shard(0)])
    for name, shape in WHOLE.items():
        state[name] = _reads_full(name, shape) if fill else torch.zeros(shape)
    state["extra"] = {"rank": dist.get_rank()} if fill else {}
    return state


def reads_save(rank: int, world_size: int, a: dict) -> dict:
    """Save ``Shard(0)`` DTensors and whole tensors at ``world_size`` ranks."""
    from ckptctl import Checkpointer

    with Checkpointer(a["root"], timeout_s=300) as ckpt:
        path = ckpt.save(a["step"], _reads_state(world_size, fill=True)).wait()
    return {"path": path}


def reads_load(rank: int, world_size: int, a: dict) -> dict:
    """``load_latest`` through a storage that notes the files opened; returns whether every
    tensor is bitwise equal to what was saved, the files opened and the manifest's hints."""
    from ckptctl import Checkpointer
    from ckptctl.layouts.native_read import read_committed

    state = _reads_state(world_size, fill=False)
    OPENED.clear()
    with Checkpointer(a["root"], storage=_counting_storage(a["root"]), timeout_s=300) as ckpt:
        step = ckpt.load_latest(state, prepare=False)
    opened = sorted({os.path.basename(u) for u in OPENED if u.endswith(".safetensors")})
    bad = [n for n in SHARDED if not torch.equal(state[n].full_tensor(), _reads_full(n, SHARDED[n]))]
    bad += [n for n in WHOLE if not torch.equal(state[n], _reads_full(n, WHOLE[n]))]
    manifest, _ = read_committed(_counting_storage(a["root"]).sub(os.path.basename(a["path"])))
    hints = {n: [t.owner, list(t.split) if t.split else None] for n, t in manifest.tensors.items()}
    files = {f.name: f.rank for f in manifest.files}
    return {"step": step, "bad": bad, "opened": opened, "hints": hints, "files": files, "extra": state["extra"]}


def replicas_differ(rank: int, world_size: int, a: dict) -> dict:
    """DDP with ``broadcast_buffers=False`` and BatchNorm fed a different batch on each rank:
    the running statistics differ per rank. Save with ``check_replicas=a["check"]``."""
    from ckptctl import Checkpointer
    from ckptctl.errors import CkptError

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + rank))
    model(x).sum().backward()
    opt.step()
    try:
        with Checkpointer(a["root"], timeout_s=300, check_replicas=a.get("check")) as ckpt:
            return {"path": ckpt.save(1, {"model": model, "optimizer": opt}).wait()}
    except CkptError as e:
        return {"failed": str(e)}


def retention_ranks(rank: int, world_size: int, a: dict) -> dict:
    """Library retention across ranks: every rank re-reads its own shard after each commit,
    rank 0 records the verification and prunes. ``a["only_rank0"]``: retention asked for on
    rank 0 alone (refused). Returns the files of other ranks' shards this rank opened."""
    from ckptctl import Checkpointer
    from ckptctl.errors import CkptError

    state = _reads_state(world_size, fill=True)
    keep = 1 if rank == 0 or not a.get("only_rank0") else None
    OPENED.clear()
    try:
        with Checkpointer(a["root"], storage=_counting_storage(a["root"]), timeout_s=300, keep_last=keep) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, state).wait()
    except CkptError as e:
        return {"failed": f"{type(e).__name__}: {e}"}
    mine = f"rank-{rank:05d}-of-{world_size:05d}.safetensors"
    return {"others": sorted({u for u in OPENED if u.endswith(".safetensors") and not u.endswith(mine)})}


SCENARIOS: dict[str, Callable[[int, int, dict], dict]] = {
    "train_save": train_save,
    "load_check": load_check,
    "kill_mid_write": kill_mid_write,
    "failing_write": failing_write,
    "back_to_back": back_to_back,
    "dtensor_layouts": dtensor_layouts,
    "mismatch": mismatch,
    "two_saves": two_saves,
    "subgroups": subgroups,
    "loader_positions": loader_positions,
    "raising_state": raising_state,
    "new_group_during_barrier": new_group_during_barrier,
    "load_warnings": load_warnings,
    "save_per_rank": save_per_rank,
    "shard0_load_latest": shard0_load_latest,
    "reads_save": reads_save,
    "reads_load": reads_load,
    "replicas_differ": replicas_differ,
    "retention_ranks": retention_ranks,
}
