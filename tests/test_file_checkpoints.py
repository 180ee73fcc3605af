"""Checkpoints that are one file (Lightning's ``*.ckpt``) copied by ``cp`` between a filesystem
and S3 (moto over HTTP): whole through one atomic writer, checked at the destination, never
replacing a different file, "already present" for the same bytes; the hint of ``restore``
(which copies directories) names the ``ckptctl cp`` that does it, and that command works."""

from __future__ import annotations

import os

import boto3
import pytest

from helpers import cli
from test_s3_layouts import _flip_in_zip_record

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[frameworks]')")

NAME = "epoch=0-step=20.ckpt"


def _root(tmp_path) -> str:
    from test_protection import _lightning_file

    root = str(tmp_path / "ckpts")
    os.makedirs(root)
    for step in (10, 20):
        _lightning_file(root, step)
    return root


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_lightning_file_goes_to_s3_and_back_through_cp(tmp_path, s3_url):
    root = _root(tmp_path)
    up = cli("cp", os.path.join(root, NAME), s3_url, "--json")
    assert up.exit_code == 0, up.stdout + up.stderr
    assert up.json()["status"] == "copied" and up.json()["layout"] == "lightning"
    assert cli("verify", f"{s3_url}/{NAME}").exit_code == 0
    again = cli("cp", os.path.join(root, NAME), s3_url, "--json")
    assert again.exit_code == 0 and again.json()["status"] == "already present", again.stdout + again.stderr

    # What restore's hint says, on the bucket: the newest good file, copied down.
    latest = cli("latest", s3_url, "--format", "lightning")
    assert latest.exit_code == 0 and latest.stdout.strip() == f"{s3_url}/{NAME}", latest.stdout + latest.stderr
    back = str(tmp_path / "back")
    down = cli("cp", latest.stdout.strip(), back)
    assert down.exit_code == 0, down.stdout + down.stderr
    assert _read(os.path.join(back, NAME)) == _read(os.path.join(root, NAME))
    restore = cli("restore", s3_url, str(tmp_path / "other"))
    assert restore.exit_code == 2 and "ckptctl cp" in restore.stderr, restore.stderr


def test_a_damaged_file_is_not_copied_and_a_different_file_is_never_replaced(tmp_path, s3_url):
    root = _root(tmp_path)
    assert cli("cp", os.path.join(root, NAME), s3_url).exit_code == 0
    bucket, prefix = s3_url[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3")
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{NAME}")["Body"].read()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{NAME}", Body=_flip_in_zip_record(body))  # only its CRC-32 tells
    dst = str(tmp_path / "dst")
    r = cli("cp", f"{s3_url}/{NAME}", dst)
    assert r.exit_code == 1 and NAME in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(dst, NAME))  # nothing of it lands
    # A different file under the same name at the destination stays as it was.
    os.makedirs(dst, exist_ok=True)
    other = os.path.join(dst, NAME)
    with open(other, "wb") as f:
        f.write(b"not this checkpoint")
    r = cli("cp", os.path.join(root, NAME), dst)
    assert r.exit_code != 0 and "already holds another file" in r.stderr, r.stderr
    assert _read(other) == b"not this checkpoint"


def test_sync_mirrors_lightning_files_and_a_rerun_copies_nothing(tmp_path, s3_url):
    root = _root(tmp_path)
    first = cli("sync", root, s3_url, "--json")
    assert first.exit_code == 0, first.stdout + first.stderr
    assert sorted(i["action"] for i in first.json()["checkpoints"]) == ["copied", "copied"]
    second = cli("sync", root, s3_url, "--json")
    assert second.exit_code == 0 and {i["action"] for i in second.json()["checkpoints"]} == {"present"}
    listed = cli("ls", s3_url, "--json").json()
    assert [(c["step"], c["status"]) for c in listed["checkpoints"]] == [(10, "committed"), (20, "committed")]
