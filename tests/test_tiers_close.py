"""``Checkpointer.close`` at the end of a job with a node-local first tier: bounded when the c10d
store is gone for good, as patient as before when it is not (2 torchrun "nodes" x 2 ranks,
``tier_node_workers.save_then_close``; S3 through moto over HTTP).

A job being torn down loses its store when node 0's torchrun agent (the store's host) exits
before the other ranks close: close must then return on every rank after
``CKPTCTL_CLOSE_STORE_TIMEOUT`` seconds, naming the step that did not reach S3, and that step
stays committed on the nodes' disks. Before that bound existed, rank 0's close retried the
store forever and every other rank waited ``promote_timeout_s`` + 30 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Callable

import pytest
import torch.distributed as dist

from ckptctl.format.layout import step_dir
from ckptctl.tiers import link as link_mod
from ckptctl.tiers.health import Health
from ckptctl.tiers.link import Closing, Link, StoreGone
from helpers import cli
from s3_fault_proxy import FaultProxy
from test_tiers_nodes import _committed, _s3_committed
from tier_node_workers import Job, free_port

PROMOTE_TIMEOUT_S = 600  # the default: a close that waited for it would outlast the harness
HARNESS_S = 240  # far above the bound (5 s), far below what an unbounded close waits


def _await(job: Job, name: str, what: str, timeout: float = HARNESS_S) -> dict[int, dict]:
    """Every rank's ``OUT/<name>R.json``, or the job's logs and stacks in the failure."""
    deadline = time.monotonic() + timeout
    while True:
        found = job.results(name)
        if not any(r.get("missing") for r in found.values()):
            return found
        if time.monotonic() > deadline:
            job.dump_stacks()
            logs = job.logs()
            job.kill()
            raise AssertionError(f"{what}: ranks {[r for r, v in found.items() if v.get('missing')]} did not "
                                 f"within {timeout:.0f} s\n{logs}")
        time.sleep(0.2)


def _until(done: Callable[[], bool], job: Job, what: str, timeout: float = HARNESS_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            logs = job.logs()
            job.kill()
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{logs}")
        time.sleep(0.2)


def test_a_closing_link_gives_up_on_a_store_that_is_gone(monkeypatch) -> None:
    """A real TCPStore server in a process of its own, killed: once close began, a link that
    cannot reach it raises StoreGone after the bound (1 s here), although a reconnect would
    retry for the store's 600 s timeout; then the other links of the channel give up at their
    first failure, without trying to connect."""
    monkeypatch.setattr(link_mod, "POOL", link_mod._Pool())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import datetime, time, torch.distributed as d; "
                               f"s = d.TCPStore('127.0.0.1', {port}, 1, True, timeout=datetime.timedelta(seconds=600)); "
                               "time.sleep(600)"])
    try:
        base = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=600))  # waits for the server
        closing = Closing(timeout_s=1)
        health = Health()
        first = Link(base, "p/", "first thread", "s3://b/t", health, closing)
        second = Link(base, "p/", "second thread", "s3://b/t", health, closing)
        first.call(lambda st: st.set("k", b"v"))
        assert second.call(lambda st: st.get("k")) == b"v"
        server.kill()
        server.wait()
        closing.begin()
        with pytest.raises(StoreGone, match=r"unreachable for \d+ s while closing"):
            first.call(lambda st: st.get("k"))
        assert closing.gone is not None
        with pytest.raises(StoreGone):
            second.call(lambda st: st.get("k"))
        assert second.reconnects == 0
        # What close() reports for them: stopped, not still "retrying".
        troubles = {t.worker: t for t in health.troubles()}
        assert set(troubles) == {"first thread", "second thread"}
        for t in troubles.values():
            assert t.dead and "gave up" in str(t) and "retrying" not in str(t), str(t)
    finally:
        server.kill()
        server.wait()


def _args(tmp_path, s3_url: str, node: int, replicas: int = 0) -> dict:
    return {"local": str(tmp_path / f"node{node}"), "remote": s3_url, "steps": [20, 21],
            "promote_timeout_s": PROMOTE_TIMEOUT_S, "replicas": replicas}


@pytest.mark.parametrize("replicas", [0, 1])
def test_close_returns_when_the_store_is_gone_for_good(tmp_path, s3_server: str, s3_url: str, replicas: int) -> None:
    """Node 0's agent hosts the c10d store; it is killed once every rank saved steps 20 and 21
    (S3's cadence chose 20; 21 only close would promote). Every rank then closes: rank 0 gives
    up on promoting 21, naming it and the store, and says the nodes' disks hold it; the other
    ranks stop waiting for rank 0's last round. Both nodes still hold 21 committed, and it
    verifies. With peer replicas, every rank's replica thread ends too."""
    out = str(tmp_path / "out")
    env = {"AWS_ENDPOINT_URL": s3_server, "CKPTCTL_CLOSE_STORE_TIMEOUT": "5"}
    job = Job("save_then_close", [_args(tmp_path, s3_url, n, replicas) for n in (0, 1)], out, env=env)
    try:
        _await(job, "saved", "saving steps 20 and 21")
        # A node's copy commits once its leader got rank 0's marker through the store, a moment
        # after the save returned: the store dies only after that (what a close with the store
        # gone does to a step, not how fast the message travels, is tested here).
        _until(lambda: all(21 in _committed(str(tmp_path / f"node{n}")) for n in (0, 1)), job,
               "both nodes committing step 21")
        store_host = job.procs[0]
        os.kill(store_host.pid, signal.SIGKILL)  # the agent only: its ranks live in sessions of their own
        store_host.wait()
        open(os.path.join(out, "close"), "w").close()
        results = _await(job, "rank", "close with the store gone")
    finally:
        job.kill()
    for r, res in results.items():
        assert "error" not in res and "close_error" not in res, f"rank {r}: {res}\n{job.logs()}"
        assert res["close_s"] < PROMOTE_TIMEOUT_S, f"rank {r} waited as if the store were there: {res}"
    flushed = results[0]["flushed"]
    assert flushed["complete"] is False and flushed["step"] == 21, results[0]
    assert "c10d store" in flushed["reason"] and "unreachable" in flushed["reason"], flushed
    assert len(flushed["tiers"]) == 1 and str(tmp_path / "node0") in flushed["tiers"][0], flushed
    said = "\n".join(results[0]["warnings"])
    assert "close: step 21 did not reach" in said and "load_latest" in said, said
    for r in (1, 2, 3):
        assert results[r]["flushed"] is None, results[r]
    said = "\n".join(results[2]["warnings"])
    assert "close: rank 2:" in said and "step 21" in said and "load_latest" in said, said
    # Nothing was lost: both nodes hold 21 committed and whole; S3 never got its marker.
    for n in (0, 1):
        root = str(tmp_path / f"node{n}")
        assert 21 in _committed(root), os.listdir(root)
        r = cli("verify", root, "--latest")
        assert r.exit_code == 0, r.stdout + r.stderr
    assert 21 not in _s3_committed(s3_url)


def test_close_still_waits_for_a_slow_promotion(tmp_path, s3_server: str, s3_url: str) -> None:
    """A healthy job whose final promotion takes longer than ``CKPTCTL_CLOSE_STORE_TIMEOUT``
    (each upload of step 21's objects held 4 s by the proxy; the bound is 1 s): close waits
    for it, as it did before the bound, and 21 reaches S3."""
    proxy = FaultProxy(s3_server).start()
    proxy.rule = lambda method, path: "stall:4" if method == "PUT" and step_dir(21) in path else None
    out = str(tmp_path / "out")
    env = {"AWS_ENDPOINT_URL": proxy.url, "CKPTCTL_CLOSE_STORE_TIMEOUT": "1"}
    try:
        job = Job("save_then_close", [_args(tmp_path, s3_url, n) for n in (0, 1)], out, env=env)
        try:
            saved = _await(job, "saved", "saving steps 20 and 21")
            open(os.path.join(out, "close"), "w").close()
            results = _await(job, "rank", "close of a healthy job")
        finally:
            job.kill()
    finally:
        proxy.stop()
    for r, res in results.items():
        assert "error" not in res and "close_error" not in res, f"rank {r}: {res}\n{job.logs()}"
        assert not any("gives up" in w for w in res["warnings"]), res["warnings"]
    assert results[0]["flushed"]["complete"] is True and results[0]["flushed"]["step"] == 21, results[0]
    assert any(a.startswith("stall") for a, _, _ in proxy.injected), "the promotion of 21 was never slowed"
    assert 21 in _s3_committed(s3_url)
    # Each new store connection costs a reverse DNS lookup on the store's one server thread
    # (``tiers.link``). Every rank: the default group's, the heartbeat's, the save barrier's, the
    # channel's own, the upload thread's; a node's leader: its keeper's; rank 0: its
    # after-commit thread's (node messages and node lists: one, shared; two before), the
    # promote sender's, the promotion leader's and its watch's. A guard: the count only goes down.
    connections = {r: v["store_connections"] for r, v in saved.items()}
    assert connections == {0: 10, 1: 5, 2: 6, 3: 5}, connections
