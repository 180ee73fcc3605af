"""A load is all-or-nothing: a checkpoint that fails anywhere changes nothing in the caller's
state (model, optimizer, data loader, extra, every RNG), and a fallback leaves exactly the older
checkpoint's state.

Faults are real edits of real files: a flipped data bit in the last chunk of the file (so a
load that applied as it read would have written every earlier tensor), and a hostile but
consistently re-sealed shard whose saved RNG state does not decode.
"""

from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest
import torch
from torch import nn

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.checksum import file_checksum
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.format.marker import Marker
from ckptctl.format.shard import build_header, parse_header
from ckptctl.load.reader import CheckpointReader
from ckptctl.storage import open_storage


class Loader:
    """A data loader position, saved through state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, d: dict) -> None:
        self.pos = d["pos"]


def _job(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    loader = Loader()
    loader.pos = seed
    return {"model": model, "optimizer": opt, "loader": loader, "extra": {"seed": seed}}


def _snapshot(state: dict) -> dict:
    """Everything a resume depends on, copied: tensors bitwise, loader, extra, every RNG."""
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optimizer": {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for p, s in state["optimizer"].state_dict()["state"].items()},
        "loader": state["loader"].pos,
        "extra": json.dumps(state["extra"], sort_keys=True),
        "torch": torch.get_rng_state().clone(),
        "python": random.getstate(),
        "numpy": [a.copy() if isinstance(a, np.ndarray) else a for a in np.random.get_state()],
    }


def _same(a: dict, b: dict) -> bool:
    def eq(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y)
        if isinstance(x, np.ndarray):
            return np.array_equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        return x == y
    return eq(a, b)


@pytest.fixture
def two_steps(tmp_path):
    """Steps 1 and 2 of a small job under ``root``; returns (root, step-1 path, step-2 path, the
    state each step saved as a snapshot)."""
    root = str(tmp_path / "root")
    saved = {}
    paths = {}
    with Checkpointer(root) as ck:
        for step in (1, 2):
            state = _job(step)
            torch.manual_seed(100 + step), random.seed(100 + step), np.random.seed(100 + step)
            saved[step] = _snapshot(state)
            paths[step] = ck.save(step, state).wait()
    return root, paths[1], paths[2], saved


def _last_chunk(path: str):
    with CheckpointReader(open_storage(path)) as r:
        (h,) = r.headers.values()
        (name,) = r.headers.keys()
        return name, max(h.chunks, key=lambda c: c.begin), h.data_start


def _flip_last_chunk(path: str) -> None:
    name, c, data_start = _last_chunk(path)
    with open(os.path.join(path, name), "r+b") as f:
        at = data_start + c.end - 1
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def _reseal_with_rank_state(path: str, edit) -> None:
    """Rewrite the shard's header with ``edit(rank_state)`` applied and re-seal the checkpoint
    (file checksum, manifest, marker) as a hostile writer would: every checksum matches."""
    (name,) = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    with open(os.path.join(path, name), "rb") as f:
        raw = f.read()
    h = parse_header(raw, len(raw), name)
    data = raw[h.data_start:]
    rank_state = json.loads(json.dumps(h.rank_state))
    edit(rank_state)
    chunks = sorted(h.chunks, key=lambda c: c.begin)
    header = build_header(chunks, rank=h.rank, rank_state=rank_state)
    with open(os.path.join(path, name), "wb") as f:
        f.write(header + data)
    with open(os.path.join(path, MANIFEST)) as f:
        doc = json.load(f)
    (entry,) = doc["files"]
    entry["size"] = len(header) + len(data)
    entry["checksum"] = file_checksum(header, [c.checksum for c in chunks])
    manifest = json.dumps(doc).encode()
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(manifest)
    with open(os.path.join(path, MARKER), "wb") as f:
        f.write(Marker.for_manifest(doc["step"], manifest).to_json())


def _live() -> dict:
    state = _job(7)
    torch.manual_seed(77), random.seed(77), np.random.seed(77)
    return state


def test_a_corrupt_last_chunk_changes_nothing_and_the_fallback_is_exactly_the_older_step(two_steps):
    root, _one, two, saved = two_steps
    _flip_last_chunk(two)
    state = _live()
    before = _snapshot(state)
    with Checkpointer(root) as ck:
        with pytest.raises(InvalidCheckpoint, match="does not match its checksum"):
            ck.load(two, state)
        assert _same(_snapshot(state), before)
        assert ck.load_latest(state, prepare=False) == 1
    assert _same(_snapshot(state), saved[1])


def test_with_no_older_checkpoint_a_failed_load_latest_leaves_the_fresh_state_untouched(two_steps):
    root, one, two, _ = two_steps
    _flip_last_chunk(two)
    _flip_last_chunk(one)
    state = _live()
    before = _snapshot(state)
    with Checkpointer(root) as ck:
        assert ck.load_latest(state, prepare=False) is None  # "start fresh": it must be fresh
    assert _same(_snapshot(state), before)


def test_saved_rng_state_that_does_not_decode_is_corruption_and_the_load_falls_back(two_steps):
    root, _one, two, saved = two_steps
    _reseal_with_rank_state(two, lambda rs: rs["rng"].__setitem__("torch", "not base64!"))
    state = _live()
    before = _snapshot(state)
    with Checkpointer(root) as ck:
        with pytest.raises(InvalidCheckpoint, match="RNG state"):
            ck.load(two, state)
        assert _same(_snapshot(state), before)
        assert ck.load_latest(state, prepare=False) == 1
    assert _same(_snapshot(state), saved[1])


@pytest.mark.parametrize("damage", ["python_state_short", "numpy_keys_short", "torch_state_short"])
def test_rng_state_of_the_wrong_shape_is_refused_before_anything_is_set(two_steps, damage):
    root, _one, two, saved = two_steps

    def edit(rs: dict) -> None:
        r = rs["rng"]
        if damage == "python_state_short":
            r["python"]["state"] = r["python"]["state"][:10]
        elif damage == "numpy_keys_short":
            r["numpy"]["keys"] = r["numpy"]["keys"][:10]
        else:
            r["torch"] = r["torch"][:12]

    _reseal_with_rank_state(two, edit)
    state = _live()
    before = _snapshot(state)
    with Checkpointer(root) as ck:
        with pytest.raises(InvalidCheckpoint, match="RNG state"):
            ck.load(two, state)
        assert _same(_snapshot(state), before)
        assert ck.load_latest(state, prepare=False) == 1
    assert _same(_snapshot(state), saved[1])


def test_a_flipped_bit_in_the_rng_record_is_refused_and_the_fallback_is_exact(two_steps):
    """Only a hostile re-seal (above) changes a header undetected: one flipped byte of the RNG
    record without re-sealing is refused, since the header is hashed whole into the file
    checksum the manifest records."""
    root, _one, two, saved = two_steps
    (name,) = [n for n in os.listdir(two) if n.endswith(".safetensors")]
    with open(os.path.join(two, name), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    at = 8 + raw.index(b'rng')  # inside the RNG record's key
    with open(os.path.join(two, name), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    state = _live()
    with Checkpointer(root) as ck:
        assert ck.load_latest(state, prepare=False) == 1
    assert _same(_snapshot(state), saved[1])
