"""Worker processes for tests/test_tiers_nodes.py: two torchrun "nodes" x two ranks on one host,
each node with its own node-local first tier, plus an S3 tier (moto over HTTP).

``launch_nodes`` starts one ``torchrun --nnodes 2 --node-rank N --nproc-per-node 2`` per node
(static rendezvous on 127.0.0.1: node 0's agent hosts the c10d store), each running
``python tier_node_workers.py SCENARIO ARGS_JSON OUT`` with that node's local root in its
arguments; torchrun sets RANK, LOCAL_RANK, GROUP_RANK (the node) and the rest. Each rank writes
its pid to ``OUT/pidR`` at start and what its scenario returns as JSON to ``OUT/rankR.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tier_workers import state_for  # noqa: E402  (the same states as the single-node tests)


def _tiers(a: dict) -> list:
    """Node-local first tier keeping 1, S3 keeping 2 and receiving a checkpoint every 20 steps
    (``lag_warning_s``: after how long behind S3 warns, default an hour)."""
    from ckptctl import KeepLast, Steps, Tier

    return [Tier(a["local"], retention=KeepLast(1), node_local=True),
            Tier(a["remote"], retention=KeepLast(2), every=Steps(20), retry_max_s=1.0,
                 lag_warning_s=a.get("lag_warning_s", 3600.0))]


def _checkpointer(a: dict) -> Any:
    from ckptctl import Checkpointer

    return Checkpointer(tiers=_tiers(a), promote_timeout_s=a.get("promote_timeout_s", 60),
                        timeout_s=a.get("timeout_s", 900.0), liveness_s=a.get("liveness_s", 60.0))


def _close_report(ck: Any) -> dict:
    flushed = ck.close()
    return {"flushed": None if flushed is None else {"complete": flushed.complete, "step": flushed.step,
                                                      "tiers": list(flushed.tiers), "reason": flushed.reason}}


def save(rank: int, a: dict) -> dict:
    """Save ``steps`` (before each step in ``gates``, wait for the file ``OUT/goSTEP``), timing
    each save; close (rank 0 waits for the last one to reach S3)."""
    ck = _checkpointer(a)
    if rank == 0 and "lose_once" in a:
        _lose_a_shard_once(a["remote"], a["lose_once"], a["out"])
    seconds = []
    for step in a["steps"]:
        while step in a.get("gates", []) and not os.path.exists(os.path.join(a["out"], f"go{step}")):
            time.sleep(0.05)
        t0 = time.monotonic()
        ck.save(step, state_for(step, rank)).wait()
        seconds.append(time.monotonic() - t0)
    return {"node": os.environ["GROUP_RANK"], "local_rank": os.environ["LOCAL_RANK"], "save_s": seconds,
            **_close_report(ck)}


def _lose_a_shard_once(remote: str, step: int, out: str) -> None:
    """In rank 0's process (the promotion's leader): the first time a listing of ``step``'s
    directory at ``remote`` finds shards there, delete one of them just before that listing
    goes out (a write the next tier lost after its rank reported it), and record it in
    ``OUT/lost``; record every marker write of the step in ``OUT/markers``."""
    import boto3

    from ckptctl.format.layout import MARKER, step_dir
    from ckptctl.storage import open_storage

    client = open_storage(remote)._client.s3  # the process's shared client: the leader's too
    bucket = remote[len("s3://"):].split("/", 1)[0]
    where = step_dir(step) + "/"

    def listing(params: dict, **_kw: object) -> None:
        if not params.get("Prefix", "").endswith(where) or "Delimiter" in params or os.path.exists(os.path.join(out, "lost")):
            return
        raw = boto3.client("s3")
        shards = [o["Key"] for o in raw.list_objects_v2(Bucket=bucket, Prefix=params["Prefix"]).get("Contents", [])
                  if o["Key"].endswith(".safetensors")]
        if shards:
            raw.delete_object(Bucket=bucket, Key=shards[-1])
            _write(out, "lost", {"key": shards[-1]})

    def marker(params: dict, **_kw: object) -> None:
        if params.get("Key", "").endswith(where + MARKER):
            with open(os.path.join(out, "markers"), "a") as f:
                f.write(f"{os.path.exists(os.path.join(out, 'lost'))}\n")

    client.meta.events.register("provide-client-params.s3.ListObjectsV2", listing)
    client.meta.events.register("provide-client-params.s3.PutObject", marker)


def _loaded(ck: Any, rank: int, a: dict | None = None) -> dict:
    """``load_latest`` into a zeroed state (``_replica_state``'s with ``a``); its step, and
    whether the state is bitwise what that step saved."""
    import torch

    state = _replica_state(0, rank, a or {})
    for t in _tensors(state):
        t.data.zero_()
    state["extra"] = {}
    step = ck.load_latest(state, prepare=False)
    want = _replica_state(step, rank, a or {}) if step is not None else None
    equal = want is not None and all(torch.equal(x, y) for x, y in zip(_tensors(state), _tensors(want))) \
        and state["extra"] == want["extra"]
    return {"step": step, "bitwise_equal": equal}


def load(rank: int, a: dict) -> dict:
    """``load_latest`` into a zeroed state; compare bitwise with what that step saved; then
    save ``then_save`` steps, if any, and close."""
    ck = _checkpointer(a)
    loaded = _loaded(ck, rank)
    _write(a["out"], f"loaded{rank}.json", loaded)  # read by a test that kills this job before it ends
    for s in a.get("then_save", []):
        ck.save(s, state_for(s, rank)).wait()
    while a.get("hold") and not os.path.exists(os.path.join(a["out"], "release")):
        time.sleep(0.1)  # training goes on: no close (which would force the newest to S3) until told
    return {**loaded, **_close_report(ck)}


def _write(out: str, name: str, doc: dict) -> None:
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        json.dump(doc, f)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


# --- peer replicas (tests/test_tiers_replicas.py) ----------------------------------------------


def _replica_tiers(a: dict) -> list:
    """Node-local first tier with ``replicas`` (default 1), keeping ``keep_local`` (default 2);
    S3 (or any root) keeping ``keep_remote`` (default 2), receiving the first checkpoint and then
    every ``every`` steps (default 1000), unless ``remote`` is None."""
    from ckptctl import KeepLast, Steps, Tier

    local = Tier(a["local"], retention=KeepLast(a.get("keep_local", 2)), node_local=True, replicas=a.get("replicas", 1))
    if a["remote"] is None:
        return [local]
    return [local, Tier(a["remote"], retention=KeepLast(a.get("keep_remote", 2)), every=Steps(a.get("every", 1000)),
                        retry_max_s=1.0)]


def _replica_state(step: int, rank: int, a: dict) -> dict:
    """``state_for`` plus, with ``own_mb``, a module of four parameters of that many MiB each,
    the same on every rank (as under DDP): the saver gives each whole tensor one writer, the
    least loaded rank, so each of the four ranks writes a shard of about ``own_mb`` MiB."""
    import torch

    state = state_for(step, rank)
    if a.get("own_mb"):
        g = torch.Generator().manual_seed(step + 1000)
        net = torch.nn.Module()
        for k in range(4):
            data = torch.randn(int(a["own_mb"] * (1 << 18)), generator=g)
            net.register_parameter(f"p{k}", torch.nn.Parameter(data, requires_grad=False))
        state["net"] = net
    return state


def _replica_checkpointer(a: dict) -> Any:
    from ckptctl import Checkpointer

    return Checkpointer(tiers=_replica_tiers(a), promote_timeout_s=a.get("promote_timeout_s", 60),
                        timeout_s=a.get("timeout_s", 900.0), liveness_s=a.get("liveness_s", 60.0))


def replica_save(rank: int, a: dict) -> dict:
    """Save ``steps``, timing each ``save()`` call (the stall) and recording each outcome;
    rank ``die_rank`` SIGKILLs itself once its save of ``die_step`` committed. Rank 0 reports
    each step's time to replicated and replica bytes, and its time to durable. ``pause_s``:
    seconds of "training" after each save; ``promote_each``: rank 0 waits, after each save, until
    the later tier holds it (the next save, collective, waits with it), so that every step is
    promoted rather than skipped for a newer one."""
    ck = _replica_checkpointer(a)
    saves = []
    for step in a["steps"]:
        t0 = time.monotonic()
        try:
            handle = ck.save(step, _replica_state(step, rank, a))
            stall = time.monotonic() - t0
            handle.wait()
            saves.append({"step": step, "stall_s": stall, "done_s": time.monotonic() - t0})
        except Exception as e:  # the test reads which saves failed, and how fast
            saves.append({"step": step, "error": f"{type(e).__name__}: {e}", "done_s": time.monotonic() - t0})
        while rank == 0 and a.get("promote_each") and len(ck.time_to_durable(step)) < 2 \
                and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        if rank == a.get("die_rank") and step == a.get("die_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(a.get("pause_s", 0))  # training between saves (the bench)
    t0 = time.monotonic()
    try:
        report = _close_report(ck)
    except Exception as e:  # a failed save nobody saw is raised by close
        report = {"close_error": f"{type(e).__name__}: {e}"}
    report["close_s"] = time.monotonic() - t0
    return {"saves": saves, "node": os.environ["GROUP_RANK"], **report,
            "replication": {str(s): ck.time_to_replicated(s) for s in a["steps"]},
            "durable": {str(s): ck.time_to_durable(s) for s in a["steps"]}}


def replica_load(rank: int, a: dict) -> dict:
    """``load_latest`` into a zeroed state, compared bitwise with what that step saved; then
    save ``then_save`` steps, if any; close."""
    ck = _replica_checkpointer(a)
    loaded = _loaded(ck, rank, a)
    for s in a.get("then_save", []):
        ck.save(s, _replica_state(s, rank, a)).wait()
    return {**loaded, **_close_report(ck)}


# --- close at the end of a job (tests/test_tiers_close.py) --------------------------------------


def save_then_close(rank: int, a: dict) -> dict:
    """Save ``steps`` (S3 takes the first, and no later one by its cadence: the last is
    promoted by close alone; with ``replicas``, peer replicas too), write ``OUT/savedR``, wait for ``OUT/close`` (the harness may first kill node 0's
    agent, the c10d store's host), then close; report how long close took, what it returned
    and the warnings it logged."""
    import logging

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ckptctl").addHandler(Keep(logging.WARNING))
    ck = _replica_checkpointer(a) if a.get("replicas") else _checkpointer(a)
    for step in a["steps"]:
        ck.save(step, state_for(step, rank)).wait()
    _write(a["out"], f"saved{rank}.json", {"store_connections": store_connections()})
    while not os.path.exists(os.path.join(a["out"], "close")):
        time.sleep(0.05)
    t0 = time.monotonic()
    try:
        report = _close_report(ck)
    except Exception as e:  # the test reads it
        report = {"close_error": f"{type(e).__name__}: {e}"}
    return {**report, "close_s": time.monotonic() - t0, "warnings": warnings}


def store_connections() -> int:
    """This process's open TCP connections to the job's c10d store (``MASTER_PORT``): its
    sockets (``/proc/self/fd``) that ``/proc/self/net/tcp*`` lists as established to that port."""
    port = int(os.environ["MASTER_PORT"])
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                remote, state, inode = cols[2], cols[3], cols[9]
                if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port and inode in mine:
                    found += 1
    return found


# --- the soak (scripts/soak_tiers.py) -----------------------------------------------------------


def soak(rank: int, a: dict) -> dict:
    """A training job under faults: ``load_latest`` (its step and whether it is bitwise what
    that step saved go to ``OUT/loadedR.json``), then a save after each ``pause_s`` of
    "training" until the step in ``OUT/stop_at`` (the harness writes it; every rank stops at
    the same step), each save's outcome and the tiers' health in ``OUT/progressR.json``. A save
    that fails because a rank is gone ends the job (the harness relaunches it); one that fails
    otherwise (a full disk) is counted and the job goes on."""
    import torch

    from ckptctl.errors import CkptError, CoordinationError

    ck = _replica_checkpointer(a)
    state = _replica_state(0, rank, a)
    for t in [*state["model"].values(), *state.get("net", torch.nn.Module()).parameters()]:
        t.data.zero_()
    state["extra"] = {}
    step = ck.load_latest(state, prepare=False)
    want = _replica_state(step, rank, a) if step is not None else None
    equal = want is not None and state["extra"] == want["extra"] and all(
        torch.equal(x, y) for x, y in zip(_tensors(state), _tensors(want)))
    _write(a["out"], f"loaded{rank}.json", {"step": step, "bitwise_equal": equal})
    ok, failed, ended = 0, [], None
    s = step or 0
    while True:
        stop = os.path.join(a["out"], "stop_at")
        if os.path.exists(stop) and s >= int(open(stop).read() or 0):
            break
        s += 1
        try:
            ck.save(s, _replica_state(s, rank, a)).wait()
            ok += 1
        except CkptError as e:
            cause = e.__cause__ if isinstance(e.__cause__, CkptError) else e
            if isinstance(cause, CoordinationError) and "restart the job" in (cause.hint or ""):
                ended = f"{type(e).__name__}: {e}"  # a rank is gone: the job must be restarted
            else:
                failed.append([s, f"{type(e).__name__}: {e}"[:300]])
        _write(a["out"], f"progress{rank}.json", {"step": s, "ok": ok, "failed": failed[-5:], "failures": len(failed),
                                                  "troubles": [[str(t), t.dead, t.for_s] for t in ck.health()]})
        if ended:
            return {"ended": ended, "ok": ok, "failures": len(failed)}
        time.sleep(a.get("pause_s", 0.2))
    flushed = ck.close()
    return {"ok": ok, "failures": len(failed), "last": s,
            "flushed": None if flushed is None else {"complete": flushed.complete, "step": flushed.step,
                                                      "troubles": [str(t) for t in flushed.troubles]}}


def _tensors(state: dict) -> list:
    out = list(state["model"].values())
    if "net" in state:
        out += list(state["net"].parameters())
    return out


SCENARIOS = {"save": save, "load": load, "replica_save": replica_save, "replica_load": replica_load, "soak": soak,
             "save_then_close": save_then_close}


# Each agent runs torchrun's own entry point under faulthandler (SIGUSR1 writes its threads'
# stacks to the file named first), so that a job killed for time also shows whether an agent
# was still in its rendezvous (no rank started) or waiting for its ranks.
_AGENT = ("import faulthandler, runpy, signal, sys; "
          "faulthandler.register(signal.SIGUSR1, file=open(sys.argv.pop(1), 'w'), all_threads=True); "
          "runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One torchrun launch per node (two in most tests), each in a process group of its own. ``port``: where
    node 0's agent hosts the c10d store (default: a free port); ``via``: the port another node
    reaches it through instead (a ``tcp_fault_proxy`` in front of it), by node."""

    def __init__(self, scenario: str, node_args: list[dict], out: str, env: dict[str, str] | None = None,
                 port: int | None = None, via: dict[int, int] | None = None) -> None:
        os.makedirs(out, exist_ok=True)
        self.out, port = out, port or free_port()
        self.world = 2 * len(node_args)
        self.port = port  # node 0's agent hosts the job's c10d store here
        self.procs = []
        for node, args in enumerate(node_args):
            cmd = [sys.executable, "-c", _AGENT, os.path.join(out, f"agent{node}-stacks.txt"),
                   "--nnodes", str(len(node_args)), "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                   "--master-port", str((via or {}).get(node, port)),
                   "--max-restarts", "0", "--monitor-interval", "0.2", __file__, scenario, json.dumps(args), out]
            log = open(os.path.join(out, f"node{node}.log"), "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}))

    def pid(self, rank: int, timeout: float = 60) -> int:
        path = os.path.join(self.out, f"pid{rank}")
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} never started: {self.logs()}")
            time.sleep(0.05)
        return int(open(path).read())

    def wait(self, timeout: float = 300) -> dict[int, dict]:
        """The ranks' results once both launches ended; a rank without one is ``missing``
        (and ``timed_out`` when the job was killed for running past ``timeout``: generous,
        since CI runs these jobs beside other multi-process tests on 2 cores)."""
        deadline, timed_out = time.monotonic() + timeout, False
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                self.dump_stacks()
                self.kill()
        found = self.results()
        for res in found.values():
            if timed_out and res.get("missing"):
                res["timed_out"] = timeout
        return found

    def results(self, name: str = "rank") -> dict[int, dict]:
        found = {}
        for r in range(self.world):
            path = os.path.join(self.out, f"{name}{r}.json")
            found[r] = json.load(open(path)) if os.path.exists(path) else {"missing": True}
        return found

    def dump_stacks(self) -> None:
        """Ask every live rank and agent for its threads' stacks (``faulthandler`` on SIGUSR1,
        into ``OUT/stacksR.txt`` and ``OUT/agentN-stacks.txt``): what a job killed for time was
        doing, for ``logs()``."""
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGUSR1)
        self._signal_ranks(signal.SIGUSR1)
        time.sleep(2)

    def _signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to every rank that wrote its pid file and is still there."""
        for r in range(self.world):
            path = os.path.join(self.out, f"pid{r}")
            if os.path.exists(path):
                try:
                    os.kill(int(open(path).read()), sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """SIGKILL every rank (torchrun starts each in a session of its own) and both agents."""
        self._signal_ranks(signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def logs(self) -> str:
        parts = [open(os.path.join(self.out, f"node{n}.log")).read()[-3000:] for n in range(len(self.procs))]
        started = [r for r in range(self.world) if os.path.exists(os.path.join(self.out, f"pid{r}"))]
        parts.append(f"--- ranks started (their pid file written): {started}")
        stacks = [(f"rank {r}", f"stacks{r}.txt") for r in range(self.world)]
        stacks += [(f"node {n}'s agent", f"agent{n}-stacks.txt") for n in range(len(self.procs))]
        for who, name in stacks:
            path = os.path.join(self.out, name)
            if os.path.exists(path) and os.path.getsize(path):
                parts.append(f"--- {who}'s threads when the job was killed for time:\n" + open(path).read()[-6000:])
        return "\n".join(parts)


def _main() -> None:
    scenario, args, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    stacks = open(os.path.join(out, f"stacks{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # Job.dump_stacks
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    import torch.distributed as dist

    if os.environ.get("CKPT_DEBUG_LOG"):
        import logging
        logging.basicConfig(level=logging.DEBUG, format=f"%(relativeCreated)d r{rank} %(threadName)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    try:
        result = SCENARIOS[scenario](rank, {**args, "out": out})
    except BaseException as e:  # the test reads the failure from the result file
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    _write(out, f"rank{rank}.json", result)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown; torchrun's exit barrier keeps the store up for the others


if __name__ == "__main__":
    _main()
