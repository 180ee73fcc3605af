"""A node-local tier with no later tier resumes on any number of nodes (``tiers.node_fetch``).

Each node's disk holds only its own ranks' shards, and a rank's load also reads rank 0's shard
and the shards of the tensors one other rank wrote whole: here (``own_mb``) a module of four
parameters every rank holds alike, as under DDP, each written by one of ranks 0 to 3. Before, a relaunch on three nodes (or two without replicas) found no step
every rank could read: ``load_latest`` returned None on every rank. Now each node fetches what
its ranks read from a node that holds it, checked against the manifest, into its copies of
other nodes' files (``<root>/.ckptctl-replicas/<step>/``), which node-local retention removes
with the step; a copy that does not check out is never loaded, and every rank falls back
alike. 3 torchrun "nodes" x 2 ranks on one host (``tier_node_workers.py``), real gloo.

With a later tier (a directory root here), the same fetch serves a step the later tier does not
hold committed (its promotion never finished): before, such a step was skipped on every rank and
the job resumed the one before it. A step the later tier holds committed is read from there, as
before: nothing is fetched for it.
"""

from __future__ import annotations

import os
import shutil

from ckptctl.format.layout import step_dir
from helpers import cli
from tier_node_workers import Job

COPIES = ".ckptctl-replicas"


def _shard(rank: int, world: int = 6) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def _ok(results: dict[int, dict], job: Job, world: int = 6) -> None:
    for r in range(world):
        res = results[r]
        assert "error" not in res and "missing" not in res, f"rank {r}: {res}\n{job.logs()}"


def _run(tmp_path, name: str, scenario: str, roots: list[str], **args: object) -> dict[int, dict]:
    job = Job(scenario, [{"local": r, "remote": None, "promote_timeout_s": 3, "own_mb": 0.01, **args} for r in roots],
              str(tmp_path / name))
    results = job.wait()
    _ok(results, job, 2 * len(roots))
    return results


def _files(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def test_three_nodes_without_replicas_or_a_later_tier_resume_the_newest_step(tmp_path) -> None:
    """Steps 10 and 20 saved on 3 nodes (KeepLast(2)); a relaunch resumes 20 on every rank,
    bitwise (before: None). Nodes 1 and 2 fetched the other nodes' shards into their copies, not
    their step directories, so ``verify`` of a node's step still judges its own ranks' files.
    A second relaunch resumes 30 and saves 40 and 50: retention removes 20's and 30's fetched
    files with their steps."""
    roots = [str(tmp_path / f"node{k}") for k in range(3)]
    _run(tmp_path, "run1", "replica_save", roots, replicas=0, steps=[10, 20])
    results = _run(tmp_path, "run2", "replica_load", roots, replicas=0, then_save=[30])
    for k in range(6):
        assert (results[k]["step"], results[k]["bitwise_equal"]) == (20, True), (k, results[k])
    for node, root in enumerate(roots):
        own = [_shard(2 * node), _shard(2 * node + 1)]
        assert [f for f in _files(os.path.join(root, step_dir(20))) if f.endswith(".safetensors")] == own
        fetched = _files(os.path.join(root, COPIES, step_dir(20)))
        # Ranks 0 to 3 wrote one parameter each: every node fetched those of them it lacks.
        assert fetched == [_shard(k) for k in range(4) if k // 2 != node], (node, fetched)
        r = cli("verify", os.path.join(root, step_dir(20)), "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "holds 2 of the 6 files" in r.json()["checkpoints"][0]["note"], r.stdout
    results = _run(tmp_path, "run3", "replica_load", roots, replicas=0, then_save=[40, 50])
    assert all(results[k]["step"] == 30 and results[k]["bitwise_equal"] for k in range(6)), results
    for root in roots:
        assert _files(os.path.join(root, COPIES)) == [], root  # removed with steps 20 and 30


def test_three_nodes_with_replicas_and_no_later_tier_resume_the_newest_step(tmp_path) -> None:
    """Replicas cover two nodes; on three, node 2 holds neither rank 0's shard nor its replica
    (before: None on every rank after a relaunch). No warning is logged: losing one node is
    survived (its replicas), and the nodes together hold every file."""
    roots = [str(tmp_path / f"node{k}") for k in range(3)]
    _run(tmp_path, "run1", "replica_save", roots, steps=[10, 20])
    results = _run(tmp_path, "run2", "replica_load", roots)
    for k in range(6):
        assert (results[k]["step"], results[k]["bitwise_equal"]) == (20, True), (k, results[k])
    said = open(os.path.join(tmp_path, "run1", "node0.log")).read()
    assert "load_latest cannot resume" not in said and "no later tier" not in said, said[-3000:]
    # Node 2 fetched ranks 0 to 3's shards but 2 and 3's, its replica of node 1; node 1 holds
    # node 0's as its replica.
    assert _files(os.path.join(roots[2], COPIES, step_dir(20))) == sorted(
        [_shard(0), _shard(1), _shard(2), _shard(3), "rank-00002.replica", "rank-00003.replica"])
    assert [f for f in _files(os.path.join(roots[1], COPIES, step_dir(20))) if f.endswith(".safetensors")] == \
        [_shard(0), _shard(1)]


def test_a_bad_copy_on_the_holding_node_is_never_loaded_and_every_rank_falls_back(tmp_path) -> None:
    """2 nodes, no replicas, no later tier; steps 10, 20, 30. Node 0 (the only holder) has a
    bit flipped in rank 0's shard of 20 and lost rank 1's shard of 30. Step 30: no node holds
    the file, nothing is sent, every rank skips it; step 20: node 1's fetched copy does not
    check out and is deleted, node 0's ranks find their own copy bad; every rank resumes 10,
    bitwise (before: None)."""
    roots = [str(tmp_path / f"node{k}") for k in range(2)]
    _run(tmp_path, "run1", "replica_save", roots, replicas=0, keep_local=3, steps=[10, 20, 30])
    flipped = os.path.join(roots[0], step_dir(20), _shard(0, 4))
    with open(flipped, "r+b") as f:
        f.seek(os.path.getsize(flipped) - 100)  # in the data of the last tensor rank 0 wrote
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    os.unlink(os.path.join(roots[0], step_dir(30), _shard(1, 4)))
    results = _run(tmp_path, "run2", "replica_load", roots, replicas=0)
    for k in range(4):
        assert (results[k]["step"], results[k]["bitwise_equal"]) == (10, True), (k, results[k])
    assert _shard(0, 4) not in _files(os.path.join(roots[1], COPIES, step_dir(20)))
    log1 = open(os.path.join(tmp_path, "run2", "node1.log")).read()
    assert "does not check out" in log1, log1[-3000:]


def _committed_at(root: str) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in _files(root) if os.path.exists(os.path.join(root, n, "COMMITTED")))


def test_a_step_not_yet_promoted_is_fetched_and_a_promoted_one_read_from_the_later_tier(tmp_path) -> None:
    """3 nodes, no replicas, a later tier (a directory root). Steps 10, 20, 30 saved, each
    promoted; then step 30's promotion is undone half way (its marker and rank 0's shard gone
    from the later tier: the job died inside the promotion window). A relaunch resumes 30 on
    every rank, bitwise, the nodes fetching what they lack from each other (before: 20, the
    newest step the later tier held, on every rank). Its step 40 is promoted at close; the next
    relaunch resumes 40 reading what a node lacks from the later tier: no node fetched a copy
    of it, and retention removed 30's fetched copies with the step."""
    roots = [str(tmp_path / f"node{k}") for k in range(3)]
    later = str(tmp_path / "later")
    tiers = {"replicas": 0, "remote": later, "every": 10, "keep_remote": 3}
    _run(tmp_path, "run1", "replica_save", roots, **tiers, steps=[10, 20, 30], promote_each=True)
    assert _committed_at(later) == [10, 20, 30]
    for f in ("COMMITTED", _shard(0)):
        os.unlink(os.path.join(later, step_dir(30), f))
    results = _run(tmp_path, "run2", "replica_load", roots, **tiers, then_save=[40])
    for k in range(6):
        assert (results[k]["step"], results[k]["bitwise_equal"]) == (30, True), (k, results[k])
    for node, root in enumerate(roots):
        fetched = _files(os.path.join(root, COPIES, step_dir(30)))
        assert fetched == [_shard(k) for k in range(4) if k // 2 != node], (node, fetched)
        own = [f for f in _files(os.path.join(root, step_dir(30))) if f.endswith(".safetensors")]
        assert own == [_shard(2 * node), _shard(2 * node + 1)], (node, own)  # nothing fetched into the step
    assert 40 in _committed_at(later)
    results = _run(tmp_path, "run3", "replica_load", roots, **tiers, then_save=[50])
    for k in range(6):
        assert (results[k]["step"], results[k]["bitwise_equal"]) == (40, True), (k, results[k])
    for root in roots:
        assert _files(os.path.join(root, COPIES)) == [], root  # none of 40; 30's went with it


def test_with_replicas_a_step_not_yet_promoted_is_fetched_after_recovery(tmp_path) -> None:
    """3 nodes with peer replicas and a later tier: node 2 holds neither rank 0's shard nor its
    replica. Steps 10 and 20 promoted, then 20 removed from the later tier: every rank resumes
    20, bitwise (before: 10), node 2 fetching ranks 0 and 1's shards beside its replica of
    node 1's."""
    roots = [str(tmp_path / f"node{k}") for k in range(3)]
    later = str(tmp_path / "later")
    tiers = {"remote": later, "every": 10}
    _run(tmp_path, "run1", "replica_save", roots, **tiers, steps=[10, 20], promote_each=True)
    assert _committed_at(later) == [10, 20]
    shutil.rmtree(os.path.join(later, step_dir(20)))
    results = _run(tmp_path, "run2", "replica_load", roots, **tiers)
    for k in range(6):
        assert (results[k]["step"], results[k]["bitwise_equal"]) == (20, True), (k, results[k])
    assert _files(os.path.join(roots[2], COPIES, step_dir(20))) == sorted(
        [_shard(0), _shard(1), _shard(2), _shard(3), "rank-00002.replica", "rank-00003.replica"])


def test_a_bad_holder_copy_of_a_step_not_yet_promoted_falls_back_to_the_promoted_one(tmp_path) -> None:
    """2 nodes, no replicas, a later tier. Steps 10 and 20 saved and promoted; 20 then removed
    from the later tier, and a bit flipped in node 0's copy of rank 0's shard of it (the only
    holder). Node 1's fetched copy does not check out and is deleted, node 0's ranks find theirs
    bad: every rank resumes 10, bitwise, read from the nodes and the later tier (promoted:
    nothing fetched for it). Before: 10 as well, but no node ever fetched 20."""
    roots = [str(tmp_path / f"node{k}") for k in range(2)]
    later = str(tmp_path / "later")
    tiers = {"replicas": 0, "remote": later, "every": 10}
    _run(tmp_path, "run1", "replica_save", roots, **tiers, steps=[10, 20], promote_each=True)
    assert _committed_at(later) == [10, 20]
    shutil.rmtree(os.path.join(later, step_dir(20)))
    flipped = os.path.join(roots[0], step_dir(20), _shard(0, 4))
    with open(flipped, "r+b") as f:
        f.seek(os.path.getsize(flipped) - 100)  # in the data of the last tensor rank 0 wrote
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    results = _run(tmp_path, "run2", "replica_load", roots, **tiers)
    for k in range(4):
        assert (results[k]["step"], results[k]["bitwise_equal"]) == (10, True), (k, results[k])
    log1 = open(os.path.join(tmp_path, "run2", "node1.log")).read()
    assert "does not check out" in log1, log1[-3000:]
    assert _shard(0, 4) not in _files(os.path.join(roots[1], COPIES, step_dir(20)))
    for root in roots:
        assert _files(os.path.join(root, COPIES, step_dir(10))) == [], root


def test_what_a_rank_reads_comes_from_the_placement_hints() -> None:
    """Its own file and rank 0's, each whole tensor's owner's, its own block of a split one;
    every file once a tensor has no hint (any file may hold part of it)."""
    from ckptctl.format.manifest import FileEntry, Manifest, TensorEntry
    from ckptctl.tiers.node_fetch import files_read

    files = [FileEntry(_shard(k, 4), 1, "", k, 1) for k in range(4)]
    tensors = {"fsdp": TensorEntry("float32", (8, 2), "model", 4, split=(0, 2)),
               "ddp": TensorEntry("float32", (4,), "model", 1, owner=2)}
    m = Manifest(step=1, created=0.0, world_size=4, files=files, tensors=tensors)
    assert files_read(m, 3) == {_shard(3, 4), _shard(0, 4), _shard(2, 4)}
    assert files_read(m, 1) == {_shard(1, 4), _shard(0, 4), _shard(2, 4)}
    m.tensors["odd"] = TensorEntry("float32", (3,), "model", 2)
    assert files_read(m, 1) == {f.name for f in files}
