"""The Checkpointer and the verbs on an S3 Express One Zone directory bucket (``express_url``:
moto behind a proxy that answers as a directory bucket does, see ``s3_directory_bucket``): the
same guarantees as on a general-purpose bucket, with only the requests AWS accepts there."""

from __future__ import annotations

import os
import sys

import boto3
import pytest
import torch
from botocore.exceptions import ClientError

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli, make_checkpoints
from test_s3_uploads import SAVE, HoldParts, _kill_mid_upload, _open_upload, _uploads

MiB = 1 << 20


def _state(step: int, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.arange(n // 10) * step}, "extra": {"step": step}}


def _loads_back(url: str, step: int, state: dict) -> None:
    loaded = {**state, "model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with Checkpointer(url) as ck:
        assert ck.load_latest(loaded) == step
    assert all(torch.equal(loaded["model"][k], state["model"][k]) for k in state["model"])


def test_the_emulated_directory_bucket_refuses_and_shuffles_as_aws_documents(express_url, express_proxy, s3_server):
    """The harness itself: what the tests below rely on it to refuse, it refuses, through a
    plain boto3 client that takes the bucket for a directory bucket (a session first)."""
    bucket, _, prefix = express_url[len("s3://"):].partition("/")
    client = boto3.client("s3")  # AWS_ENDPOINT_URL: the proxy
    for key in ("b", "a/1", "c", "a/2", "d"):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"x")
    _open_upload(s3_server, express_url, "pending/x", part=False)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/", Delimiter="/")
    keys = [o["Key"] for o in listed["Contents"]]
    assert sorted(keys) == [f"{prefix}/{k}" for k in "bcd"] and keys != sorted(keys)
    assert sorted(p["Prefix"] for p in listed["CommonPrefixes"]) == [f"{prefix}/a/", f"{prefix}/pending/"]
    for refused in ({"Prefix": f"{prefix}/a"}, {"Prefix": f"{prefix}/", "Delimiter": "-"},
                    {"Prefix": f"{prefix}/", "StartAfter": f"{prefix}/b"}):
        with pytest.raises(ClientError, match="InvalidRequest"):
            client.list_objects_v2(Bucket=bucket, **refused)
    with pytest.raises(ClientError, match="InvalidRequest"):
        client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/pending")
    assert express_proxy.emulation.sessions >= 1 and len(express_proxy.emulation.refused) == 4
    express_proxy.emulation.refused.clear()  # refused on purpose: the teardown looks for others


def test_checkpointer_and_verbs_on_a_directory_bucket(express_url, s3_server, tmp_path):
    # Shards past a 5 MiB threshold: multipart uploads, each first aborting its key's
    # unfinished ones (listed below the key's directory) and completed conditionally.
    small_parts = open_storage(express_url, multipart_threshold=5 * MiB, part_size=5 * MiB)
    states = {s: _state(s, 2 * MiB if s == 20 else 1000) for s in (10, 20, 30)}
    with Checkpointer(express_url, storage=small_parts) as ck:
        for s, state in states.items():
            ck.save(s, state).wait()
    assert _uploads(s3_server, express_url) == []
    _loads_back(express_url, 30, states[30])
    rows = cli("ls", express_url, "--json").json()["checkpoints"]
    assert [(r["step"], r["status"]) for r in rows] == [(10, "committed"), (20, "committed"), (30, "committed")]
    assert cli("inspect", f"{express_url}/{step_dir(20)}", "--json").json()["step"] == 20
    assert cli("verify", express_url, "--all").exit_code == 0
    assert cli("latest", express_url).stdout.strip() == f"{express_url}/{step_dir(30)}"
    assert cli("du", express_url).exit_code == 0

    restored = cli("restore", express_url, str(tmp_path / "restored"), "--step", "20")
    assert restored.exit_code == 0, restored.stderr
    assert cli("verify", restored.stdout.strip()).exit_code == 0
    up = cli("cp", restored.stdout.strip(), f"{express_url}/copies")
    assert up.exit_code == 0, up.stderr
    assert cli("verify", up.stdout.strip()).exit_code == 0
    again = cli("cp", restored.stdout.strip(), f"{express_url}/copies")
    assert again.exit_code == 0 and "left as is" in again.stderr

    pruned = cli("prune", express_url, "--keep-last", "2", "--yes")
    assert pruned.exit_code == 0, pruned.stderr
    assert [r["step"] for r in cli("ls", express_url, "--json").json()["checkpoints"]] == [20, 30]


@pytest.mark.slow  # a subprocess importing torch
def test_a_save_killed_mid_upload_on_a_directory_bucket(express_url, express_proxy, s3_server):
    with Checkpointer(express_url) as ck:
        ck.save(1, _state(1)).wait()
    # SAVE saves step 3, a 24 MiB shard in two parts; killed once the store holds the first.
    rule = HoldParts()
    express_proxy.rule = rule
    left = _kill_mid_upload([sys.executable, "-c", SAVE, express_url], (express_proxy, rule), s3_server, express_url)
    express_proxy.rule = lambda method, path: None
    assert f"/{step_dir(3)}/" in left["Key"]
    # The directory bucket lists step 3's directory, which only the dead upload holds: as on a
    # general-purpose bucket it is no checkpoint at all (not a partial one from 1970).
    rows = cli("ls", express_url, "--json").json()["checkpoints"]
    assert [(r["step"], r["status"]) for r in rows] == [(1, "committed")]
    assert cli("latest", express_url).stdout.strip() == f"{express_url}/{step_dir(1)}"
    assert open_storage(express_url).sub(step_dir(3)).stat(MARKER) is None
    _loads_back(express_url, 1, _state(1))

    # The same step saved again: its writer aborts the dead upload of its key first.
    state = {"model": {"w": torch.arange(6 * MiB, dtype=torch.float32)}}
    with Checkpointer(express_url) as ck:
        ck.save(3, state).wait()
    assert _uploads(s3_server, express_url) == []
    _loads_back(express_url, 3, state)
    assert cli("prune", express_url, "--keep-last", "1", "--yes").exit_code == 0
    assert [r["step"] for r in cli("ls", express_url, "--json").json()["checkpoints"]] == [3]


def test_prune_aborts_idle_uploads_on_a_directory_bucket(express_url, s3_server):
    with Checkpointer(express_url) as ck:
        for s in (1, 2):
            ck.save(s, _state(s, 100)).wait()
    bucket = express_url[len("s3://"):].partition("/")[0]
    dead = _open_upload(s3_server, express_url, f"{step_dir(5)}/rank-00000-of-00001.safetensors", part=False)
    assert [r["step"] for r in cli("ls", express_url, "--json").json()["checkpoints"]] == [1, 2]
    r = cli("prune", express_url, "--keep-last", "1", "--partial-after", "1h", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["plan"]["uploads"] == [f"s3://{bucket}/{dead}"]
    assert _uploads(s3_server, express_url) == []
    assert [r["step"] for r in cli("ls", express_url, "--json").json()["checkpoints"]] == [2]


def test_local_checkpoints_copied_to_a_directory_bucket_and_back(express_url, tmp_path):
    local = str(tmp_path / "local")
    make_checkpoints(local, [3, 4])
    for s in (3, 4):
        r = cli("cp", ckpt_dir(local, s), express_url)
        assert r.exit_code == 0, r.stderr
    back = cli("restore", express_url, str(tmp_path / "back"))
    assert back.exit_code == 0, back.stderr
    assert back.stdout.strip() == ckpt_dir(str(tmp_path / "back"), 4)
    for name in os.listdir(ckpt_dir(local, 4)):
        with open(os.path.join(ckpt_dir(local, 4), name), "rb") as a, open(os.path.join(back.stdout.strip(), name), "rb") as b:
            assert a.read() == b.read(), name
