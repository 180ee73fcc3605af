"""Workers for tests/test_torchrun_verbs.py: the real ``ckptctl`` command line run by real
torchrun processes, one node or two "nodes" on one host.

``python torchrun_verbs_workers.py OUT ARGV_JSON`` is what torchrun starts on every rank: it
runs each command line of ARGV_JSON (a list of argument lists, one after the other, the
command line's own code unchanged; an entry may be ``{"RANK": argv, ...}``, each rank running
its own, to give ranks different commands) with this rank's stdout and stderr in
``OUT/rankR.N.stdout`` / ``.stderr`` and its exit status in ``OUT/rankR.N.exit``, N the
command's index. One command joins the process group itself, exactly as under a user's
torchrun; several share a group this worker joins first. Before exiting, each rank waits (bounded) until every rank recorded its last
status: torchrun stops the remaining ranks as soon as one exits with an error, and the test
wants each rank's own status.

``launch`` starts one ``torchrun`` per node (static rendezvous on 127.0.0.1, as
``tier_node_workers.Job`` does), each node with its own arguments and environment (its own
destination, its own S3 endpoint to count its traffic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tier_node_workers import free_port  # noqa: E402


@dataclass
class Ran:
    """What one rank's command printed, and its exit status."""

    exit: int
    stdout: str
    stderr: str


def launch(out: str, per_node: list[list[list[str]]], *, nproc: int = 2, env: list[dict[str, str]] | None = None,
           timeout: float = 120) -> dict[int, list[Ran]]:
    """Run the commands ``per_node[k]`` (a list of argument lists) on node k, ``nproc`` ranks per
    node; returns, by global rank, what each of its commands did."""
    os.makedirs(out, exist_ok=True)
    nodes = len(per_node)
    port = free_port()
    procs = []
    for node, argvs in enumerate(per_node):
        if nodes == 1:
            where = ["--standalone"]
        else:
            where = ["--nnodes", str(nodes), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                     "--master-port", str(port)]
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(nproc),
               "--max-restarts", "0", "--monitor-interval", "0.2", __file__, out, json.dumps(argvs)]
        log = open(os.path.join(out, f"node{node}.log"), "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, **((env or [{}] * nodes)[node]), "OMP_NUM_THREADS": "1"}))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
                q.wait()
            raise AssertionError("torchrun did not finish:\n" + logs(out, nodes))
    found: dict[int, list[Ran]] = {}
    for rank in range(nodes * nproc):
        runs = []
        for n in range(len(per_node[0])):
            base = os.path.join(out, f"rank{rank}.{n}")
            if not os.path.exists(base + ".exit"):
                break
            runs.append(Ran(int(open(base + ".exit").read()), open(base + ".stdout").read(), open(base + ".stderr").read()))
        found[rank] = runs
    return found


def logs(out: str, nodes: int) -> str:
    return "\n".join(open(os.path.join(out, f"node{n}.log")).read()[-3000:] for n in range(nodes))


def _main() -> None:
    out, argvs = sys.argv[1], json.loads(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from ckptctl.cli.app import app

    if len(argvs) > 1:
        # Several commands in one launch (torch's start-up is most of a launch's cost): the group
        # is joined once here and the command line finds it joined (``ops.torchrun``); gloo does
        # not reliably join a second group after the first was left in the same process.
        import torch.distributed as dist

        dist.init_process_group("gloo")
    with open(os.path.join(out, f"rank{rank}.pid"), "w") as f:  # for a test that stops or kills one rank
        f.write(str(os.getpid()))
    code = 0
    for n, argv in enumerate(argvs):
        if isinstance(argv, dict):
            argv = argv[str(rank)]
        base = os.path.join(out, f"rank{rank}.{n}")
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(base + ".stdout", "w") as o, open(base + ".stderr", "w") as e:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            try:
                app(args=argv, prog_name="ckptctl")
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        with open(base + ".exit.tmp", "w") as f:
            f.write(str(code))
        os.replace(base + ".exit.tmp", base + ".exit")
    last = len(argvs) - 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(out, f"rank{r}.{last}.exit")) for r in range(world)):
        time.sleep(0.05)
    os._exit(code)


if __name__ == "__main__":
    _main()
