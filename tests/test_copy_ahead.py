"""A copy writes its manifest before its data (``Layout.copy_ahead``), so that only the marker
follows the data: what that leaves when the copy is killed, fails or finds its source damaged.

A manifest without its marker commits nothing: ``verify`` calls the step partial, ``latest``
skips it, ``prune`` removes it by its partial rule, and the same ``cp`` run again completes it
(the manifest found holding its bytes is used as it is). A copy that fails before its commit
(a flipped byte in the source, a request failing for good) deletes the manifest it wrote.

Real ``ckptctl cp`` processes, SIGKILLed while ``tests/s3_fault_proxy.py`` holds their first
data request; moto's server over HTTP; real files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Callable

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.format.layout import MANIFEST, MARKER, step_dir
from ckptctl.storage import open_storage
from helpers import cli
from s3_fault_proxy import FaultProxy

MiB = 1 << 20


def _save(root: str, step: int, fill: float) -> str:
    """A committed checkpoint whose shard is over cp's 16 MiB multipart threshold (two parts)."""
    with Checkpointer(root) as ck:
        return ck.save(step, {"model": {"w": torch.full((4 * MiB + 1024,), fill)}}).wait()


def _killed_while_held(src: str, dst: str, upstream: str, holds: Callable[[str, str], bool]) -> None:
    """``ckptctl cp SRC DST`` in a process of its own, SIGKILLed once its proxy holds the first
    request ``holds`` accepts (the copy's first look, manifest included, is over by then)."""
    proxy, reached = FaultProxy(upstream), threading.Event()

    def hold(method: str, path: str) -> str | None:
        if proxy.release.is_set() or not holds(method, path):
            return None
        reached.set()
        return "hold"

    proxy.rule = hold
    proxy.start()
    try:
        p = subprocess.Popen([sys.executable, "-m", "ckptctl.cli", "cp", src, dst], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "AWS_ENDPOINT_URL": proxy.url})
        try:
            assert reached.wait(240), p.communicate(timeout=60)  # a bound against hanging, not a timing assertion
            manifest_there = open_storage(dst).stat(MANIFEST) is not None
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    finally:
        proxy.release.set()
        proxy.stop()
    assert manifest_there, "the manifest was not written before the data"  # on main: after it


def _partial_meanwhile(root: str, name: str, committed: str) -> None:
    """The killed copy's step reads as partial to ls, verify and latest."""
    v = cli("verify", f"{root}/{name}")
    assert v.exit_code == 1 and f"no {MARKER} marker" in v.stdout, v.stdout + v.stderr
    listed = cli("ls", root, "--json")
    assert listed.exit_code == 0, listed.stdout + listed.stderr
    assert {c["name"]: c["status"] for c in json.loads(listed.stdout)["checkpoints"]}[name] == "partial"
    latest = cli("latest", root, "--any")
    assert latest.exit_code == 0 and latest.stdout.strip().endswith(committed), latest.stdout + latest.stderr


def _data_put(method: str, path: str) -> bool:
    return method == "PUT" and ".safetensors" in path.split("?")[0]


def test_cp_to_s3_killed_mid_data_is_partial_then_completed_by_a_rerun(s3_server, s3_url, tmp_path):
    src_root = str(tmp_path / "src")
    first, second = _save(src_root, 1, 1.0), _save(src_root, 2, 2.0)
    assert cli("cp", first, f"{s3_url}/{step_dir(1)}").exit_code == 0
    dst = f"{s3_url}/{step_dir(2)}"
    _killed_while_held(second, dst, s3_server, _data_put)
    _partial_meanwhile(s3_url, step_dir(2), step_dir(1))
    again = cli("cp", second, dst)
    assert again.exit_code == 0, again.stdout + again.stderr
    assert cli("verify", dst).exit_code == 0
    assert cli("latest", s3_url, "--any").stdout.strip().endswith(step_dir(2))


def test_cp_to_a_local_root_killed_mid_data_is_pruned_as_partial_and_completed_by_a_rerun(s3_server, s3_url, tmp_path):
    # The source on S3, held at its shard's first read: the copy's manifest is on the local
    # disk then, its data not yet.
    local = str(tmp_path / "local")
    _save(str(tmp_path / "src"), 1, 1.0)
    _save(str(tmp_path / "src"), 2, 2.0)
    assert cli("sync", str(tmp_path / "src"), s3_url).exit_code == 0
    assert cli("cp", f"{s3_url}/{step_dir(1)}", f"{local}/{step_dir(1)}").exit_code == 0
    src, dst = f"{s3_url}/{step_dir(2)}", f"{local}/{step_dir(2)}"

    def data_read(method: str, path: str) -> bool:
        return method == "GET" and path.split("?")[0].endswith(".safetensors")

    _killed_while_held(src, dst, s3_server, data_read)
    _partial_meanwhile(local, step_dir(2), step_dir(1))
    pruned = cli("prune", local, "--keep-last", "1", "--partial-after", "0s", "--yes")
    assert pruned.exit_code == 0, pruned.stdout + pruned.stderr
    assert not os.path.exists(dst) and os.path.exists(f"{local}/{step_dir(1)}")

    _killed_while_held(src, dst, s3_server, data_read)  # and this time resumed, not pruned
    again = cli("cp", src, dst)
    assert again.exit_code == 0, again.stdout + again.stderr
    assert cli("verify", dst).exit_code == 0
    assert sorted(os.listdir(dst)) == sorted(os.listdir(str(tmp_path / "src" / step_dir(2))))


def _flip_a_data_byte(ckpt: str) -> None:
    shard = next(os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 100)  # the tensor's bytes, past the header the copy checks first
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_cp_of_a_source_with_a_flipped_byte_leaves_no_manifest(where, s3_url, tmp_path):
    # The flip is found mid-copy, after the manifest was written: the copy fails (exit 1),
    # takes back what it published, the early manifest first, and nothing is committed.
    src = _save(str(tmp_path / "src"), 1, 1.0)
    _flip_a_data_byte(src)
    dst = f"{s3_url}/{step_dir(1)}" if where == "s3" else str(tmp_path / "dst" / step_dir(1))
    puts: list[str] = []
    client = open_storage(s3_url)._client.s3  # type: ignore[attr-defined]

    def put(params: dict, **_kw: object) -> None:
        puts.append(params.get("Key", "").rsplit("/", 1)[-1])

    client.meta.events.register("provide-client-params.s3.PutObject", put)
    try:
        r = cli("cp", src, dst)
    finally:
        client.meta.events.unregister("provide-client-params.s3.PutObject", put)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    if where == "s3":
        assert MANIFEST in puts, puts  # written ahead (on main: never, the copy failed before its commit)
        assert [i.key for i in open_storage(dst).list()] == []
    else:  # an empty directory may stay (as on main)
        assert not os.path.exists(dst) or os.listdir(dst) == []
    assert cli("verify", dst).exit_code != 0


def _names_listing(method: str, path: str) -> bool:  # the first look's listing of the step, not the marker's look
    return method == "GET" and "list-type=2" in path and step_dir(1) in path and "delimiter" not in path


@pytest.mark.parametrize("failing", [_data_put, _names_listing], ids=["data", "listing"])
def test_cp_whose_request_fails_for_good_after_its_manifest_deletes_it(failing, s3_server, s3_url, tmp_path, monkeypatch):
    # A part (or the first look's listing, answered after the manifest's write) failing past
    # botocore's retries: exit 3, the manifest written ahead deleted, what was published left
    # for the rerun, which completes.
    src = _save(str(tmp_path / "src"), 1, 1.0)
    dst = f"{s3_url}/{step_dir(1)}"
    proxy = FaultProxy(s3_server)
    seen: list[str] = []

    def rule(method: str, path: str) -> str | None:
        if method == "PUT" and path.split("?")[0].endswith("/" + MANIFEST):
            seen.append(MANIFEST)
        return "500" if failing(method, path) else None

    proxy.rule = rule
    proxy.start()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        r = cli("cp", src, dst)
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    assert r.exit_code == 3, r.stdout + r.stderr
    assert proxy.injected
    assert seen == [MANIFEST]  # on main: never sent, the copy failed before its commit
    assert open_storage(dst).stat(MANIFEST) is None
    again = cli("cp", src, dst)
    assert again.exit_code == 0, again.stdout + again.stderr
    assert cli("verify", dst).exit_code == 0


def test_a_copy_that_found_the_manifest_writes_it_again_when_its_writer_took_it_back(s3_url, tmp_path):
    # Two copies of one checkpoint: the other wrote the manifest ahead, this one found it
    # holding its bytes (not its own to delete), then the other took it back mid-copy (its
    # source failed its checksums). This copy's commit writes it again before the marker, so
    # the marker never lands over a missing manifest.
    from ckptctl.ops.transfer.copy import copy_checkpoint

    src = _save(str(tmp_path / "src"), 1, 1.0)
    dst = open_storage(s3_url).sub(step_dir(1))
    with open(os.path.join(src, MANIFEST), "rb") as f:
        assert dst.write_if_absent(MANIFEST, f.read())  # the other copy's, written ahead
    client = dst._client.s3  # type: ignore[attr-defined]
    taken_back: list[str] = []

    def other_takes_it_back(params: dict, **_kw: object) -> None:
        if params.get("Key", "").endswith(".safetensors") and not taken_back:
            taken_back.append(params["Key"])
            dst.delete(MANIFEST)

    client.meta.events.register("provide-client-params.s3.CreateMultipartUpload", other_takes_it_back)
    try:
        copy_checkpoint(open_storage(src), dst)
    finally:
        client.meta.events.unregister("provide-client-params.s3.CreateMultipartUpload", other_takes_it_back)
    assert taken_back
    v = cli("verify", dst.url)
    assert v.exit_code == 0, v.stdout + v.stderr
