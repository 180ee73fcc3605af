"""Peer replicas of a node-local first tier (issue 23): ``Tier(path, node_local=True, replicas=1)``.

2 torchrun "nodes" x 2 ranks on one host (``tier_node_workers.py``, scenarios ``replica_save``
and ``replica_load``), a moto S3 tier over HTTP behind the fault proxy. Each node keeps its
source node's shards under ``<root>/.ckptctl-replicas/<step>/``, marker last; retention
removes them with their steps; a node whose root was deleted gets its part back from its
partner, bitwise equal, with no shard byte read from S3 (rank 0's node too: the other nodes
offer the steps they hold, ``tiers.node_candidates``); a partner killed mid-replication
does not hang the other ranks' saves or their close. (``replicas=0`` recovering from S3:
``test_tiers_nodes.py``.)
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import time

import pytest

from ckptctl import Checkpointer, Tier
from ckptctl.errors import UsageError
from ckptctl.format.layout import step_dir
from ckptctl.tiers.replica_link import ring_of
from helpers import cli
from s3_fault_proxy import FaultProxy
from tier_node_workers import Job

REPLICAS = ".ckptctl-replicas"


def _committed(root: str) -> set[int]:
    if not os.path.isdir(root):
        return set()
    return {int(n.split("-")[1]) for n in os.listdir(root) if n.startswith("step-")
            and os.path.exists(os.path.join(root, n, "COMMITTED"))}


def _shard(rank: int) -> str:
    return f"rank-{rank:05d}-of-00004.safetensors"


def _ok(results: dict[int, dict], job: Job, ranks=range(4)) -> None:
    for r in ranks:
        res = results[r]
        assert "error" not in res and "missing" not in res, f"rank {r}: {res}\n{job.logs()}"


# --- the option ---------------------------------------------------------------------------------


def test_replicas_option_is_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="replicas=1 needs node_local=True"):
        Tier(str(tmp_path), replicas=1)
    for bad in (2, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match="Tier.replicas must be 0 or 1"):
            Tier(str(tmp_path), node_local=True, replicas=bad)
    assert Tier(str(tmp_path), node_local=True, replicas=1).replicas == 1
    with pytest.raises(UsageError, match="one node"):  # one process is one node: no partner
        Checkpointer(tiers=[Tier(str(tmp_path / "a"), node_local=True, replicas=1)])


def test_the_ring_pairs_each_rank_with_the_same_local_rank_on_the_next_node() -> None:
    ring = ring_of(["b", "b", "a", "a", "c", "c"])  # node order: by lowest rank
    assert [ring.partner(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [ring.source(r) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    with pytest.raises(UsageError, match="needs a partner node"):
        ring_of(["a", "a"])
    with pytest.raises(UsageError, match="different numbers of ranks"):
        ring_of(["a", "a", "b"])


# --- two nodes ----------------------------------------------------------------------------------


def test_replicas_on_the_partner_node_restore_a_lost_node_without_s3(tmp_path, s3_server: str, s3_url: str) -> None:
    """Launch 1 saves 10, 20, 30 (node-local KeepLast(2)); S3 refuses step 30, so S3's newest is
    10 and only a replica can bring node 1's part of 30 back. Launch 2, after node 1's root was
    deleted: ``load_latest`` resumes 30 bitwise equal, and no shard is read from S3."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    proxy = FaultProxy(s3_server).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1"}
    seen: list[tuple[str, str]] = []
    try:
        # Node 1 holds an abandoned partial replica idle for 7 h (swept by node retention);
        # node 0 a fresh one (a round may still write it: kept).
        old = time.time() - 7 * 3600
        stale = os.path.join(roots[1], REPLICAS, step_dir(5))
        os.makedirs(stale)
        with open(os.path.join(stale, _shard(0)), "wb") as f:
            f.write(b"x" * 64)
        for path in (os.path.join(stale, _shard(0)), stale):
            os.utime(path, (old, old))
        fresh = os.path.join(roots[0], REPLICAS, step_dir(7))
        os.makedirs(fresh)
        proxy.rule = lambda method, path: "503" if method in ("PUT", "POST") and step_dir(30) in path else None
        job = Job("replica_save", [{"local": r, "remote": s3_url, "steps": [10, 20, 30], "promote_timeout_s": 3}
                                   for r in roots], str(tmp_path / "run1"), env=env)
        results = job.wait()
        _ok(results, job)
        for node, root in enumerate(roots):
            assert _committed(root) == {20, 30}, job.logs()
            assert sorted(os.listdir(os.path.join(root, REPLICAS))) == \
                ([step_dir(7)] if node == 0 else []) + [step_dir(20), step_dir(30)], "replicas outlived their step"
            other = roots[1 - node]
            sources = (2, 3) if node == 0 else (0, 1)  # node i holds node i-1's shards
            for step in (20, 30):
                rep = os.path.join(root, REPLICAS, step_dir(step))
                assert sorted(os.listdir(rep)) == sorted([_shard(k) for k in sources] +
                                                         [f"rank-{k:05d}.replica" for k in sources])
                for k in sources:
                    assert filecmp.cmp(os.path.join(rep, _shard(k)), os.path.join(other, step_dir(step), _shard(k)),
                                       shallow=False)
                    marker = json.load(open(os.path.join(rep, f"rank-{k:05d}.replica")))
                    assert marker["step"] == step and marker["files"] == {
                        _shard(k): os.path.getsize(os.path.join(rep, _shard(k)))}
        assert not os.path.exists(stale) and os.path.isdir(fresh)
        shard_bytes = sum(os.path.getsize(os.path.join(roots[k // 2], step_dir(30), _shard(k))) for k in range(4))
        replication = results[0]["replication"]
        assert replication["30"]["replica_bytes"] == shard_bytes, replication
        assert 0 < replication["30"]["replicated_s"] < 30
        assert results[0]["flushed"]["complete"] is False  # S3 refused 30: its newest is 10

        # The verbs on a node root are not confused by the replicas.
        r = cli("ls", roots[0], "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        assert [c["name"] for c in json.loads(r.stdout)["checkpoints"]] == [step_dir(20), step_dir(30)], r.stdout
        r = cli("prune", roots[0], "--keep-last", "1", "--dry-run", "--json")
        assert REPLICAS not in r.stdout + r.stderr, r.stdout
        r = cli("verify", roots[0], "--all", "--json")
        assert REPLICAS not in r.stdout + r.stderr, r.stdout

        # --- node 1 lost its disk. S3 healthy, every request recorded.
        shutil.rmtree(roots[1])

        def record(method: str, path: str) -> None:
            seen.append((method, path))
            return None

        proxy.rule = record
        job = Job("replica_load", [{"local": r, "remote": s3_url, "promote_timeout_s": 3} for r in roots],
                  str(tmp_path / "run2"), env=env)
        results = job.wait()
        _ok(results, job)
        for k in range(4):
            assert results[k]["step"] == 30 and results[k]["bitwise_equal"] is True, (k, results[k], job.logs())
        shard_reads = [(m, p) for m, p in seen if m == "GET" and ".safetensors" in p]
        assert shard_reads == [], shard_reads
        assert _committed(roots[1]) == {30}  # node 1's copy is whole and committed again
        for k in (2, 3):
            assert filecmp.cmp(os.path.join(roots[1], step_dir(30), _shard(k)),
                               os.path.join(roots[0], REPLICAS, step_dir(30), _shard(k)), shallow=False)
        rep = os.path.join(roots[1], REPLICAS, step_dir(30))  # and so is the replica it held
        assert sorted(os.listdir(rep)) == sorted([_shard(0), _shard(1), "rank-00000.replica", "rank-00001.replica"])
    finally:
        proxy.stop()


def test_a_partner_killed_mid_replication_does_not_hang_saves(tmp_path, s3_url: str) -> None:
    """Shards of about 16 MiB; rank 3 (rank 1's partner and source) is SIGKILLed as soon as a
    replica transfer with it is seen in flight (a temporary file of its shard, or of rank 1's,
    in a replica directory). Ranks 0 and 1 (node 1's agent ends rank 2) see their next saves
    fail within the liveness bound, and close returns; rank 1's half-received replica is
    removed, rank 0 logs step 10's replica as incomplete."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    job = Job("replica_save", [{"local": r, "remote": s3_url, "steps": [10, 20, 30], "own_mb": 16, "pause_s": 0.5,
                                "timeout_s": 10, "liveness_s": 6, "promote_timeout_s": 3} for r in roots],
              str(tmp_path / "run"))
    reps = [os.path.join(r, REPLICAS, step_dir(10)) for r in roots]
    victim = job.pid(3)
    caught = None
    deadline = time.monotonic() + 60
    while caught is None and time.monotonic() < deadline:
        seen = [os.listdir(d) if os.path.isdir(d) else [] for d in reps]
        if any(n.startswith(".rank-00003") for n in seen[0]) or any(n.startswith(".rank-00001") for n in seen[1]):
            caught = True  # mid-transfer
        elif "rank-00003.replica" in seen[0] and "rank-00001.replica" in seen[1]:
            caught = False  # missed: both transfers were already complete
        else:
            time.sleep(0.002)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    done = [os.path.join(tmp_path, "run", f"rank{r}.json") for r in (0, 1)]
    while not all(os.path.exists(p) for p in done) and time.monotonic() - t0 < 90:
        time.sleep(0.2)
    elapsed = time.monotonic() - t0
    results = job.results()
    job.kill()  # torchrun's agents wait in their exit barrier for the node that failed
    assert caught is not None, f"step 10's replica round never started\n{job.logs()}"
    _ok(results, job, ranks=(0, 1))
    for r in (0, 1):
        saves = results[r]["saves"]
        assert "error" not in saves[0], (r, saves, job.logs())
        assert all("error" in s for s in saves[1:]), (r, saves)  # a rank is dead: no commit
        assert all(s["done_s"] < 30 for s in saves), (r, saves)
        assert results[r]["close_s"] < 30, (r, results[r])
    assert elapsed < 90, elapsed
    assert _committed(roots[0]) == {10}
    log0 = open(os.path.join(tmp_path, "run", "node0.log")).read()
    assert "peer replica of step-0000000010 incomplete" in log0 and "unexpectedly" not in log0, (caught, log0[-3000:])
    # Rank 1 (alive) aborted what it was receiving from the dead rank: no temporary is left (no
    # directory at all when the kill came before node 0 received a byte: caught on node 1's side).
    left = os.listdir(reps[0]) if os.path.isdir(reps[0]) else []
    assert not [n for n in left if n.startswith(".")], (caught, left)
    # Whatever the dead rank's round reached, a replica marker only ever stands for whole files.
    for rep in reps:
        for name in os.listdir(rep) if os.path.isdir(rep) else []:
            if name.endswith(".replica"):
                for f, size in json.load(open(os.path.join(rep, name)))["files"].items():
                    assert os.path.getsize(os.path.join(rep, f)) == size


def test_a_lost_rank_0_node_resumes_the_newest_step_the_other_nodes_hold(tmp_path, s3_server: str, s3_url: str) -> None:
    """Rank 0 lists the candidates, so its node is the hard one to lose. Launch 1 saves 10, 20,
    30 while S3 refuses 30 (S3's newest: 10); node 0's root (rank 0's node) is deleted. Launch
    2: node 1's leader tells rank 0 it holds 20 and 30, node 1 serves node 0's shards of 30
    from its replica and the manifest from its own copy, and every rank resumes 30 bitwise,
    with no shard read from S3; node 0's copy of 30 is committed again, replica included."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    proxy = FaultProxy(s3_server).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1"}
    seen: list[tuple[str, str]] = []
    try:
        proxy.rule = lambda method, path: "503" if method in ("PUT", "POST") and step_dir(30) in path else None
        job = Job("replica_save", [{"local": r, "remote": s3_url, "steps": [10, 20, 30], "promote_timeout_s": 3}
                                   for r in roots], str(tmp_path / "run1"), env=env)
        results = job.wait()
        _ok(results, job)
        assert _committed(roots[1]) == {20, 30}, job.logs()
        assert results[0]["flushed"]["complete"] is False  # S3 refused 30: its newest is 10

        shutil.rmtree(roots[0])

        def record(method: str, path: str) -> None:
            seen.append((method, path))
            return None

        proxy.rule = record
        job = Job("replica_load", [{"local": r, "remote": s3_url, "promote_timeout_s": 3} for r in roots],
                  str(tmp_path / "run2"), env=env)
        results = job.wait()
        _ok(results, job)
        for k in range(4):
            assert results[k]["step"] == 30 and results[k]["bitwise_equal"] is True, (k, results[k], job.logs())
        shard_reads = [(m, p) for m, p in seen if m == "GET" and ".safetensors" in p]
        assert shard_reads == [], shard_reads
        assert _committed(roots[0]) == {30}, job.logs()  # node 0's copy is whole and committed again
        for k in (0, 1):
            assert filecmp.cmp(os.path.join(roots[0], step_dir(30), _shard(k)),
                               os.path.join(roots[1], REPLICAS, step_dir(30), _shard(k)), shallow=False)
        rep = os.path.join(roots[0], REPLICAS, step_dir(30))  # and so is the replica node 0 held of node 1
        assert sorted(os.listdir(rep)) == sorted([_shard(2), _shard(3), "rank-00002.replica", "rank-00003.replica"])
        for k in (2, 3):
            assert filecmp.cmp(os.path.join(rep, _shard(k)), os.path.join(roots[1], step_dir(30), _shard(k)),
                               shallow=False)
    finally:
        proxy.stop()


def test_a_closed_channels_store_connections_serve_the_next_checkpointer(monkeypatch) -> None:
    """Each new TCPStore connection costs a reverse DNS lookup on the client and on the store's
    one server thread; a resolver that drops one of a burst stalls every rank 5 s. So a closed
    channel's idle connections are reused by the next one (under its own prefix), never one of
    another job's store."""
    import torch.distributed as dist

    from ckptctl.tiers import channel as channel_mod
    from ckptctl.tiers import link as link_mod
    from tier_node_workers import free_port

    base = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    monkeypatch.setattr(link_mod, "POOL", link_mod._Pool())
    monkeypatch.setattr(channel_mod, "_default_store", lambda: base)
    first = channel_mod.Channel("g1", 0, 1)
    assert first.exchange("nodes", "node-0", 5.0) == ["node-0"]
    worker = first.link("worker", "")
    used = [first._own._raw, worker._raw]  # held: the same objects come back
    worker.give_back()  # a thread that took stop
    first.close()

    second = channel_mod.Channel("g2", 0, 1)
    assert second.exchange("nodes", "node-1", 5.0) == ["node-1"]
    again = second.link("worker", "")
    reused = [second._own._raw, again._raw]
    assert all(any(r is u for u in used) for r in reused) and reused[0] is not reused[1]  # no new connection
    again.call(lambda st: st.set("k", b"v"))
    assert dist.PrefixStore("ckptctl-tiers/g2/", base).get("k") == b"v"
    assert not dist.PrefixStore("ckptctl-tiers/g1/", base).check(["k"])

    other = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    monkeypatch.setattr(channel_mod, "_default_store", lambda: other)  # a re-initialised job
    again.give_back()
    fresh = channel_mod.Channel("g1", 0, 1).link("worker", "")._raw
    assert not any(fresh is u for u in used)


def test_each_node_root_verifies_and_names_the_step_load_latest_resumes(tmp_path, s3_url: str) -> None:
    """Issue 30: on a node's own root ``verify --latest`` said a file of another node's rank was
    missing (exit 1), ``latest`` that no checkpoint verifies and ``prune`` that every one was
    broken. Now each node's root judges what that node holds, names what lives elsewhere, and
    ``latest`` names the step ``load_latest`` resumes; a file of its own ranks lost still fails."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    args = [{"local": r, "remote": s3_url, "steps": [10, 20], "promote_timeout_s": 10} for r in roots]
    job = Job("replica_save", args, str(tmp_path / "run1"))
    _ok(job.wait(), job)
    for node, root in enumerate(roots):
        assert _committed(root) == {10, 20}, job.logs()
        mine = (0, 1) if node == 0 else (2, 3)
        for k in range(4):  # each node holds its own ranks' shards only
            assert os.path.exists(os.path.join(root, step_dir(20), _shard(k))) == (k in mine)
        r = cli("verify", root, "--latest")
        assert r.exit_code == 0 and r.stdout.startswith(f"ok  {os.path.join(root, step_dir(20))}"), r.stdout + r.stderr
        doc = cli("verify", root, "--latest", "--json").json()
        note = doc["checkpoints"][0]["note"]
        assert f"ranks {', '.join(str(k) for k in mine)}) holds 2 of the 4 files" in note, note
        r = cli("latest", root)
        assert r.exit_code == 0 and r.stdout.strip() == os.path.join(root, step_dir(20)), r.stdout + r.stderr
        r = cli("prune", root, "--keep-last", "1", "--dry-run", "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        actions = {i["name"]: i["action"] for i in r.json()["plan"]["items"]}
        assert actions == {step_dir(10): "delete", step_dir(20): "keep"}, actions
        assert cli("du", root).exit_code == 0
    # The node roots together hold step 20 whole: every file on one of them, one manifest.
    r = cli("verify", roots[0], "--latest", "--tier", roots[1], "--json")
    assert r.exit_code == 0, r.stdout + r.stderr
    whole = r.json()["steps"][0]
    assert (whole["step"], whole["roots"], whole["copies"]) == (20, [os.path.join(x, step_dir(20)) for x in roots], 4), whole
    job = Job("replica_load", [{"local": r, "remote": s3_url, "promote_timeout_s": 10} for r in roots],
              str(tmp_path / "run2"))
    results = job.wait()
    _ok(results, job)
    assert [results[k]["step"] for k in range(4)] == [20] * 4 and all(results[k]["bitwise_equal"] for k in range(4))
    # A file of the node's own ranks lost is missing, as on any root; another node's never is.
    os.unlink(os.path.join(roots[1], step_dir(20), _shard(3)))
    r = cli("verify", os.path.join(roots[1], step_dir(20)))
    assert r.exit_code == 1 and _shard(3) in r.stdout and _shard(0) not in r.stdout, r.stdout
    # Across the nodes the step is no longer whole, and the file is named; S3's copy holds it.
    r = cli("verify", roots[0], "--latest", "--tier", roots[1])
    assert r.exit_code == 1 and f"{step_dir(20)}/{_shard(3)}: missing from every root" in r.stdout, r.stdout + r.stderr
    assert "step 10 is, the newest that is" in r.stderr, r.stderr
    r = cli("verify", roots[0], "--latest", "--tier", roots[1], "--tier", s3_url, "--json")
    assert r.exit_code == 0 and r.json()["steps"][0]["held"][_shard(3)] == [f"{s3_url}/{step_dir(20)}"], r.stdout
