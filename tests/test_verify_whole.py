"""``verify ROOT --latest --tier URL ...`` (issue 30): a step judged whole across the roots that
together hold it, as a node-local tier leaves it (each node's root: its ranks' shards, the
manifest, the marker and ``.ckptctl-node.json``).

These roots are cut from real 4-rank checkpoints (``ckptctl reshard`` of a real save), split as
a 2-node x 2-rank node-local tier splits them; the real two-node job is
``test_tiers_replicas.py::test_each_node_root_verifies_and_names_the_step_load_latest_resumes``.
On main ``--tier`` was no option of verify (exit 2), and each node's root could only be judged
as that node's part.
"""

from __future__ import annotations

import os
import shutil

import pytest

from ckptctl.format.layout import step_dir
from ckptctl.format.node_record import NODE_RECORD, NodeRecord
from helpers import cli, make_checkpoints

NODES = {"0": (0, 1), "1": (2, 3)}


def _shard(rank: int) -> str:
    return f"rank-{rank:05d}-of-00004.safetensors"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A whole root of steps 10 and 20, each four ranks' shards (built once per module)."""
    base = tmp_path_factory.mktemp("whole")
    one = str(base / "one")
    make_checkpoints(one, [10, 20], size=4000, tensors=4)
    whole = str(base / "whole")
    for step in (10, 20):
        r = cli("reshard", os.path.join(one, step_dir(step)), os.path.join(whole, step_dir(step)), "--world-size", "4")
        assert r.exit_code == 0, r.stdout + r.stderr
    return whole


def _nodes(job: str, tmp_path) -> list[str]:
    """Each node's root as a node-local tier leaves it: its ranks' shards, manifest, marker, record."""
    roots = []
    for node, ranks in NODES.items():
        root = str(tmp_path / f"node{node}")
        shutil.copytree(job, root)
        for step in (10, 20):
            for k in set(range(4)) - set(ranks):
                os.unlink(os.path.join(root, step_dir(step), _shard(k)))
        with open(os.path.join(root, NODE_RECORD), "wb") as f:
            f.write(NodeRecord(node, frozenset(ranks), 4).to_json())
        roots.append(root)
    return roots


def test_the_node_roots_together_hold_the_newest_step_whole(job: str, tmp_path) -> None:
    node0, node1 = _nodes(job, tmp_path)
    r = cli("verify", node0, "--latest", "--tier", node1)
    assert r.exit_code == 0 and r.stdout.startswith("ok  step 20 whole across 2 of 2 roots: 4 files (4 copies)"), \
        r.stdout + r.stderr
    doc = cli("verify", node0, "--latest", "--tier", node1, "--json").json()
    assert doc["ok"] and [s["step"] for s in doc["steps"]] == [20] and doc["roots"] == [node0, node1], doc
    held = doc["steps"][0]["held"]
    assert held == {_shard(k): [os.path.join(n, step_dir(20)) for n in ((node0,) if k < 2 else (node1,))]
                    for k in range(4)}, held
    assert doc["steps"][0]["checked"] == "checksums" and doc["steps"][0]["bytes_read"] > 4 * 4000 * 4
    r = cli("verify", node0, "--all", "--tier", node1, "--json")
    assert r.exit_code == 0 and [s["step"] for s in r.json()["steps"]] == [20, 10]
    # A whole copy beside them (the tier the job promotes to) is read too, every copy checked.
    r = cli("verify", node0, "--latest", "--tier", node1, "--tier", job, "--json")
    assert r.exit_code == 0 and r.json()["steps"][0]["copies"] == 8, r.stdout


def test_a_file_on_no_root_is_named_with_the_newest_whole_step(job: str, tmp_path) -> None:
    node0, node1 = _nodes(job, tmp_path)
    os.unlink(os.path.join(node1, step_dir(20), _shard(3)))
    r = cli("verify", node0, "--latest", "--tier", node1)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert r.stdout.startswith("FAILED  step 20 across 2 roots: 1 problem(s)"), r.stdout
    assert f"{_shard(3)}: missing from every root (rank 3's shard)" in r.stdout, r.stdout
    assert "step 20 is not whole across these roots; step 10 is, the newest that is" in r.stderr, r.stderr
    assert "ok  step 10 whole" in r.stdout
    # The node's own root alone says its rank's file is missing too; the other node's is fine.
    assert cli("verify", node1, "--latest").exit_code == 1 and cli("verify", node0, "--latest").exit_code == 0
    # Without the other node's root, its files are on no root given: not whole.
    r = cli("verify", node0, "--latest", "--tier", job)
    assert r.exit_code == 0, r.stdout  # the whole copy holds them


def test_a_flipped_bit_in_one_nodes_shard_fails_the_step(job: str, tmp_path) -> None:
    node0, node1 = _nodes(job, tmp_path)
    path = os.path.join(node0, step_dir(20), _shard(1))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    r = cli("verify", node0, "--latest", "--tier", node1, "--json")
    assert r.exit_code == 1, r.stdout
    step = r.json()["steps"][0]
    assert step["step"] == 20 and not step["ok"], step
    texts = [p["text"] for p in step["problems"]]
    assert texts and all(t.startswith(path) for t in texts), texts
    assert any("does not match" in t for t in texts), texts
    # A good copy elsewhere does not hide the bad one: every copy found must verify.
    assert cli("verify", node0, "--latest", "--tier", node1, "--tier", job).exit_code == 1


def test_roots_committing_different_manifests_for_a_step_are_not_one_step(job: str, tmp_path) -> None:
    node0, node1 = _nodes(job, tmp_path)
    other = str(tmp_path / "other")
    make_checkpoints(other, [20], size=4000, tensors=4)  # another save of step 20
    r = cli("verify", node0, "--latest", "--tier", other, "--tier", node1)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "the roots commit different manifests for step 20" in r.stdout and other in r.stdout, r.stdout
    assert "verify each root alone" in r.stdout


def test_tier_usage_errors(job: str, tmp_path) -> None:
    node0, node1 = _nodes(job, tmp_path)
    for args, said in ((["verify", node0, "--tier", node1], "--tier goes with --latest or --all"),
                       (["verify", node0, "--latest", "--tier", node0], "a root is named twice"),
                       (["verify", node0, "--latest", "--any", "--tier", node1], "--any does not go with --tier"),
                       (["verify", node0, "--latest", "--tier", str(tmp_path / "nope")], "no such file")):
        r = cli(*args)
        assert r.exit_code == 2 and said in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    os.makedirs(tmp_path / "e1")
    os.makedirs(tmp_path / "e2")
    r = cli("verify", str(tmp_path / "e1"), "--latest", "--tier", str(tmp_path / "e2"))
    assert r.exit_code == 1 and "no committed ckptctl checkpoint" in r.stderr, r.stderr
