"""``ckptctl restore`` and ``ckptctl cp`` between local directories: newest good checkpoint,
fallback past corruption, pinned steps, interrupted copies and destinations already in place."""

from __future__ import annotations

import os

import pytest
import torch

from ckptctl import Checkpointer
from ckptctl.errors import InvalidCheckpoint, RefusedForSafety
from ckptctl.format.layout import MANIFEST, MARKER
from ckptctl.ops.transfer.copy import copy_checkpoint, restore_latest
from ckptctl.storage import open_storage
from ckptctl.storage.base import Writer
from ckptctl.storage.local import LocalStorage
from helpers import ckpt_dir, cli, make_checkpoints


def _flip_byte(path: str, offset_from_end: int = 10) -> None:
    """Corrupt one byte of tensor data in place, keeping the size."""
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _shard(ckpt: str) -> str:
    return next(os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt)) if n.endswith(".safetensors"))


def _load(path: str) -> dict:
    state = {"model": {f"w{i}": torch.zeros(1000) for i in range(3)}, "extra": {}}
    Checkpointer(os.path.dirname(path)).load(path, state)
    return state


def test_restore_newest_and_print_path(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [10, 20, 30])
    r = cli("restore", src, dst)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == ckpt_dir(dst, 30)
    assert cli("verify", r.stdout.strip()).exit_code == 0
    state = _load(r.stdout.strip())
    assert torch.equal(state["model"]["w1"], torch.full((1000,), 301.0))
    # Byte-for-byte the same files, marker included.
    for name in os.listdir(ckpt_dir(src, 30)):
        with open(os.path.join(ckpt_dir(src, 30), name), "rb") as a, open(os.path.join(ckpt_dir(dst, 30), name), "rb") as b:
            assert a.read() == b.read(), name


def test_restore_falls_back_past_corrupt_newest(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [10, 20])
    _flip_byte(_shard(ckpt_dir(src, 20)))
    r = cli("restore", src, dst, "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["step"] == 10 and doc["path"] == ckpt_dir(dst, 10)
    assert [s["step"] for s in doc["skipped"]] == [20]
    assert "skipping step 20" in r.stderr and "tensor 'model/w2'" in r.stderr  # names the tensor
    # Nothing of the corrupt copy is left, and it was never committed.
    assert not os.path.exists(os.path.join(ckpt_dir(dst, 20), MARKER))
    assert not any(n.endswith(".safetensors") for n in os.listdir(ckpt_dir(dst, 20))) if os.path.exists(ckpt_dir(dst, 20)) else True


def test_restore_pinned_corrupt_step_exits_1(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [10, 20])
    _flip_byte(_shard(ckpt_dir(src, 10)))
    r = cli("restore", src, dst, "--step", "10")
    assert r.exit_code == 1
    assert "invalid checkpoint" in r.stderr and ".safetensors" in r.stderr
    assert not os.path.exists(os.path.join(ckpt_dir(dst, 10), MARKER))
    assert cli("restore", src, dst, "--step", "99").exit_code == 1
    ok = cli("restore", src, dst, "--step", "20")
    assert ok.exit_code == 0 and ok.stdout.strip() == ckpt_dir(dst, 20)


class _KilledMidWrite(Writer):
    """Writes half of the first piece it is given, then the job is killed (Ctrl-C)."""

    def __init__(self, inner: Writer) -> None:
        self.inner = inner

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.inner.write(view[: len(view) // 2])
        raise KeyboardInterrupt

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class _KilledDuringCopy(LocalStorage):
    """A destination whose shard writes are interrupted part-way, as when the job is killed."""

    def open_writer(self, key: str) -> Writer:
        writer = super().open_writer(key)
        return _KilledMidWrite(writer) if key.endswith(".safetensors") else writer


def test_interrupted_restore_rerun_completes(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    with Checkpointer(src) as ck:
        # Two shards' worth of files is what one rank writes; make several tensors so the
        # interruption lands mid-copy.
        ck.save(5, {"model": {f"w{i}": torch.arange(50_000, dtype=torch.float32) + i for i in range(4)}}).wait()
    with pytest.raises(KeyboardInterrupt):
        restore_latest(open_storage(src), _KilledDuringCopy(dst))
    assert not os.path.exists(os.path.join(ckpt_dir(dst, 5), MARKER))
    # No half-written file under a real name: the atomic writer discarded it.
    leftover = os.listdir(ckpt_dir(dst, 5)) if os.path.exists(ckpt_dir(dst, 5)) else []
    assert not any(n.endswith(".safetensors") for n in leftover)
    r = cli("restore", src, dst)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(dst, 5)
    assert cli("verify", ckpt_dir(dst, 5)).exit_code == 0


def test_rerun_reuses_shards_already_in_place(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [7])
    restore_latest(open_storage(src), open_storage(dst))
    os.unlink(os.path.join(ckpt_dir(dst, 7), MARKER))  # as if killed before the marker
    result = restore_latest(open_storage(src), open_storage(dst))
    assert result.copy.status == "copied" and result.copy.files_reused == result.copy.files
    assert result.copy.bytes_copied == 0
    assert cli("verify", ckpt_dir(dst, 7)).exit_code == 0


def test_existing_identical_dst_left_as_is(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [3])
    cli("restore", src, dst)
    marker = os.path.join(ckpt_dir(dst, 3), MARKER)
    before = os.stat(marker).st_mtime_ns, os.stat(_shard(ckpt_dir(dst, 3))).st_ino
    r = cli("restore", src, dst, "--json")
    assert r.exit_code == 0 and r.json()["copy"]["status"] == "already present"
    assert "left as is" in r.stderr
    assert (os.stat(marker).st_mtime_ns, os.stat(_shard(ckpt_dir(dst, 3))).st_ino) == before


def test_different_committed_dst_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_checkpoints(a, [4])
    make_checkpoints(b, [4], size=10)
    with pytest.raises(RefusedForSafety):
        copy_checkpoint(open_storage(ckpt_dir(a, 4)), open_storage(ckpt_dir(b, 4)))
    r = cli("cp", ckpt_dir(a, 4), ckpt_dir(b, 4))
    assert r.exit_code == 1 and "different committed checkpoint" in r.stderr


def test_copy_of_corrupt_source_commits_nothing(tmp_path):
    src = str(tmp_path / "src")
    make_checkpoints(src, [1])
    _flip_byte(_shard(ckpt_dir(src, 1)))
    dst = str(tmp_path / "copy" / "step-0000000001")
    with pytest.raises(InvalidCheckpoint, match="does not match"):
        copy_checkpoint(open_storage(ckpt_dir(src, 1)), open_storage(dst))
    assert not os.path.exists(os.path.join(dst, MARKER)) and not os.path.exists(os.path.join(dst, MANIFEST))


def test_cp_to_root_and_to_step_dir(tmp_path):
    src = str(tmp_path / "src")
    make_checkpoints(src, [12])
    r = cli("cp", ckpt_dir(src, 12), str(tmp_path / "root"))
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(str(tmp_path / "root"), 12)
    named = str(tmp_path / "other" / "step-0000000012")
    r = cli("cp", ckpt_dir(src, 12), named, "--json")
    assert r.exit_code == 0 and r.json()["status"] == "copied"
    assert cli("verify", named).exit_code == 0
    assert cli("cp", str(tmp_path / "nothing"), named).exit_code == 2  # no such file or directory


def test_restore_with_world_size_reshards_on_the_way(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [1, 2])
    _flip_byte(_shard(ckpt_dir(src, 2)))  # the fallback works the same when re-sharding
    same = cli("restore", src, str(tmp_path / "same"), "--world-size", "1")
    assert same.exit_code == 0 and same.stdout.strip() == ckpt_dir(str(tmp_path / "same"), 1)
    r = cli("restore", src, dst, "--world-size", "3", "--json")
    assert r.exit_code == 0, r.stderr
    doc = r.json()
    assert doc["step"] == 1 and [s["step"] for s in doc["skipped"]] == [2]
    path = doc["path"]
    assert cli("inspect", path, "--json").json()["world_size"] == 3
    assert cli("verify", path).exit_code == 0
    assert sorted(os.listdir(dst)) == [os.path.basename(path)]  # staging copy removed
    again = cli("restore", src, dst, "--world-size", "3", "--json")
    assert again.exit_code == 0 and again.json()["copy"]["status"] == "already present"
    refused = cli("restore", src, dst, "--world-size", "2")
    assert refused.exit_code == 1 and "different committed checkpoint" in refused.stderr


def test_restore_in_a_real_process_prints_only_the_path_on_stdout(tmp_path):
    from helpers import cli_subprocess

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [8])
    r = cli_subprocess("restore", src, dst)
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ckpt_dir(dst, 8) + "\n"
    assert "restored step 8" in r.stderr
    bad = cli_subprocess("restore", src, dst, "--step", "-1")
    assert bad.exit_code == 2 and "Traceback" not in bad.stderr


def test_src_may_name_one_checkpoint(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoints(src, [1, 2])
    r = cli("restore", ckpt_dir(src, 1), dst)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(dst, 1)
    wrong = cli("restore", ckpt_dir(src, 1), dst, "--step", "2")
    assert wrong.exit_code == 1 and "not 2" in wrong.stderr
    os.makedirs(tmp_path / "empty")
    assert cli("restore", str(tmp_path / "empty"), dst).exit_code == 1  # an empty root: nothing committed
    assert cli("restore", str(tmp_path / "missing"), dst).exit_code == 2  # no such file or directory
