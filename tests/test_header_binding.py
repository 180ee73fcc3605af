"""Every byte of a shard header is bound to its checkpoint: the trust issue's cases 4, 5, 6, 11.

A shard whose ckptctl chunk index is missing, renamed or unreadable is corrupt; it is never
read as plain safetensors without checksums. Each fault is one real edit of a real file.
"""

from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.layout import shard_name
from ckptctl.ops.transform.reshard import reshard
from ckptctl.storage import open_storage
from helpers import ckpt_dir, cli

W = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)


def _state(step: int) -> dict:
    return {"w": W + 1000 * step, "b": torch.arange(8, dtype=torch.float32) + step, "extra": {"step": step}}


def _blank() -> dict:
    return {"w": torch.zeros(4, 6), "b": torch.zeros(8), "extra": {}}


def _header_span(path: str) -> tuple[int, bytes]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, f.read(n)


def _flip_in_header(path: str, needle: bytes, bit: int = 0, nth: int = 0) -> None:
    """Flip bit ``bit`` of the first byte of the ``nth`` occurrence of ``needle`` in the header."""
    _, raw = _header_span(path)
    at = -1
    for _ in range(nth + 1):
        at = raw.index(needle, at + 1)
    with open(path, "r+b") as f:
        f.seek(8 + at)
        b = f.read(1)
        f.seek(8 + at)
        f.write(bytes([b[0] ^ (1 << bit)]))


def _shard(ckpt: str) -> str:
    (name,) = [n for n in os.listdir(ckpt) if n.endswith(".safetensors")]
    return os.path.join(ckpt, name)


def _save_two_steps(root: str) -> tuple[str, str, dict]:
    """Steps 1 and 2 (1 rank); returns their paths and the RNG states step 1 captured."""
    with Checkpointer(root) as ck:
        torch.manual_seed(11), random.seed(11), np.random.seed(11)
        rng1 = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        one = ck.save(1, _state(1)).wait()
        torch.manual_seed(22), random.seed(22), np.random.seed(22)
        two = ck.save(2, _state(2)).wait()
    return one, two, rng1


def _assert_step1(state: dict) -> None:
    assert torch.equal(state["w"], W + 1000) and torch.equal(state["b"], torch.arange(8.0) + 1)
    assert state["extra"] == {"step": 1}


@pytest.mark.parametrize("needle", [b'"ckptctl"', b'chunks'])
def test_case4_flipped_bit_in_rank1_header_key_fails_a_2_to_1_load_which_falls_back(tmp_path, needle):
    root = str(tmp_path / "root")
    with Checkpointer(root) as ck:
        ck.save(10, _state(10)).wait()
    with Checkpointer(str(tmp_path / "src")) as ck:
        src = ck.save(20, _state(20)).wait()
    two = ckpt_dir(root, 20)
    reshard(open_storage(src), open_storage(two), 2, split_bytes=1)  # a real 2-rank checkpoint
    _flip_in_header(os.path.join(two, shard_name(1, 2)), needle.strip(b'"'), bit=1)

    state = _blank()
    with Checkpointer(root) as ck:
        with pytest.raises(InvalidCheckpoint):
            ck.load(two, _blank())
        assert ck.load_latest(state, prepare=False) == 10
    assert torch.equal(state["w"], W + 10000) and state["extra"] == {"step": 10}


def test_case5_flipped_bit_in_ckptctl_key_falls_back_with_rng_restored(tmp_path):
    root = str(tmp_path / "root")
    _one, two, rng1 = _save_two_steps(root)
    _flip_in_header(_shard(two), b"ckptctl", bit=0)

    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    state = _blank()
    with Checkpointer(root) as ck:
        assert ck.load_latest(state, prepare=False) == 1
    _assert_step1(state)
    assert torch.equal(torch.get_rng_state(), rng1["torch"])
    assert random.getstate() == rng1["python"]
    got = np.random.get_state()
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(got, rng1["numpy"]))


def test_case6_hostile_shard_with_renamed_checksum_keys_and_changed_data_is_refused(tmp_path):
    root = str(tmp_path / "root")
    _one, two, _ = _save_two_steps(root)
    path = _shard(two)
    start, raw = _header_span(path)
    assert raw.count(b"checksum") >= 2
    data = open(path, "rb").read()
    forged = bytearray(data[:8] + raw.replace(b"checksum", b"checksuM") + data[start:])
    header = json.loads(raw)  # w[0, 5] is 5 floats into w's bytes
    begin = header["w"]["data_offsets"][0]
    struct.pack_into("<f", forged, start + begin + 5 * 4, 12345.0)
    with open(path, "wb") as f:
        f.write(forged)

    state = _blank()
    with Checkpointer(root) as ck:
        with pytest.raises(InvalidCheckpoint):
            ck.load(two, _blank())
        assert ck.load_latest(state, prepare=False) == 1
    _assert_step1(state)
    for level in (["--quick"], [], ["--load"]):
        r = cli("verify", two, *level)
        assert r.exit_code == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_case11_flipped_hex_digit_in_a_chunk_checksum_is_corruption_everywhere(tmp_path):
    root = str(tmp_path / "root")
    _one, two, _ = _save_two_steps(root)
    path = _shard(two)
    _, raw = _header_span(path)
    meta = json.loads(json.loads(raw)["__metadata__"]["ckptctl"])
    digest = meta["chunks"]["w"]["checksum"]
    pos = next(i for i, ch in enumerate(digest) if ch in "abcdef")  # 'a' ^ 0x10 == 'q': not hex
    _flip_in_header(path, digest.encode()[pos:], bit=4)

    for level in (["--quick"], [], ["--load"]):
        r = cli("verify", two, *level)
        text = r.stdout + r.stderr
        assert r.exit_code == 1 and "Traceback" not in text, text
        assert os.path.basename(path) in text, text
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip().endswith("step-0000000001"), r.stdout + r.stderr
    out = str(tmp_path / "out")
    for args in (["cp", two, out], ["convert", two, out + "-st", "--to", "safetensors"],
                 ["reshard", two, out + "-rs", "--world-size", "2"], ["restore", root, out + "-r", "--step", "2"]):
        r = cli(*args)
        text = r.stdout + r.stderr
        assert r.exit_code == 1 and "Traceback" not in text and "internal error" not in text, (args, text)
    state = _blank()
    with Checkpointer(root) as ck:
        with pytest.raises(InvalidCheckpoint):
            ck.load(two, _blank())
        assert ck.load_latest(state, prepare=False) == 1
    _assert_step1(state)
