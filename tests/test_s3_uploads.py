"""No orphaned multipart uploads: a writer SIGKILLed while its parts are in flight leaves its
upload open on the server (moto keeps it, as S3 does), and the next run cleans up after it.

Kills are real: a subprocess talks to moto through a proxy that lets the first part through
and holds the others unanswered, the test waits until the server holds the first part, then
sends SIGKILL. Ages are the server's: moto reports every upload as initiated in 2010 and
stamps parts with the real time, so an upload with a fresh part is "live" and one without a
part is idle for years (on S3 it would be idle since it started).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Iterator
from urllib.parse import urlsplit

import boto3
import pytest
import torch
from botocore.config import Config

from ckptctl import Checkpointer
from ckptctl.format.layout import MARKER, step_dir
from ckptctl.ops.transfer.staging import STAGING_PREFIX
from ckptctl.storage import open_storage
from ckptctl.storage.s3 import S3Storage
from ckptctl.errors import RefusedForSafety
from helpers import ckpt_dir, cli
from s3_fault_proxy import FaultProxy

MiB = 1 << 20


def _bucket_prefix(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix


def _raw(s3_server: str):
    """Straight to moto, behind the code's back; for a directory bucket too (test_s3_express),
    without the session botocore would ask of it and moto has none to give."""
    return boto3.client("s3", endpoint_url=s3_server, config=Config(s3={"disable_s3_express_session_auth": True}))


def _uploads(s3_server: str, url: str) -> list[dict]:
    bucket, prefix = _bucket_prefix(url)
    return _raw(s3_server).list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def _parts(s3_server: str, url: str, upload: dict) -> list[dict]:
    bucket, _ = _bucket_prefix(url)
    return _raw(s3_server).list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]).get("Parts", [])


class HoldParts:
    """A proxy rule: the first part upload goes through; every later one is held unanswered
    until ``release``, then dropped. Non-part requests go through."""

    def __init__(self) -> None:
        self.passed = 0
        self.held = threading.Event()
        self.release = threading.Event()

    def __call__(self, method: str, path: str) -> str | None:
        if "partNumber=" not in path:
            return None
        if self.release.is_set():
            return "drop"
        if self.passed == 0:
            self.passed += 1
            return None
        self.held.set()
        self.release.wait()  # the proxy answers nobody meanwhile: the writer's parts stay in flight
        return "drop"


@pytest.fixture
def held(s3_server: str) -> Iterator[tuple[FaultProxy, HoldParts]]:
    rule = HoldParts()
    proxy = FaultProxy(s3_server)
    proxy.rule = rule
    proxy.start()
    try:
        yield proxy, rule
    finally:
        rule.release.set()
        proxy.stop()


def _kill_mid_upload(argv: list[str], held: tuple[FaultProxy, HoldParts], s3_server: str, url: str) -> dict:
    """Run ``argv`` against the store through the holding proxy; SIGKILL it once the server
    holds one part of its upload and more are in flight. Returns the upload left open."""
    proxy, rule = held
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # Bounded waits, not timing assertions: they only keep a broken run from hanging.
        deadline = time.monotonic() + 240
        while not rule.held.is_set() or not any(_parts(s3_server, url, u) for u in _uploads(s3_server, url)):
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            assert time.monotonic() < deadline, "the writer never got a part to the server"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        rule.release.set()
    assert proc.returncode == -signal.SIGKILL
    (left,) = _uploads(s3_server, url)  # the server keeps the killed writer's upload open
    assert len(_parts(s3_server, url, left)) == 1
    return left


def test_cp_killed_mid_upload_then_run_again_leaves_no_upload(held, s3_url, s3_server, tmp_path):
    local = str(tmp_path / "local")
    with Checkpointer(local) as ck:
        ck.save(1, {"model": {"w": torch.randn(6 * MiB)}}).wait()  # 24 MiB: two parts (16 + 8 MiB)
    dst = f"{s3_url}/{step_dir(1)}"
    left = _kill_mid_upload([sys.executable, "-m", "ckptctl.cli", "cp", ckpt_dir(local, 1), dst], held, s3_server, s3_url)
    assert left["Key"].endswith(".safetensors")
    assert open_storage(dst).stat(MARKER) is None

    # Its part is seconds old: only "a key this run is about to write" makes it stale.
    r = cli("cp", ckpt_dir(local, 1), dst)
    assert r.exit_code == 0, r.stderr
    assert _uploads(s3_server, s3_url) == []
    assert cli("verify", dst).exit_code == 0


SAVE = """
import sys, torch
from ckptctl import Checkpointer
with Checkpointer(sys.argv[1]) as ck:
    ck.save(3, {"model": {"w": torch.arange(6 * (1 << 20), dtype=torch.float32)}}).wait()
"""


@pytest.mark.slow  # a subprocess importing torch; cp's kill test covers the same writer rule
def test_save_killed_mid_upload_then_saved_again_leaves_no_upload(held, s3_url, s3_server):
    _kill_mid_upload([sys.executable, "-c", SAVE, s3_url], held, s3_server, s3_url)  # 24 MiB: two parts
    state = {"model": {"w": torch.arange(6 * MiB, dtype=torch.float32)}}
    with Checkpointer(s3_url) as ck:
        ck.save(3, state).wait()
    assert _uploads(s3_server, s3_url) == []
    loaded = {"model": {"w": torch.zeros(6 * MiB)}}
    with Checkpointer(s3_url) as ck:
        assert ck.load_latest(loaded) == 3
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])


# --- uploads idle for longer than the bound: prune and sync ---------------------------------


def _open_upload(s3_server: str, url: str, key: str, *, part: bool) -> str:
    """An upload left open at ``url/key``; with a part uploaded now (live), or none (on moto:
    idle since 2010)."""
    bucket, prefix = _bucket_prefix(url)
    raw = _raw(s3_server)
    full = f"{prefix}/{key}"
    upload_id = raw.create_multipart_upload(Bucket=bucket, Key=full)["UploadId"]
    if part:
        raw.upload_part(Bucket=bucket, Key=full, UploadId=upload_id, PartNumber=1, Body=b"x" * 1024)
    return full


def test_prune_aborts_idle_uploads_inside_checkpoints_only(s3_url, s3_server):
    with Checkpointer(s3_url) as ck:
        for s in (1, 2):
            ck.save(s, {"model": {"w": torch.arange(100.0) * s}}).wait()
    dead = _open_upload(s3_server, s3_url, f"{step_dir(5)}/rank-00000-of-00001.safetensors", part=False)
    dead_staging = _open_upload(s3_server, s3_url, f"{STAGING_PREFIX}{step_dir(4)}/rank-00000-of-00002.safetensors", part=False)
    live = _open_upload(s3_server, s3_url, f"{step_dir(6)}/rank-00000-of-00001.safetensors", part=True)
    foreign = _open_upload(s3_server, s3_url, "logs/events.bin", part=False)  # not in a checkpoint: not ours

    dry = cli("prune", s3_url, "--keep-last", "1", "--partial-after", "1h", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    plan = dry.json()["plan"]
    bucket, _ = _bucket_prefix(s3_url)
    assert sorted(plan["uploads"]) == sorted(f"s3://{bucket}/{k}" for k in (dead, dead_staging))
    assert any("would abort 2 unfinished multipart upload" in n for n in plan["notes"])
    assert len(_uploads(s3_server, s3_url)) == 4  # a dry run aborts nothing

    r = cli("prune", s3_url, "--keep-last", "1", "--partial-after", "1h", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert sorted(doc["plan"]["uploads"]) == sorted(f"s3://{bucket}/{k}" for k in (dead, dead_staging))
    assert any("aborted 2 unfinished multipart upload" in n for n in doc["outcome"]["notes"])
    assert sorted(u["Key"] for u in _uploads(s3_server, s3_url)) == sorted([live, foreign])

    human = cli("prune", s3_url, "--keep-last", "1", "--partial-after", "0s", "--dry-run")
    assert "would abort 1 unfinished multipart upload" in human.stdout + human.stderr  # the live one, at 0s


def test_sync_aborts_idle_uploads_under_dst(s3_url, s3_server, tmp_path):
    src = str(tmp_path / "src")
    with Checkpointer(src) as ck:
        ck.save(1, {"model": {"w": torch.arange(100.0)}}).wait()
    dead = _open_upload(s3_server, s3_url, f"{step_dir(9)}/rank-00000-of-00001.safetensors", part=False)
    live = _open_upload(s3_server, s3_url, f"{step_dir(8)}/rank-00000-of-00001.safetensors", part=True)
    r = cli("sync", src, s3_url, "--json")
    assert r.exit_code == 0, r.stderr
    assert any("aborted 1 unfinished multipart upload" in n and dead.rsplit("/", 2)[-2] in n for n in r.json()["notes"])
    assert [u["Key"] for u in _uploads(s3_server, s3_url)] == [live]


# --- a policy that may not list uploads ------------------------------------------------------

_ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                  b"<Message>Access Denied</Message><RequestId>proxy</RequestId></Error>")


class DenyUploadListing(FaultProxy):
    """Answers ListMultipartUploads with 403 AccessDenied, as S3 does for an IAM policy
    without s3:ListBucketMultipartUploads; everything else goes through."""

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        names = {q.split("=", 1)[0] for q in urlsplit(h.path).query.split("&")}
        if h.command != "GET" or "uploads" not in names:
            super()._serve(h)
            return
        h.send_response(403, "Forbidden")
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(_ACCESS_DENIED)))
        h.end_headers()
        h.wfile.write(_ACCESS_DENIED)


def test_a_policy_without_upload_listing_still_writes_and_prunes(s3_url, s3_server, monkeypatch):
    proxy = DenyUploadListing(s3_server).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        small_parts = S3Storage(s3_url, multipart_threshold=5 * MiB, part_size=5 * MiB)
        with Checkpointer(s3_url, storage=small_parts) as ck:  # multipart shards: the writer cannot look first
            for s in (1, 2):
                ck.save(s, {"model": {"w": torch.arange(3 * MiB, dtype=torch.float32) * s}}).wait()
        r = cli("prune", s3_url, "--keep-last", "1", "--yes", "--json")
        assert r.exit_code == 0, r.stderr
        doc = r.json()
        assert doc["outcome"]["deleted"] == [step_dir(1)]
        assert doc["plan"]["uploads"] == []
        assert any("not cleaned up" in n and "ListBucketMultipartUploads" in n for n in doc["plan"]["notes"])
    finally:
        proxy.stop()


# --- two live writers of one object ----------------------------------------------------------

_NO_SUCH_UPLOAD = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code>'
                   b"<Message>The specified upload does not exist.</Message><RequestId>proxy</RequestId></Error>")


class S3UploadAnswers(FaultProxy):
    """Answers a request for an upload that no longer exists as S3 does (404 NoSuchUpload);
    moto 5.2.5 answers 500 there, which botocore would retry as a server fault."""

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        query = dict(q.partition("=")[::2] for q in urlsplit(h.path).query.split("&"))
        upload_id = query.get("uploadId")
        if upload_id:
            bucket = urlsplit(h.path).path.lstrip("/").split("/", 1)[0]
            raw = boto3.client("s3", endpoint_url=f"http://{self.upstream[0]}:{self.upstream[1]}")
            open_ids = {u["UploadId"] for u in raw.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
            if upload_id not in open_ids:
                h.rfile.read(int(h.headers.get("Content-Length") or 0))
                h.send_response(404, "Not Found")
                h.send_header("Content-Type", "application/xml")
                h.send_header("Content-Length", str(len(_NO_SUCH_UPLOAD)))
                h.end_headers()
                h.wfile.write(_NO_SUCH_UPLOAD)
                return
        super()._serve(h)


def test_an_earlier_writer_of_the_same_object_loses_cleanly(s3_url, s3_server, monkeypatch):
    """Two live writers of one key: the later one supersedes the earlier one's upload, and the
    earlier one's commit is refused with a message saying why, never a retried server fault."""
    proxy = S3UploadAnswers(s3_server).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        store = S3Storage(s3_url, multipart_threshold=0, part_size=5 * MiB)
        first = store.open_writer("step/shard")
        first.write(bytes(5 * MiB))  # exactly one part, uploading; nothing left to send at commit
        deadline = time.monotonic() + 120  # a bound against hanging, not a timing assertion
        while not any(_parts(s3_server, s3_url, u) for u in _uploads(s3_server, s3_url)):
            assert time.monotonic() < deadline, "the first writer's part never reached the server"
            time.sleep(0.02)
        with store.open_writer("step/shard") as second:
            second.write(b"\x01" * (5 * MiB))
        with pytest.raises(RefusedForSafety, match="aborted by another process") as info:
            first.commit()
        assert "step/shard" in str(info.value)
        assert store.read("step/shard") == b"\x01" * (5 * MiB)
        assert _uploads(s3_server, s3_url) == []
    finally:
        proxy.stop()
