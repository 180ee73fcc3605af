"""Every way a checkpoint can be damaged is caught by `verify`, named, and exits 1 without a
traceback; nothing outside the checkpoint is read."""

from __future__ import annotations

import json
import os
import struct

import pytest

from ckptctl.format.layout import MANIFEST, MARKER
from helpers import ckpt_dir, cli, make_checkpoints


@pytest.fixture
def ckpt(tmp_path):
    root = str(tmp_path / "root")
    make_checkpoints(root, [1], size=4096, tensors=4)
    return ckpt_dir(root, 1)


def shard(ckpt: str) -> str:
    return os.path.join(ckpt, next(n for n in os.listdir(ckpt) if n.endswith(".safetensors")))


def header_of(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def rewrite_header(path: str, header: dict) -> None:
    """Replace the header keeping the data section, as a crafted file would."""
    n, _ = header_of(path)
    with open(path, "rb") as f:
        data = f.read()[8 + n :]
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def verify_fails(ckpt: str, *expected: str, level: str | None = None) -> str:
    args = ["verify", ckpt] + ([level] if level else [])
    r = cli(*args)
    text = r.stdout + r.stderr
    assert r.exit_code == 1, text
    assert "Traceback" not in text
    for e in expected:
        assert e in text, (e, text)
    return text


def test_intact_checkpoint_verifies_at_every_level(ckpt):
    for level in (["--quick"], [], ["--load"]):
        r = cli("verify", ckpt, *level)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert r.stdout.startswith("ok")


def test_flipped_bit_names_the_tensor_and_byte_range(ckpt):
    path = shard(ckpt)
    n, header = header_of(path)
    name = sorted(k for k in header if k != "__metadata__")[2]
    begin = 8 + n + header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(begin + 100)
        b = f.read(1)
        f.seek(begin + 100)
        f.write(bytes([b[0] ^ 0x10]))
    text = verify_fails(ckpt, f"tensor '{name}'", f"bytes {begin}-", "does not match its checksum", "file checksum")
    # the other tensors are not blamed
    assert text.count("does not match its checksum") == 1
    # --quick does not read data: it cannot see a flipped bit
    assert cli("verify", ckpt, "--quick").exit_code == 0


def test_truncated_shard(ckpt):
    path = shard(ckpt)
    os.truncate(path, os.path.getsize(path) - 10)
    verify_fails(ckpt, os.path.basename(path), "manifest says")


def test_missing_shard(ckpt):
    os.unlink(shard(ckpt))
    verify_fails(ckpt, "missing")


@pytest.mark.parametrize("damage", ["missing", "garbled", "replaced"])
def test_manifest_damage(ckpt, damage):
    path = os.path.join(ckpt, MANIFEST)
    if damage == "missing":
        os.unlink(path)
        verify_fails(ckpt, "manifest.json is missing")
    elif damage == "garbled":
        with open(path, "r+b") as f:
            f.seek(20)
            f.write(b"\x00garbage")
        # Same size, bytes changed: the message must not print two equal sizes as the reason.
        verify_fails(ckpt, "does not match its marker (same size, ")
    else:
        doc = json.load(open(path))
        doc["step"] = 999
        with open(path, "w") as f:
            json.dump(doc, f)
        verify_fails(ckpt, "does not match its marker")


def test_marker_without_manifest_is_not_a_checkpoint(ckpt):
    os.unlink(os.path.join(ckpt, MANIFEST))
    r = cli("ls", os.path.dirname(ckpt), "--json")
    assert r.json()["checkpoints"][0]["status"] == "corrupt"


def test_no_marker_is_not_committed(ckpt):
    os.unlink(os.path.join(ckpt, MARKER))
    verify_fails(ckpt, "not committed")


def test_header_claiming_a_huge_length(ckpt):
    path = shard(ckpt)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 62))
    verify_fails(ckpt, "header claims")


def test_header_with_overlapping_offsets(ckpt):
    path = shard(ckpt)
    _, header = header_of(path)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = header[names[0]], header[names[1]]
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][1]]  # alias the same bytes
    rewrite_header(path, header)
    size = os.path.getsize(path)
    _forge_manifest(ckpt, lambda d: d["files"][0].__setitem__("size", size))  # a consistent forgery
    verify_fails(ckpt, "overlaps")


def _forge_manifest(ckpt: str, mutate) -> None:
    """Edit the manifest and re-seal the marker, as an attacker with write access could."""
    from ckptctl.format.marker import Marker

    path = os.path.join(ckpt, MANIFEST)
    doc = json.load(open(path))
    mutate(doc)
    raw = json.dumps(doc).encode()
    open(path, "wb").write(raw)
    open(os.path.join(ckpt, MARKER), "wb").write(Marker.for_manifest(doc["step"], raw).to_json())


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/dir.safetensors"])
def test_manifest_naming_a_path_outside_is_refused(ckpt, bad, tmp_path):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"secret")
    _forge_manifest(ckpt, lambda d: d["files"][0].__setitem__("name", bad))
    verify_fails(ckpt, "refusing file name")


def test_shard_symlinked_out_of_the_directory_is_not_read(ckpt, tmp_path):
    path = shard(ckpt)
    target = tmp_path / "elsewhere.safetensors"
    os.rename(path, target)
    os.symlink(target, path)
    verify_fails(ckpt, "symlink")


def test_every_problem_is_reported_not_just_the_first(tmp_path):
    root = str(tmp_path / "r")
    make_checkpoints(root, [1], size=100)
    ck = ckpt_dir(root, 1)
    path = shard(ck)
    with open(path, "r+b") as f:  # damage two different tensors
        n, header = header_of(path)
        for name in sorted(k for k in header if k != "__metadata__")[:2]:
            f.seek(8 + n + header[name]["data_offsets"][0])
            f.write(b"\xff\xff\xff\xff")
    r = cli("verify", ck, "--json")
    assert r.exit_code == 1
    problems = r.json()["checkpoints"][0]["problems"]
    assert len({p["tensor"] for p in problems if p["tensor"]}) == 2
