"""Every load path verifies every byte it uses, and each shard is bound to its checkpoint.

Faults are injected into real files: a flipped data byte, a shard copied in from another save,
a manifest that lost a shard entry and was re-sealed. Partial reads (a region of a chunk, as a
re-sharding load makes) must check the whole chunk; a header must match the manifest's file
checksum; default ``verify`` must prove coverage from the headers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.format.marker import Marker
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli

W = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
B = torch.arange(10, dtype=torch.bfloat16)


def save_steps(root: str, steps=(1, 2)) -> list[str]:
    """One small 1-rank checkpoint per step: ``w`` (64 x 48 float32) and ``b``, values by step."""
    with Checkpointer(root) as ck:
        return [ck.save(s, {"w": W + 1000 * s, "b": B + s, "extra": {"step": s}}).wait() for s in steps]


def flip(ckpt: str, tensor: str, fraction: float) -> tuple[str, int]:
    """Flip one byte of ``tensor``'s chunk, ``fraction`` of the way into it; returns (file, offset)."""
    with CheckpointReader(open_storage(ckpt)) as r:
        (loc,) = r.chunks(tensor)
    start, end = loc.byte_range
    at = start + int((end - start) * fraction)
    with open(os.path.join(ckpt, loc.file), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    return loc.file, at


# --- partial reads are verified --------------------------------------------------------------


@pytest.mark.parametrize("region", ["first_rows", "last_rows", "columns", "non_contiguous", "element", "whole"])
def test_partial_read_of_a_corrupt_chunk_is_refused_naming_file_tensor_and_bytes(tmp_path, region):
    (path,) = save_steps(str(tmp_path / "root"), [1])
    fname, _ = flip(path, "w", 0.9)  # in the last rows: a read of the first rows never touches it
    targets = {
        "first_rows": (torch.empty(32, 48), (0, 0)),
        "last_rows": (torch.empty(32, 48), (32, 0)),
        "columns": (torch.empty(64, 24), (0, 24)),
        "non_contiguous": (torch.empty(48, 32).t(), (0, 0)),
        "element": (torch.empty(1, 1), (3, 5)),
        "whole": (torch.empty(64, 48), (0, 0)),
    }
    target, offsets = targets[region]
    with CheckpointReader(open_storage(path)) as r, pytest.raises(InvalidCheckpoint) as e:
        r.read_into(ReadJob("w", target, offsets))
    msg = str(e.value)
    assert fname in msg and "'w'" in msg and "does not match its checksum" in msg and "bytes " in msg


def test_unverified_region_read_is_an_explicit_opt_out(tmp_path):
    (path,) = save_steps(str(tmp_path / "root"), [1])
    flip(path, "w", 0.9)
    out = torch.empty(32, 48)
    with CheckpointReader(open_storage(path)) as r:
        r.read_into_unverified(ReadJob("w", out, (0, 0)))  # reshard's pass 2: checked downstream
    assert torch.equal(out, W[:32] + 1000)


def test_stream_chunk_checks_after_the_last_piece(tmp_path):
    (path,) = save_steps(str(tmp_path / "root"), [1])
    with CheckpointReader(open_storage(path)) as r:
        (loc,) = r.chunks("w")
        assert b"".join(bytes(p) for p in r.stream_chunk(loc, 1000)) == bytes(r.read_chunk(loc))
    flip(path, "w", 0.5)
    with CheckpointReader(open_storage(path)) as r:
        (loc,) = r.chunks("w")
        with pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
            for _ in r.stream_chunk(loc, 1000):
                pass
        with pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
            r.read_chunk(loc)


@pytest.fixture(scope="module")
def three_rank(tmp_path_factory):
    """A checkpoint of ``w`` resharded to 3 ranks: 3 row chunks (22, 21, 21 rows)."""
    from ckptctl.ops.transform.reshard import reshard

    base = tmp_path_factory.mktemp("three")
    (src,) = save_steps(str(base / "root"), [1])
    dst = str(base / "out" / os.path.basename(src))
    reshard(open_storage(src), open_storage(dst), 3, split_bytes=1)
    return dst


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_region_of_a_multi_chunk_tensor_reads_back_exactly(three_rank, data):
    r0 = data.draw(st.integers(0, 63))
    r1 = data.draw(st.integers(r0, 64))
    c0 = data.draw(st.integers(0, 47))
    c1 = data.draw(st.integers(c0, 48))
    transposed = data.draw(st.booleans())
    want = W[r0:r1, c0:c1] + 1000
    out = torch.empty(c1 - c0, r1 - r0).t() if transposed else torch.empty(r1 - r0, c1 - c0)
    with CheckpointReader(open_storage(three_rank)) as r:
        assert len(r.chunks("w")) == 3
        r.read_into(ReadJob("w", out, (r0, c0)))
    assert torch.equal(out, want)


def test_every_chunk_a_region_touches_is_verified_and_only_those(three_rank, tmp_path):
    path = str(tmp_path / os.path.basename(three_rank))
    shutil.copytree(three_rank, path)
    with CheckpointReader(open_storage(path)) as r:
        last = r.chunks("w")[-1]
    first_row = last.chunk.offsets[0]  # 44: chunks of 22, 22 and 20 rows, as torch.chunk
    start, end = last.byte_range
    with open(os.path.join(path, last.file), "r+b") as f:
        f.seek(end - 1)
        b = f.read(1)
        f.seek(end - 1)
        f.write(bytes([b[0] ^ 1]))
    with CheckpointReader(open_storage(path)) as r:
        out = torch.empty(first_row, 48)
        r.read_into(ReadJob("w", out, (0, 0)))  # chunks 0 and 1 only
        assert torch.equal(out, W[:first_row] + 1000)
        with pytest.raises(InvalidCheckpoint, match=f"{last.file}.*'w'.*bytes {start}-{end}"):
            r.read_into(ReadJob("w", torch.empty(2, 48), (first_row - 1, 0)))  # one row of the bad chunk


# --- a shard is bound to its checkpoint -------------------------------------------------------


def test_shard_copied_from_another_save_is_refused_and_load_latest_falls_back(tmp_path, caplog):
    root = str(tmp_path / "root")
    one, two = save_steps(root, (1, 2))
    (shard,) = [n for n in os.listdir(two) if n.endswith(".safetensors")]
    shutil.copyfile(os.path.join(one, shard), os.path.join(two, shard))  # same names and shapes, step 1's values

    state = {"w": torch.zeros(64, 48), "b": torch.zeros(10, dtype=torch.bfloat16), "extra": {}}
    with Checkpointer(root) as ck:
        with pytest.raises(InvalidCheckpoint, match="does not match the file checksum"):
            ck.load(two, state)
        with caplog.at_level(logging.WARNING):
            assert ck.load_latest(state, prepare=False) == 1
    assert torch.equal(state["w"], W + 1000) and state["extra"] == {"step": 1}
    assert any("step-0000000002" in r.getMessage() and "file checksum" in r.getMessage() for r in caplog.records)
    for level in (["--quick"], []):
        r = cli("verify", two, *level)
        assert r.exit_code == 1 and "does not match the file checksum" in r.stdout + r.stderr, r.stdout + r.stderr


# --- coverage at the default verify level -----------------------------------------------------


def test_two_rank_checkpoint_that_lost_a_shard_entry_fails_default_verify_and_latest_skips_it(tmp_path):
    from ckptctl.ops.transform.reshard import reshard

    root = str(tmp_path / "root")
    save_steps(root, [1])
    (other,) = save_steps(str(tmp_path / "other"), [2])
    two = ckpt_dir(root, 2)
    reshard(open_storage(other), open_storage(two), 2, split_bytes=1)  # a real 2-rank checkpoint
    assert cli("latest", root).stdout.strip().endswith("step-0000000002")

    # Drop rank 1's file from the manifest and re-seal it: every listed file is intact.
    with open(os.path.join(two, MANIFEST)) as f:
        doc = json.load(f)
    doc["files"] = [f for f in doc["files"] if f["rank"] != 1]
    raw = json.dumps(doc).encode()
    with open(os.path.join(two, MANIFEST), "wb") as f:
        f.write(raw)
    with open(os.path.join(two, MARKER), "wb") as f:
        f.write(Marker.for_manifest(doc["step"], raw).to_json())

    for level in ([], ["--quick"]):
        r = cli("verify", two, *level)
        text = r.stdout + r.stderr
        assert r.exit_code == 1, text
        assert "chunks cover" in text and "'w'" in text, text
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip().endswith("step-0000000001"), r.stdout + r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_partial_read_into_a_cuda_target_is_verified_through_the_host_bounce(tmp_path):
    (path,) = save_steps(str(tmp_path / "root"), [1])
    with CheckpointReader(open_storage(path)) as r:
        out = torch.empty(32, 48, device="cuda")
        r.read_into(ReadJob("w", out, (32, 0)))
        assert torch.equal(out.cpu(), W[32:] + 1000)
    flip(path, "w", 0.1)  # in the rows the target does not need
    with CheckpointReader(open_storage(path)) as r, pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
        r.read_into(ReadJob("w", torch.empty(32, 48, device="cuda"), (32, 0)))
