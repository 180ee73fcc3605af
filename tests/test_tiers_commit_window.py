"""A job killed between a save's return and the other nodes' commit of it (2 torchrun "nodes" x
2 ranks, ``tier_node_workers.save_then_close``; node 1 reaches the c10d store through
``tcp_fault_proxy``).

With a node-local first tier, a save commits on rank 0's node; each other node's leader writes
the manifest and marker into its node's copy when rank 0's ``commit`` message reaches it
through the store, a moment after every rank's ``wait()`` returned (docs/protocol.md, "The
node-local commit rule"). Here node 1's leader never gets the commit of step 21 (its wait for
the node messages from the third on is held by the proxy: the commit of 20 and its prune come
first), node 0 has pruned step 20 by its KeepLast(1) (anchored on 21, whose part on node 0
verifies), and then every process of the job is SIGKILLed. The relaunched job, on the same
roots, must resume one step on every rank, with the tensors that step saved.
"""

from __future__ import annotations

import os
import time

from tcp_fault_proxy import TcpFaultProxy
from test_tiers_nodes import _committed, _s3_committed, _shards
from tier_node_workers import Job, free_port

HARNESS_S = 240


def _until(done, job: Job, what: str) -> None:
    deadline = time.monotonic() + HARNESS_S
    while not done():
        if time.monotonic() > deadline:
            job.dump_stacks()
            logs = job.logs()
            job.kill()
            raise AssertionError(f"{what}: not within {HARNESS_S} s\n{logs}")
        time.sleep(0.2)


def _killed_in_the_window(tmp_path, args: list[dict], env: dict[str, str] | None = None) -> list[str]:
    """Run steps 20 and 21; SIGKILL the whole job once every rank's ``wait()`` of 21 returned,
    node 0 committed 21 and pruned 20, while node 1 holds 21's files without its marker."""
    roots = [a["local"] for a in args]
    port = free_port()
    proxy = TcpFaultProxy(port)
    proxy.hold(b"/node/3")  # node 1's leader's wait for node message 3, and so every later one
    try:
        job = Job("save_then_close", args, str(tmp_path / "run1"), env=env, port=port, via={1: proxy.port})
        try:
            _until(lambda: all(os.path.exists(tmp_path / "run1" / f"saved{r}.json") for r in range(4)), job,
                   "every rank's save of 20 and 21 returning")
            _until(lambda: 21 in _committed(roots[0]) and 20 not in _committed(roots[0]), job,
                   "node 0 committing 21 and pruning 20")
            _until(lambda: proxy._held is None, job, "node 1's leader waiting for node message 3")
        finally:
            job.kill()  # every rank and both agents: the whole job dies in the window
    finally:
        proxy.close()
    assert _committed(roots[1]) == {20}, os.listdir(roots[1])
    assert _shards(roots[1], 21) == {2, 3}  # node 1's files of 21 are there, its marker is not
    return roots


def _resumed(tmp_path, scenario: str, args: list[dict], env: dict[str, str] | None = None) -> dict[int, tuple]:
    job = Job(scenario, [{**a, "steps": []} for a in args], str(tmp_path / "run2"), env=env)
    results = job.wait()
    for r, res in results.items():
        assert "error" not in res and "missing" not in res, f"rank {r}: {res}\n{job.logs()}"
    return {r: (res["step"], res["bitwise_equal"]) for r, res in results.items()}


def test_with_peer_replicas_every_rank_resumes_the_step_node_1_had_not_committed(tmp_path) -> None:
    """Peer replicas, no later tier: recovery sends rank 0's manifest and marker to node 1,
    whose files of 21 are all there, and node 1's leader commits its copy before any rank reads
    it. On main, recovery returned early when no node lacked a file, and every rank resumed 20
    (node 0's part of it from its replica on node 1): a step every rank's ``wait()`` had
    returned for, lost."""
    args = [{"local": str(tmp_path / f"node{n}"), "remote": None, "steps": [20, 21], "replicas": 1,
             "keep_local": 1} for n in (0, 1)]
    roots = _killed_in_the_window(tmp_path, args)
    assert _resumed(tmp_path, "replica_load", args) == {r: (21, True) for r in range(4)}
    for root in roots:
        assert 21 in _committed(root), os.listdir(root)


def test_without_replicas_every_rank_resumes_the_newest_step_on_the_next_tier(tmp_path, s3_server: str,
                                                                                s3_url: str) -> None:
    """No replicas: a rank of node 1 needs rank 0's shard of every step (its header, at least:
    the loader reads it on every rank; here also the replicated tensors rank 0 wrote), which
    only node 0 and the later tiers hold. Step 21 never reached S3 (its cadence took 20), so
    every rank resumes 20 (node 0's ranks from S3, node 1's from their disk and S3), the same
    as when node 1 had committed 21: the window changes nothing here."""
    args = [{"local": str(tmp_path / f"node{n}"), "remote": s3_url, "steps": [20, 21]} for n in (0, 1)]
    env = {"AWS_ENDPOINT_URL": s3_server}
    _killed_in_the_window(tmp_path, args, env)
    assert _s3_committed(s3_url) == {20}
    assert _resumed(tmp_path, "load", args, env) == {r: (20, True) for r in range(4)}
