"""The manifest's placement hints and the reader that uses them (issue 14 §1): hints round-trip
and are validated, a region opens only the headers its hint names, and a wrong hint costs
time, never correctness (the reader then searches every header)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.format.manifest import Manifest
from ckptctl.layouts.native_commit import commit
from ckptctl.layouts.native_read import read_committed
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.ops.transform.reshard import reshard
from ckptctl.storage import open_storage

W = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)


@pytest.fixture(scope="module")
def three_rank(tmp_path_factory):
    """``w`` (64 x 48) resharded to 3 ranks: three row chunks, the first of rows 0-21; no hints."""
    from ckptctl import Checkpointer

    base = tmp_path_factory.mktemp("three")
    with Checkpointer(str(base / "root")) as ck:
        src = ck.save(1, {"w": W, "extra": {}}).wait()
    dst = str(base / "out" / os.path.basename(src))
    reshard(open_storage(src), open_storage(dst), 3, split_bytes=1)
    return dst


def _with_hints(src: str, dst: str, **hints) -> str:
    """A copy of checkpoint ``src`` whose manifest gives tensor ``w`` the placement ``hints``,
    committed anew (manifest and marker rewritten, shards untouched)."""
    shutil.copytree(src, dst)
    ckpt = open_storage(dst)
    manifest, _ = read_committed(ckpt)
    manifest.tensors["w"] = dataclasses.replace(manifest.tensors["w"], **hints)
    os.remove(os.path.join(dst, MARKER))
    os.remove(os.path.join(dst, MANIFEST))
    commit(ckpt, manifest)
    return dst


def _read(path: str, r0: int, r1: int) -> tuple[torch.Tensor, int]:
    out = torch.empty(r1 - r0, 48)
    with CheckpointReader(open_storage(path)) as r:
        r.read_into(ReadJob("w", out, (r0, 0)))
        return out, r.headers_read


def test_hints_round_trip_and_bad_ones_are_refused(three_rank, tmp_path):
    path = _with_hints(three_rank, str(tmp_path / "c" / os.path.basename(three_rank)), split=(0, 22))
    manifest, _ = read_committed(open_storage(path))
    assert manifest.tensors["w"].split == (0, 22) and manifest.tensors["w"].owner is None
    raw = manifest.to_json().replace(b'"split": [\n    0,\n    22\n   ]', b'"split": [5, 22]')
    assert raw != manifest.to_json()
    with pytest.raises(InvalidCheckpoint, match="split"):
        Manifest.from_json(raw, "m")


def test_without_hints_every_header_is_opened(three_rank):
    out, opened = _read(three_rank, 0, 5)
    assert torch.equal(out, W[0:5]) and opened == 3


def test_a_hint_opens_only_the_shards_it_names(three_rank, tmp_path):
    # Rows 0-21 are rank 0's under the split [0, 22]: one header.
    path = _with_hints(three_rank, str(tmp_path / "c" / os.path.basename(three_rank)), split=(0, 22))
    out, opened = _read(path, 0, 22)
    assert torch.equal(out, W[0:22]) and opened == 1
    out, opened = _read(path, 10, 30)  # rows 10-29: ranks 0 and 1
    assert torch.equal(out, W[10:30]) and opened == 2


def test_a_wrong_hint_still_reads_the_right_bytes(three_rank, tmp_path):
    # Rank 0's chunk holds rows 0-21; a split of 21 puts row 21 in rank 1's file.
    with CheckpointReader(open_storage(three_rank)) as r:
        assert [loc.chunk.offsets[0] for loc in r.chunks("w")][:2] == [0, 22]
    path = _with_hints(three_rank, str(tmp_path / "c" / os.path.basename(three_rank)), split=(0, 21))
    out, opened = _read(path, 21, 22)
    assert torch.equal(out, W[21:22]) and opened == 3
    wrong = _with_hints(three_rank, str(tmp_path / "d" / os.path.basename(three_rank)), owner=2)
    out, opened = _read(wrong, 0, 64)
    assert torch.equal(out, W) and opened == 3
