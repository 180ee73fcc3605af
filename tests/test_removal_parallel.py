"""A checkpoint's files are deleted several at once once its commit files are gone
(``layouts.removal``): on object storage each file is a stat and a delete, round trips that one
after another made a 512-rank checkpoint's removal take a minute. The order that matters is
kept (the commit files first, one at a time: a removal cut short reads as partial, never as
committed), and so is the promise that a file changed since the plan is never deleted."""

from __future__ import annotations

import os

import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MANIFEST, MARKER, step_dir
from ckptctl.layouts.catalog import list_checkpoints
from ckptctl.layouts.removal import entry_snapshot, remove_entry
from ckptctl.storage import open_storage
from helpers import cli
from s3_in_flight import in_flight

RANKS = 16


def _sharded(tmp_path, steps=(1,)) -> str:
    """Checkpoints of ``RANKS`` shard files each, under a local root."""
    with Checkpointer(str(tmp_path / "one")) as ck:
        for s in steps:
            ck.save(s, {"w": torch.randn(RANKS * 4, 64)}).wait()
    for s in steps:
        r = cli("reshard", str(tmp_path / "one" / step_dir(s)), str(tmp_path / "root" / step_dir(s)), "--world-size", str(RANKS))
        assert r.exit_code == 0, r.stderr
    return str(tmp_path / "root")


def test_a_file_changed_since_the_plan_stays_and_is_named_when_the_rest_go_at_once(tmp_path):
    root = open_storage(_sharded(tmp_path))
    name = step_dir(1)
    (entry,) = [e for e in list_checkpoints(root) if e.name == name]
    snapshot = entry_snapshot(root, name)
    changed = os.path.join(root.local_path(name), "rank-00011-of-00016.safetensors")
    with open(changed, "ab") as f:
        f.write(b"x")  # rewritten under the plan: its size is not the planned one
    got = remove_entry(root, name, snapshot, entry.owner.removal_order, entry.owner.commit_files)
    assert got is not None and got.endswith("rank-00011-of-00016.safetensors"), got
    left = set(os.listdir(root.local_path(name)))
    assert "rank-00011-of-00016.safetensors" in left  # never deleted
    assert MARKER not in left and MANIFEST not in left  # the commit files went first
    assert [c["status"] for c in cli("ls", str(tmp_path / "root"), "--json").json()["checkpoints"]] == ["partial"]


def test_prune_on_s3_deletes_the_marker_then_the_manifest_then_the_shards_several_at_once(tmp_path, s3_url):
    local = _sharded(tmp_path, steps=(1, 2))
    for s in (1, 2):
        assert cli("cp", os.path.join(local, step_dir(s)), f"{s3_url}/{step_dir(s)}").exit_code == 0
    client = open_storage(s3_url)._client.s3  # type: ignore[attr-defined]
    with in_flight(client, "DeleteObject") as deletes:
        r = cli("prune", s3_url, "--keep-last", "1", "--yes")
    order = [p["Key"].rsplit("/", 1)[-1] for p in deletes.sent]
    assert r.exit_code == 0, r.stderr
    shards = sorted(k for k in order if k.startswith("rank-"))
    assert order[:2] == [MARKER, MANIFEST] and len(shards) == RANKS, order
    assert deletes.most >= 4, deletes.most  # before: one at a time
    assert [c["name"] for c in cli("ls", s3_url, "--json").json()["checkpoints"]] == [step_dir(2)]


def test_a_delete_failing_for_good_stops_the_removal_with_exit_3_and_a_rerun_finishes_it(tmp_path, s3_server, s3_url, monkeypatch):
    """A storage error among the deletes that go at once is raised (exit 3), not swallowed, the
    file it hit stays, the checkpoint reads as partial (its commit files went first), and the
    next prune removes the rest."""
    from s3_fault_proxy import FaultProxy

    local = _sharded(tmp_path, steps=(1, 2))
    for s in (1, 2):
        assert cli("cp", os.path.join(local, step_dir(s)), f"{s3_url}/{step_dir(s)}").exit_code == 0
    victim = f"{step_dir(1)}/rank-00005-of-00016.safetensors"
    proxy = FaultProxy(s3_server)
    proxy.rule = lambda method, path: "500" if method == "DELETE" and path.split("?")[0].endswith(victim) else None
    proxy.start()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        r = cli("prune", s3_url, "--keep-last", "1", "--yes")
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    assert r.exit_code == 3, r.stdout + r.stderr
    assert proxy.injected
    left = {i.key for i in open_storage(f"{s3_url}/{step_dir(1)}").list()}
    assert "rank-00005-of-00016.safetensors" in left and MARKER not in left and MANIFEST not in left, left
    assert [c["status"] for c in cli("ls", s3_url, "--json").json()["checkpoints"]] == ["partial", "committed"]
    again = cli("prune", s3_url, "--keep-last", "1", "--yes", "--partial-after", "0s")
    assert again.exit_code == 0, again.stdout + again.stderr
    assert [c["name"] for c in cli("ls", s3_url, "--json").json()["checkpoints"]] == [step_dir(2)]
