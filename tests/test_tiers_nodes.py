"""Node-local first tier (issue 23, second slice): 2 torchrun "nodes" x 2 ranks on one host,
each node with its own local root, plus a moto S3 tier over HTTP (``tier_node_workers.py``).

Each node holds only its own ranks' shards plus the manifest and marker; promotion is a round
in which every rank uploads its own shards and rank 0 writes the S3 marker last; with S3
stopped, both nodes go on committing and promotion catches up when it returns, sweeping the
leftovers of the rounds it abandoned; a node's abandoned partial save goes by prune's rule; a
rank killed mid-round leaves S3's newest committed checkpoint valid; a node that lost its disk
resumes from S3, bitwise equal. (The sweep and "already present" in detail, in one process:
``test_tier_leftovers.py``.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch

from ckptctl import Checkpointer, KeepLast, Tier
from ckptctl.format.layout import step_dir
from ckptctl.layouts.native_read import read_committed
from ckptctl.storage import open_storage
from helpers import cli
from s3_fault_proxy import FaultProxy
from test_s3_requests import request_log
from tier_node_workers import Job
from tier_workers import state_for



def _committed(root: str) -> set[int]:
    if not os.path.isdir(root):
        return set()
    return {int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")
            and os.path.exists(os.path.join(root, n, "COMMITTED"))}


def _s3_committed(url: str) -> set[int]:
    root = open_storage(url)
    return {int(i.key.split("-")[1]) for i in root.children() if i.key.startswith("step-")
            and root.sub(i.key).stat("COMMITTED") is not None}


def _shards(root: str, step: int) -> set[int]:
    d = os.path.join(root, step_dir(step))
    return {int(n[5:10]) for n in os.listdir(d) if n.startswith("rank-") and n.endswith(".safetensors")}


def _ok(results: dict[int, dict], job: Job) -> None:
    for r, res in results.items():
        assert "error" not in res and "missing" not in res, f"rank {r}: {res}\n{job.logs()}"


def _wait_for(check, what: str, job: Job, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            logs = job.logs()
            job.kill()  # a job told to hold would otherwise outlive the test
            raise AssertionError(f"{what}\n{logs}")
        time.sleep(0.1)


def test_two_nodes_commit_promote_prune_survive_a_kill_and_a_lost_node(tmp_path, s3_server: str, s3_url: str) -> None:
    """One job's life in three launches (each launch costs ~20 s of torch imports on 2 cores).
    Tiers (``tier_node_workers._tiers``): node-local KeepLast(1); S3 KeepLast(2), every 20 steps."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    proxy = FaultProxy(s3_server).start()  # every rank's S3 traffic goes through it
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1"}
    try:
        # --- 1. saves commit on each node; promotion reaches S3; each tier prunes by its rules.
        # Node 1 holds a save that failed there 7 h ago (removed by node retention, prune's
        # partial rule); node 0 one that may still be written (kept). S3 first fails rank 3's
        # uploads only: step 10's round leaves ranks 0-2's objects, no marker. Then S3 stops
        # altogether: both nodes still commit 20 and 30. When it returns, the promoter catches
        # up with 30 and sweeps step 10's leftovers.
        old = time.time() - 7 * 3600
        failed = os.path.join(roots[1], step_dir(5))
        os.makedirs(failed)
        with open(os.path.join(failed, "rank-00002-of-00004.safetensors"), "wb") as f:
            f.write(b"x" * 64)
        for path in (os.path.join(failed, "rank-00002-of-00004.safetensors"), failed):
            os.utime(path, (old, old))
        fresh = os.path.join(roots[0], step_dir(7))
        os.makedirs(fresh)
        proxy.rule = lambda method, path: "503" if method in ("PUT", "POST") and "rank-00003" in path else None
        job = Job("save", [{"local": r, "remote": s3_url, "steps": [10, 20, 30], "gates": [20]} for r in roots],
                  str(tmp_path / "run1"), env=env)
        step10 = open_storage(s3_url).sub(step_dir(10))
        _wait_for(lambda: all(step10.stat(f"rank-0000{k}-of-00004.safetensors") for k in range(3)),
                  "step 10's round never uploaded ranks 0-2", job)
        proxy.rule = lambda method, path: "503"  # S3 stopped
        open(os.path.join(tmp_path, "run1", "go20"), "w").close()
        _wait_for(lambda: all(30 in _committed(r) for r in roots), "local commits stopped with S3", job)
        outage = len(proxy.injected)
        _wait_for(lambda: len(proxy.injected) > outage, "promotion never retried during the outage", job)
        assert _s3_committed(s3_url) == set()
        proxy.rule = lambda method, path: None  # S3 is back
        results = job.wait()
        _ok(results, job)
        assert [results[r]["node"] for r in range(4)] == ["0", "0", "1", "1"]
        outage_saves = [results[r]["save_s"][1:] for r in range(4)]  # steps 20 and 30, S3 stopped
        assert max(max(s) for s in outage_saves) < 10, f"a save waited for S3: {outage_saves}"
        assert results[0]["flushed"] == {"complete": True, "step": 30, "tiers": [roots[0], s3_url], "reason": ""}
        for node, root in enumerate(roots):
            assert _committed(root) == {30}, f"node {node}: KeepLast(1) on the first tier\n{job.logs()}"
            assert _shards(root, 30) == {2 * node, 2 * node + 1}  # only this node's ranks' shards
            manifest, _ = read_committed(open_storage(os.path.join(root, step_dir(30))))
            assert manifest.step == 30 and len(manifest.files) == 4
        assert not os.path.exists(failed) and os.path.isdir(fresh)
        a, b = (open(os.path.join(r, step_dir(30), "manifest.json"), "rb").read() for r in roots)
        assert a == b  # one checkpoint, split across the nodes
        assert _s3_committed(s3_url) == {30}
        assert list(step10.list()) == [], "step 10's leftovers were not swept"
        r = cli("verify", f"{s3_url}/{step_dir(30)}", "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True, r.stdout + r.stderr
        r = cli("ls", roots[1], "--tier", s3_url, "--json")  # node 1 holds half of step 30's shards
        assert r.exit_code == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["checkpoints"] == [
            {"step": 30, "name": step_dir(30), "tiers": {roots[1]: "node part", s3_url: "committed"}}], r.stdout

        # --- 2. node 1 lost its disk: resume from S3, bitwise equal. Then step 40 is chosen for
        # S3 (45 and 50 are not due) and its promotion stalls on rank 3's upload: both nodes keep
        # 40 past KeepLast(1) while it waits (45 goes); rank 3 is killed mid-round.
        shutil.rmtree(roots[1])
        blocked = f"{step_dir(40)}/rank-00003"
        proxy.rule = lambda method, path: "503" if method in ("PUT", "POST") and blocked in path else None
        job = Job("load", [{"local": r, "remote": s3_url, "then_save": [40, 45, 50], "hold": True}
                           for r in roots], str(tmp_path / "run2"), env=env)
        victim = job.pid(3)
        step40 = open_storage(s3_url).sub(step_dir(40))
        _wait_for(lambda: all(_committed(r) == {40, 50} for r in roots), "nodes never pruned 45 around pinned 40", job)
        _wait_for(lambda: proxy.injected and all(step40.stat(f"rank-0000{k}-of-00004.safetensors") for k in range(3)),
                  "step 40 never reached mid-promotion", job)
        loaded = job.results("loaded")
        if any(loaded[k] != {"step": 30, "bitwise_equal": True} for k in range(4)):
            job.kill()
            raise AssertionError(loaded)
        os.kill(victim, 9)
        time.sleep(0.5)
        job.kill()
        assert step40.stat("COMMITTED") is None
        assert 30 in _s3_committed(s3_url) and 40 not in _s3_committed(s3_url)
        r = cli("verify", s3_url, "--latest")
        assert r.exit_code == 0, r.stdout + r.stderr
        r = cli("latest", s3_url)
        assert r.exit_code == 0 and r.stdout.strip().endswith(step_dir(30)), r.stdout + r.stderr

        # --- 3. relaunch with S3 healthy. Step 50 is committed on both nodes only (never
        # promoted), and node 1's ranks need node 0's files of it (the replicated tensors'
        # writers): S3 does not hold it committed, so the nodes fetch from each other what their
        # ranks read and lack (tiers.node_fetch), and every rank resumes 50; the next promotion
        # completes; both tiers prune.
        proxy.rule = lambda method, path: None
        job = Job("load", [{"local": r, "remote": s3_url, "then_save": [60]} for r in roots], str(tmp_path / "run3"), env=env)
        results = job.wait()
        _ok(results, job)
        for k in range(4):
            assert results[k]["step"] == 50 and results[k]["bitwise_equal"] is True, \
                (k, results[k], sorted(i.key for i in open_storage(s3_url).list()), job.logs())
        assert results[0]["flushed"]["complete"] is True and results[0]["flushed"]["step"] == 60
        assert _s3_committed(s3_url) == {30, 60}
        assert cli("verify", f"{s3_url}/{step_dir(60)}").exit_code == 0
        for root in roots:
            assert _committed(root) == {60}
    finally:
        proxy.stop()


def test_one_process_node_local_tier_commits_prunes_and_promotes(tmp_path, s3_url: str, caplog) -> None:
    """Without torch.distributed the node is the whole job: the same wiring, no channel. The
    resume after the node lost its disk says, once, that its file came from S3."""
    local = str(tmp_path / "nvme")
    with pytest.raises(ValueError, match="only the first tier"):
        Checkpointer(tiers=[Tier(local), Tier(s3_url, node_local=True)])
    ck = Checkpointer(tiers=[Tier(local, retention=KeepLast(2), node_local=True), Tier(s3_url, retention=KeepLast(1))])
    for step in (1, 2, 3):
        ck.save(step, state_for(step, 0)).wait()
    flushed = ck.close(promote_timeout_s=60)
    assert flushed and flushed.step == 3
    assert _committed(local) == {2, 3}
    assert _s3_committed(s3_url) == {3}
    shutil.rmtree(local)
    state = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "extra": {}}
    ck = Checkpointer(tiers=[Tier(local, node_local=True), Tier(s3_url)])
    with caplog.at_level(logging.INFO, logger="ckptctl"):
        assert ck.load_latest(state, prepare=False) == 3
    said = [r.getMessage() for r in caplog.records if " loaded " in r.getMessage()]
    assert said == [f"tiers: rank 0 loaded {step_dir(3)}: 3 files from {s3_url}/{step_dir(3)} "
                    f"(COMMITTED, manifest.json, rank-00000-of-00001.safetensors)"], caplog.text
    ck.close(promote_timeout_s=1)
    assert all(torch.equal(state["model"][k], state_for(3, 0)["model"][k]) for k in ("w", "b"))


def test_a_round_waits_for_a_slow_rank_and_not_for_a_dead_one(tmp_path, s3_server: str, s3_url: str) -> None:
    """A round's deadline grows with its bytes, not the save's ``timeout_s`` (4 s here): rank 3's
    upload of step 10 stalls 8 s and the round still completes, at the first attempt. Rank 3
    is then killed while its upload of step 30 hangs: the round ends once its heartbeat stood
    still for ``liveness_s``, long before the deadline (a floor of minutes)."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    proxy = FaultProxy(s3_server).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1"}

    def rule(method: str, path: str) -> str | None:
        if method in ("PUT", "POST") and "rank-00003" in path:
            return "stall:8" if step_dir(10) in path else "hold" if step_dir(30) in path else None
        return None

    proxy.rule = rule
    try:
        job = Job("load", [{"local": r, "remote": s3_url, "then_save": [10, 30], "hold": True, "timeout_s": 4,
                            "liveness_s": 5, "lag_warning_s": 0.5} for r in roots], str(tmp_path / "run"), env=env)
        _wait_for(lambda: 10 in _s3_committed(s3_url), "step 10 never reached S3 past its slow rank", job)
        uploads = [p for a, m, p in proxy.injected if a == "stall:8" and "uploadId" not in p]
        assert len({p.split("?")[0] for p in uploads}) == len(uploads), f"a round was retried: {uploads}"
        _wait_for(lambda: any(a == "hold" for a, _, _ in proxy.injected), "step 30's round never started", job)
        os.kill(job.pid(3), 9)
        log0 = os.path.join(tmp_path, "run", "node0.log")
        _wait_for(lambda: "no heartbeat from rank 3" in open(log0).read(), "the round waited for a dead rank", job)
        assert 30 not in _s3_committed(s3_url)
        job.kill()
    finally:
        proxy.release.set()
        proxy.stop()


def test_a_shard_the_next_tier_lost_before_the_marker_is_caught_and_promoted_again(tmp_path, s3_url: str) -> None:
    """Rank 0 checks every rank's file at the next tier (there, at its size) before it writes
    the step's marker there, from one listing of the step. Here one shard is deleted at S3 just
    before that listing, after its rank reported it uploaded: the marker is not written over
    the hole; the round is retried and the step reaches S3 whole, marker once."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    out = str(tmp_path / "run")
    job = Job("save", [{"local": r, "remote": s3_url, "steps": [20], "lose_once": 20} for r in roots], out)
    results = job.wait()
    for r in range(4):
        assert "error" not in results[r] and not results[r].get("missing"), (r, results[r], job.logs())
    assert os.path.exists(os.path.join(out, "lost")), job.logs()
    assert open(os.path.join(out, "markers")).read().split() == ["True"], job.logs()  # once, after the loss
    r = cli("verify", f"{s3_url}/{step_dir(20)}")
    assert r.exit_code == 0, r.stdout + r.stderr


def test_a_promotion_round_writes_the_manifest_beside_the_uploads_and_only_the_marker_after(tmp_path, s3_url: str) -> None:
    """Rank 0 writes the next tier's manifest while the ranks upload their shards (it commits
    nothing without the marker): after the last shard is in, the round's check of the sizes
    (one listing) and the marker are all it sends. Here the shard's upload waits until the
    manifest's PUT was sent, which a round writing it after the data (main) never gets past."""
    import threading

    from ckptctl.format.layout import MARKER

    client = open_storage(s3_url)._client.s3  # type: ignore[attr-defined]
    manifest_sent = threading.Event()

    def hold(params: dict, **_kw: object) -> None:
        key = params.get("Key", "")
        if key.endswith(".safetensors") and not manifest_sent.wait(30):
            raise AssertionError("the shard's upload went out before the manifest's PUT")
        if key.endswith("/manifest.json"):
            manifest_sent.set()

    remote = f"{s3_url}/tier1"
    client.meta.events.register("provide-client-params.s3.PutObject", hold)
    client.meta.events.register("provide-client-params.s3.CreateMultipartUpload", hold)
    try:
        with request_log(client) as log:
            ck = Checkpointer(tiers=[Tier(str(tmp_path / "nvme"), node_local=True), Tier(remote)])
            ck.save(1, state_for(1, 0)).wait()
            assert ck.close(promote_timeout_s=60)
    finally:
        client.meta.events.unregister("provide-client-params.s3.PutObject", hold)
        client.meta.events.unregister("provide-client-params.s3.CreateMultipartUpload", hold)
    data = max(i for i, e in enumerate(log) if e[0] == "answered" and e[2].endswith(".safetensors"))
    marker = next(i for i, e in enumerate(log) if e[0] == "sent" and e[2].endswith("/" + MARKER))
    between = [(op, key.rsplit("/", 1)[-1]) for kind, op, key in log[data:marker + 1] if kind == "sent"]
    writes = [key for op, key in between if op not in ("ListObjectsV2", "HeadObject", "GetObject")]
    assert writes == [MARKER], between  # on main: the manifest, then the marker
    assert cli("verify", f"{remote}/{step_dir(1)}").exit_code == 0
