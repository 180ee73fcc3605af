"""What a node-local first tier leaves behind, and the trust in "already present" (issue 23).

* A node's abandoned partial step directories go by ``ckptctl prune``'s partial rule, once the
  anchor verifies on that node (``tiers.node_retention``, ``tiers.leftovers``).
* A promotion round's leftovers on S3 (shard objects without a marker, an open multipart
  upload) are removed once a newer step is committed there; a fresh partial step the round did
  not leave, a newer one and a committed one are not (``tiers.promotion_round``).
* "Already present" on S3 means marker, manifest bytes and every listed file at its size: a
  shard missing or of another size is promoted again.

The round runs for real in this process: a one-rank gloo group, its c10d store, the upload
thread, moto over HTTP through the fault proxy. (Two "nodes" under torchrun:
``test_tiers_nodes.py``.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import boto3
import pytest
import torch.distributed as dist

from ckptctl import Checkpointer
from ckptctl.errors import StorageError
from ckptctl.format.layout import step_dir
from ckptctl.storage import open_storage
from ckptctl.tiers.channel import Channel
from ckptctl.tiers.node_retention import NodePruner, PrunePlan
from ckptctl.tiers.promotion_round import RoundLeader, RoundWorker
from helpers import cli
from s3_fault_proxy import FaultProxy
from tier_node_workers import free_port
from tier_workers import state_for

OLD = time.time() - 7 * 3600  # idle longer than prune's default --partial-after (6 h)
SHARD = "rank-00000-of-00001.safetensors"


def _save(root: str, steps: tuple[int, ...]) -> None:
    ck = Checkpointer(root)
    for step in steps:
        ck.save(step, state_for(step, 0)).wait()
    ck.close()


def _partial(root: str, step: int, *, old: bool, files: tuple[str, ...] = (SHARD,)) -> str:
    d = os.path.join(root, step_dir(step))
    os.makedirs(d)
    for name in files:
        with open(os.path.join(d, name), "wb") as f:
            f.write(b"x" * 100)
        if old:
            os.utime(os.path.join(d, name), (OLD, OLD))
    if old:
        os.utime(d, (OLD, OLD))
    return d


def test_node_retention_removes_abandoned_partials_by_prunes_rule(tmp_path) -> None:
    root = str(tmp_path / "node")
    _save(root, (5,))
    old = _partial(root, 3, old=True)  # a save that failed here 7 h ago
    fresh = _partial(root, 4, old=False)  # may still be written
    pinned = _partial(root, 2, old=True)  # rank 0 keeps it (awaiting promotion)
    other = _partial(root, 6, old=True, files=(".metadata",))  # torchtitan's, not ours
    outside = _partial(str(tmp_path), 1, old=True)  # a link's target, outside the root
    os.symlink(outside, os.path.join(root, step_dir(1)))
    pruner = NodePruner(open_storage(root), {0})

    deleted = pruner.apply(PrunePlan(step_dir(5), (), (step_dir(2),)))

    assert deleted == [step_dir(3)] and not os.path.exists(old)
    for kept in (fresh, pinned, other, os.path.join(root, step_dir(1)), os.path.join(outside, SHARD)):
        assert os.path.exists(kept), kept
    assert os.path.exists(os.path.join(root, step_dir(5), "COMMITTED"))
    assert ".ckptctl-lock" not in os.listdir(root)  # prune's lock, released

    # The anchor no longer verifies on this node: nothing at all is deleted.
    shard = os.path.join(root, step_dir(5), SHARD)
    with open(shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff\xff")
    stale = _partial(root, 7, old=True)
    assert NodePruner(open_storage(root), {0}).apply(PrunePlan(step_dir(5), ())) == []
    assert os.path.exists(stale)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _keys(client, url: str, step: int) -> list[str]:
    bucket, prefix = url[5:].split("/", 1)
    found = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{step_dir(step)}/").get("Contents", [])
    return sorted(o["Key"].rsplit("/", 1)[-1] for o in found)


def _uploads(client, url: str, step: int) -> list[str]:
    bucket, prefix = url[5:].split("/", 1)
    found = client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/{step_dir(step)}/").get("Uploads", [])
    return [u["Key"] for u in found]


def test_round_sweeps_its_leftovers_and_checks_already_present(tmp_path, s3_server: str, s3_url: str,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               one_rank_group: None) -> None:
    local = str(tmp_path / "nvme")
    _save(local, (2, 4, 5))
    proxy = FaultProxy(s3_server).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3 = boto3.client("s3", endpoint_url=s3_server)
    bucket, prefix = s3_url[5:].split("/", 1)
    remote, src = open_storage(s3_url), open_storage(local)
    channel = Channel("leftovers", 0, 1)
    worker = RoundWorker(channel, src, remote)
    leader = RoundLeader(channel, remote, liveness_s=60.0)
    try:
        assert leader.copy(src.sub(step_dir(2)), remote.sub(step_dir(2))).status == "copied"
        # Step 4's round fails (S3 refuses its shard); its writer could not abort its upload
        # either: a part of it stays, and an object of an earlier attempt.
        proxy.rule = lambda method, path: "503" if method in ("PUT", "POST") and step_dir(4) in path else None
        with pytest.raises(StorageError):
            leader.copy(src.sub(step_dir(4)), remote.sub(step_dir(4)))
        proxy.rule = lambda method, path: None
        key4 = f"{prefix}/{step_dir(4)}/{SHARD}"
        s3.put_object(Bucket=bucket, Key=key4, Body=b"x" * 100)
        up = s3.create_multipart_upload(Bucket=bucket, Key=key4)
        s3.upload_part(Bucket=bucket, Key=key4, UploadId=up["UploadId"], PartNumber=1, Body=b"y" * 100)
        # Partial steps this leader did not leave: fresh (another writer's, for all we know) and newer.
        for step in (3, 6):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{step_dir(step)}/{SHARD}", Body=b"z" * 100)

        assert leader.copy(src.sub(step_dir(5)), remote.sub(step_dir(5))).status == "copied"

        assert _keys(s3, s3_url, 4) == [] and _uploads(s3, s3_url, 4) == []
        assert _keys(s3, s3_url, 3) == [SHARD] and _keys(s3, s3_url, 6) == [SHARD]
        assert "COMMITTED" in _keys(s3, s3_url, 2)

        # Already present: the marker, the manifest bytes and every file's size are checked.
        assert leader.copy(src.sub(step_dir(5)), remote.sub(step_dir(5))).status == "already present"
        key5 = f"{prefix}/{step_dir(5)}/{SHARD}"
        s3.put_object(Bucket=bucket, Key=key5, Body=b"truncated")
        assert leader.copy(src.sub(step_dir(5)), remote.sub(step_dir(5))).status == "copied"
        s3.delete_object(Bucket=bucket, Key=key5)
        assert leader.copy(src.sub(step_dir(5)), remote.sub(step_dir(5))).status == "copied"
        r = cli("verify", f"{s3_url}/{step_dir(5)}")
        assert r.exit_code == 0, r.stdout + r.stderr
    finally:
        leader.close()
        assert worker.join(10)
        proxy.stop()


def test_a_node_plan_decides_the_steps_only_other_nodes_hold_and_frees_failed_saves(tmp_path) -> None:
    """Rank 0's node holds 5 only (its disk was replaced); another node still holds 2 and 3
    committed: ``KeepLast(1)`` deletes them there too (before, a step rank 0's node no longer
    held was kept on the others for good). Saves of steps 6 and 7 failed in this run and 8 was
    started since: 6 and 7's leftovers are named, to go without the idle time."""
    from ckptctl import KeepLast
    from ckptctl.tiers.node_retention import plan

    root = str(tmp_path / "node0")
    _save(root, (5,))
    t = time.time()
    elsewhere = [[step_dir(3), 3, t - 60, {}], [step_dir(2), 2, t - 120, {}], [step_dir(9), 9, t, {}]]
    p = plan(open_storage(root), KeepLast(1), frozenset(), "s3://x", failed=[6, 7, 8], newest_started=8,
             elsewhere=elsewhere)
    assert p is not None and p.anchor == step_dir(5)
    assert p.delete == (step_dir(2), step_dir(3))  # oldest first; 9 (newer than rank 0's anchor) left alone
    assert p.failed == (step_dir(6), step_dir(7))  # 8 may still be written
