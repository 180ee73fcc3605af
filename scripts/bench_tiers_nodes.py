"""The multi-node part of ``bench_tiers.py`` (issue 23): 2 torchrun "nodes" x 2 ranks on one
host, each node with its own node-local first tier, plus an S3 tier.

``run_nodes`` (called by ``bench_tiers.py``) launches two jobs, each as two torchrun launchers
(``--nnodes 2 --node-rank 0/1 --nproc-per-node 2``, static rendezvous on 127.0.0.1, a free
port), every rank running this file as a worker:

  save      ``Checkpointer(tiers=[Tier(node_root, node_local=True), Tier(s3)])`` saves a state
            of ``--size-mib`` in all (``Shard(0)`` DTensors of a 1-D mesh over the 4 ranks, as
            FSDP holds them: each rank writes only its own quarter, so a node's disk holds what
            its ranks need to resume), one round not counted then ``--repeat`` rounds, each
            save waited for until promoted to S3; then closes. With peer replicas available
            (``Tier(..., replicas=1)``), a second Checkpointer does the same beside it, on roots
            of its own, saves alternating, each also waited for until replicated: the stall,
            durable and promoted figures of both, time to replicated and bytes sent to peers
            (``Checkpointer.time_to_replicated``).
  recover   a relaunch (fresh processes) times ``load_latest`` into a zeroed state through a
            fresh Checkpointer, in rotating order each round (one uncounted first load):
            all-local (both node roots intact, evicted from the page cache), one node from
            S3 (node 1's root moved away: an empty disk), all from S3 (both moved away), and,
            with replicas, one node from peer (node 1's root of the replicas=1 run moved away).
            A recovery's time is the slowest rank's ``load_latest``. Every load is checked:
            the step is the last one saved and every rank's tensors are bitwise equal to
            what it saved, else the job fails.

Before each timed section rank 0 waits until the 4 ranks and moto's server are idle
(``benchutil.wait_quiet``). Each rank writes ``OUT/pidR`` at start and ``OUT/marksR.json``
(where its time went) at the end; rank 0 writes ``OUT/result.json`` (every rank's figures,
gathered; the launcher adds the nodes' logged lines, ckptctl's warnings); a rank that fails
writes ``OUT/errorR.json`` (its traceback).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

T_START = time.time()  # this process's start (a rank's: before torch is imported)
HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


# --- in the launching process (bench_tiers.py) ------------------------------------------------


def replicas_supported() -> str | None:
    """None when ``Tier`` has a ``replicas`` field taking 1 with ``node_local=True``; else why not."""
    from ckptctl import Tier

    if "replicas" not in {f.name for f in dataclasses.fields(Tier)}:
        return "Tier has no 'replicas' field"
    try:
        Tier("/tmp/ckptctl-bench-probe", node_local=True, replicas=1)  # type: ignore[call-arg]
    except Exception as e:  # noqa: BLE001 - any refusal means: not available
        return f"Tier(node_local=True, replicas=1) refused: {type(e).__name__}: {e}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeJobError(RuntimeError):
    pass


class Job:
    """Two torchrun launchers, one per node, each in a process group (session) of its own."""

    def __init__(self, mode: str, args: dict, out: str) -> None:
        os.makedirs(out, exist_ok=True)
        self.out = out
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        try:
            for node in range(NODES):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node),
                       "--nproc-per-node", str(PER_NODE), "--master-addr", "127.0.0.1", "--master-port", str(port),
                       "--rdzv-backend", "static", "--max-restarts", "0", "--monitor-interval", "0.2",
                       os.path.abspath(__file__), mode, json.dumps(args), out]
                with open(os.path.join(out, f"node{node}.log"), "w") as log:
                    self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                       start_new_session=True, env=env))
        except BaseException:
            self.kill()  # the launcher already started, if any
            raise

    def errors(self) -> dict[int, dict]:
        found = {}
        for r in range(WORLD):
            path = os.path.join(self.out, f"error{r}.json")
            if os.path.exists(path):
                try:
                    found[r] = json.load(open(path))
                except ValueError:
                    pass
        return found

    def wait(self, timeout: float) -> dict:
        """rank 0's result; raises ``NodeJobError`` (after killing the job) on a rank's error,
        a launcher's failure or the timeout."""
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in self.procs):
                errs = self.errors()
                if errs:
                    time.sleep(2)  # the other ranks' errors, if any, land too
                    raise NodeJobError(self._describe("a rank failed", self.errors()))
                if time.monotonic() > deadline:
                    raise NodeJobError(self._describe(f"no end within {timeout:.0f} s", self.errors()))
                time.sleep(0.1)
            errs = self.errors()
            path = os.path.join(self.out, "result.json")
            if errs or any(p.returncode != 0 for p in self.procs) or not os.path.exists(path):
                raise NodeJobError(self._describe(
                    f"launchers exited {[p.returncode for p in self.procs]}", errs))
            return {**json.load(open(path)), "log_lines": self.log_lines()}
        finally:
            self.kill()

    def _describe(self, what: str, errs: dict[int, dict]) -> str:
        parts = [f"2x2 {os.path.basename(self.out)} job: {what}"]
        for r, e in sorted(errs.items()):
            parts.append(f"--- rank {r}: {e.get('error')}\n{e.get('traceback', '')}")
        if not errs:
            parts.append(self.logs())
        return "\n".join(parts)

    def kill(self) -> None:
        """SIGKILL every rank (torchrun starts each in a session of its own) and both launchers."""
        for r in range(WORLD):
            path = os.path.join(self.out, f"pid{r}")
            try:
                os.kill(int(open(path).read()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()

    def log_lines(self) -> list[str]:
        """What the ranks logged (ckptctl's warnings and errors, the launchers' complaints), without
        the per-state-key notice every save prints."""
        lines = []
        for n in range(len(self.procs)):
            try:
                text = open(os.path.join(self.out, f"node{n}.log")).read()
            except OSError:
                continue
            lines += [f"node{n}: {ln}" for ln in text.splitlines() if ln.strip() and "too much to keep per rank" not in ln]
        return lines[:200]

    def logs(self) -> str:
        out = []
        for n in range(len(self.procs)):
            try:
                out.append(f"--- node {n} log (tail)\n" + open(os.path.join(self.out, f"node{n}.log")).read()[-4000:])
            except OSError:
                pass
        return "\n".join(out)


def run_nodes(work: str, s3_root: str, size_mib: int, tensors: int, repeat: int, peer: bool,
              timeout_s: float, progress=print, quiet_pids: list[int] | tuple[int, ...] = ()) -> dict:
    """Both jobs; returns ``{"save": rank 0's save result, "recover": its recovery result}``.
    ``peer``: also run the replicas=1 Checkpointer (when that part fails, the caller may run
    again without it). ``quiet_pids``: other processes (moto's server) that must be idle, with
    the ranks, before each timed section."""
    base = os.path.join(work, "nodes")
    cfgs = {"plain": {"roots": [os.path.join(base, "plain", f"node{n}") for n in range(NODES)],
                      "s3": f"{s3_root}/nodes-plain", "replicas": None}}
    if peer:
        cfgs["peer"] = {"roots": [os.path.join(base, "peer", f"node{n}") for n in range(NODES)],
                        "s3": f"{s3_root}/nodes-peer", "replicas": 1}
    args = {"cfgs": cfgs, "size_mib": size_mib, "tensors": tensors, "repeat": repeat,
            "promote_timeout_s": timeout_s, "quiet_pids": list(quiet_pids)}
    tag = "-peer" if peer else ""
    progress(f"2x2 nodes: save job ({', '.join(cfgs)})")
    saved = Job("save", {**args, "t_launch": time.time()}, os.path.join(base, f"save{tag}-out")).wait(timeout_s)
    progress("2x2 nodes: recovery job (relaunch)")
    recovered = Job("recover", {**args, "last": saved["last"], "t_launch": time.time()},
                    os.path.join(base, f"recover{tag}-out")).wait(timeout_s)
    return {"save": saved, "recover": recovered}


# --- in each rank (under torchrun) ------------------------------------------------------------


_MESH = None


def _state(size_mib: int, tensors: int, rank: int, step: int, zero: bool) -> tuple[dict, list]:
    """This rank's part of the state: ``Shard(0)`` DTensors (bench_save's shapes, rows rounded
    up to a multiple of the world size), each rank's quarter drawn from a generator of its
    own; plus a small sharded tensor holding the step. Returns (state, local tensors)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from bench_save import build_specs

    global _MESH
    if _MESH is None:
        _MESH = init_device_mesh("cpu", (WORLD,))
    mesh = _MESH
    model: dict[str, Any] = {}
    local: list = []
    for i, (name, shape, dtype) in enumerate(build_specs(size_mib * MiB, tensors)):
        rows = math.ceil(shape[0] / WORLD)
        lshape = (rows, *shape[1:])
        t = torch.zeros(lshape, dtype=dtype)
        if not zero:
            g = torch.Generator().manual_seed(1000 * i + rank)
            t = torch.empty(lshape, dtype=torch.float32).normal_(generator=g).to(dtype)
        gshape = torch.Size((rows * WORLD, *shape[1:]))
        model[name] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=gshape,
                                         stride=torch.empty(gshape, device="meta").stride())
        local.append(t)
    marker = torch.full((4,), 0 if zero else step, dtype=torch.int64)
    model["progress.step"] = DTensor.from_local(marker, mesh, [Shard(0)], run_check=False,
                                                shape=torch.Size((4 * WORLD,)), stride=(1,))
    local.append(marker)
    # Top-level tensors (role "tensor"): each rank saves and restores its own shard of a DTensor.
    # (A dict of tensors would be a "value": saved once, from rank 0, read by every rank.)
    return model, local


def _locals(state: dict) -> list:
    """The local tensors of ``state``'s DTensors, in ``_state``'s order (after a load)."""
    return [t.to_local() for t in state.values()]


def _tiers(cfg: dict, node: int) -> list:
    from ckptctl import Tier

    extra = {"replicas": cfg["replicas"]} if cfg.get("replicas") is not None else {}
    return [Tier(cfg["roots"][node], node_local=True, **extra), Tier(cfg["s3"])]


MARKS: list[tuple[str, float]] = []  # (what, seconds since this process started): where a job's time goes


def _mark(what: str) -> None:
    MARKS.append((what, round(time.time() - T_START, 3)))


def _gather(obj: Any) -> list:
    import torch.distributed as dist

    got: list = [None] * WORLD
    dist.all_gather_object(got, obj)
    return got


QUIET = {"waited_s": 0.0}


def _quiet(rank: int, pids: list[int]) -> None:
    """Before a timed section, on every rank: rank 0 waits until the 4 ranks and ``pids``
    (moto's server) are idle (``benchutil.wait_quiet``): what the last section left running (a
    promotion's or replica's thread, a close, the server) is charged to nobody."""
    import torch.distributed as dist

    from benchutil import wait_quiet

    if rank == 0:
        QUIET["waited_s"] += wait_quiet(pids, timeout_s=30.0)
    dist.barrier()


def _save_stats(root: str, step: int) -> dict:
    """What the manifest of ``step`` on ``root`` records under ``stats`` (numbers only)."""
    from ckptctl.format.layout import step_dir

    try:
        doc = json.load(open(os.path.join(root, step_dir(step), "manifest.json")))
        return {k: v for k, v in (doc.get("stats") or {}).items() if isinstance(v, (int, float))}
    except (OSError, ValueError):
        return {}


def save_job(rank: int, a: dict) -> dict:
    import torch.distributed as dist

    from ckptctl import Checkpointer
    from ckptctl.storage import open_storage

    node = int(os.environ["GROUP_RANK"])
    _mark("imported")
    cks = {k: Checkpointer(tiers=_tiers(c, node), promote_timeout_s=a["promote_timeout_s"]) for k, c in a["cfgs"].items()}
    _mark("checkpointers built")
    pids = list(_gather(os.getpid())) + a.get("quiet_pids", [])
    s3_key = {k: open_storage(c["s3"]).url for k, c in a["cfgs"].items()}
    samples: dict[str, list] = {}
    stats: dict[str, list] = {}
    step = 0
    state, _ = _state(a["size_mib"], a["tensors"], rank, step, zero=False)
    _mark("state built")
    for r in range(1 + a["repeat"]):
        step += 1
        _locals(state)[-1].fill_(step)  # the marker: a load of an older step fails the tensor check
        order = list(cks) if r % 2 == 0 else list(cks)[::-1]
        for kind in order:
            ck = cks[kind]
            _quiet(rank, pids)
            t0 = time.perf_counter()
            h = ck.save(step, state)
            t1 = time.perf_counter()
            if h.wait() is None:
                raise RuntimeError(f"{kind}: save of step {step} returned no URL")
            t2 = time.perf_counter()
            promoted, replicated = None, {}
            if rank == 0:  # the promoter records the time itself: polling costs no accuracy
                deadline = time.monotonic() + a["promote_timeout_s"]
                while s3_key[kind] not in (got := ck.time_to_durable(step)):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{kind}: step {step} not promoted within {a['promote_timeout_s']} s")
                    time.sleep(0.005)
                promoted = got[s3_key[kind]]
                # With replicas, the next save waits for this one's replica too (recorded by rank 0
                # when every rank's partner has its shard): nothing left running is charged to it.
                if a["cfgs"][kind].get("replicas") and hasattr(ck, "time_to_replicated"):
                    while not (replicated := ck.time_to_replicated(step)):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{kind}: step {step} not replicated within {a['promote_timeout_s']} s")
                        time.sleep(0.005)
            each = _gather({"stall": t1 - t0, "durable": t2 - t0})
            _mark(f"{kind} step {step} saved")
            if r > 0:
                samples.setdefault(f"{kind}_stall_s", []).append(max(e["stall"] for e in each))
                samples.setdefault(f"{kind}_durable_s", []).append(max(e["durable"] for e in each))
                if promoted is not None:
                    samples.setdefault(f"{kind}_promoted_s", []).append(promoted)
                for k, v in replicated.items():  # replicated_s, replica_bytes
                    samples.setdefault(f"{kind}_{k}", []).append(v)
                if rank == 0:
                    stats.setdefault(kind, []).append(_save_stats(a["cfgs"][kind]["roots"][0], step))
    flushed = {}
    for kind, ck in cks.items():
        f = ck.close(promote_timeout_s=a["promote_timeout_s"])
        _mark(f"{kind} closed")
        if rank == 0:
            flushed[kind] = {"complete": bool(f), "step": getattr(f, "step", None)}
    dist.barrier()
    _mark("end")
    return {"samples": samples, "last": step, "flushed": flushed, "manifest_stats": stats, "quiet_waited_s": QUIET["waited_s"],
            "durable_of_last": {k: ck.time_to_durable(step) for k, ck in cks.items()} if rank == 0 else {}}


def _drop_cache(root: str) -> None:
    from benchutil import drop_cache

    if os.path.isdir(root):
        drop_cache(root)


def recover_job(rank: int, a: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ckptctl import Checkpointer

    node, leader = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]) == 0
    last = a["last"]
    _mark("imported")
    _, want = _state(a["size_mib"], a["tensors"], rank, last, zero=False)
    target, _ = _state(a["size_mib"], a["tensors"], rank, last, zero=True)
    pids = list(_gather(os.getpid())) + a.get("quiet_pids", [])
    # (kind, config, nodes whose root is moved away: an empty disk)
    kinds = [("all_local", "plain", []), ("one_node_s3", "plain", [1]), ("all_s3", "plain", [0, 1])]
    if "peer" in a["cfgs"]:
        kinds.append(("one_node_peer", "peer", [1]))
    samples: dict[str, list] = {}
    checks: dict[str, bool] = {}
    wrote: dict[str, dict[str, list[str]]] = {}
    rounds = [[kinds[1]]] + [kinds[r % len(kinds):] + kinds[: r % len(kinds)] for r in range(a["repeat"])]
    for r, todo in enumerate(rounds):
        for kind, cfg_name, gone in todo:
            cfg = a["cfgs"][cfg_name]
            root = cfg["roots"][node]
            aside = root + ".aside"
            dist.barrier()
            if leader:
                if node in gone:
                    os.rename(root, aside)  # a replaced node: its disk is empty
                else:
                    _drop_cache(root)  # cold: a relaunch after a crash does not find it cached
            for t in _locals(target):
                t.zero_()
            dist.barrier()
            _mark(f"{kind} set up")
            ck = Checkpointer(tiers=_tiers(cfg, node), promote_timeout_s=a["promote_timeout_s"])
            _mark(f"{kind} checkpointer built")
            _quiet(rank, pids)
            t0 = time.perf_counter()
            step = ck.load_latest(target, prepare=False)
            seconds = time.perf_counter() - t0
            _mark(f"{kind} loaded")
            ck.close(promote_timeout_s=5)
            _mark(f"{kind} closed")
            got = _locals(target)
            ok = step == last and len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
            left: list[str] = []
            dist.barrier()
            if leader and node in gone:
                if os.path.isdir(root):  # what the recovery wrote to the replaced node's empty disk
                    left = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
                shutil.rmtree(root, ignore_errors=True)
                os.rename(aside, root)
            each = _gather({"s": seconds, "ok": ok, "step": step, "left": left, "node": node})
            if r > 0:
                samples.setdefault(f"recovery_{kind}_s", []).append(max(e["s"] for e in each))
                samples.setdefault(f"recovery_{kind}_ranks_s", []).append([e["s"] for e in each])
            checks[f"recovery_{kind}_correct"] = checks.get(f"recovery_{kind}_correct", True) and all(e["ok"] for e in each)
            for e in each:
                if e["left"]:
                    wrote.setdefault(kind, {})[f"node{e['node']}"] = e["left"]
            bad = [(k, e["step"]) for k, e in enumerate(each) if not e["ok"]]
            if bad:  # fail loudly: a fast wrong answer is no answer
                raise RuntimeError(f"recovery {kind}: step {last} expected; ranks with a wrong step or tensors "
                                   f"(rank, step): {bad}")
    return {"samples": samples, "checks": checks, "wrote_to_empty_root": wrote, "quiet_waited_s": QUIET["waited_s"]}


def _main() -> None:
    mode, args, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    t_init = time.time()
    try:
        result = {"save": save_job, "recover": recover_job}[mode](rank, args)
        result["phases_s"] = {"launch_to_init": t_init - args["t_launch"], "job": time.time() - t_init,
                              "start_to_init": t_init - T_START, "marks": MARKS}
        name = "result.json" if rank == 0 else None
    except BaseException as e:  # the bench reads the failure from the file
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        name = f"error{rank}.json"
    with open(os.path.join(out, f"marks{rank}.json"), "w") as f:
        json.dump(MARKS, f)
    if name:
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            json.dump(result, f)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip process-group teardown; torchrun's exit barrier keeps the store up for the others


if __name__ == "__main__":
    _main()
