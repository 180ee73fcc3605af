"""The verification record: an unchanged checkpoint is not re-read; a changed one always is."""

from __future__ import annotations

import json
import os

import pytest

from ckptctl.ops.retention.prune import plan as make_plan
from ckptctl.ops.retention.policies import from_options
from ckptctl.layouts.native import NativeLayout
from ckptctl.ops.verify.cache import CACHE_KEY, VerifyCache, fingerprint
from ckptctl.storage import open_storage
from ckptctl.storage.local import LocalStorage
from helpers import ckpt_dir, cli, make_checkpoints

POLICY = from_options(1, None, None, ())


def anchor_of(root: str, **kw):
    p = make_plan(open_storage(root), POLICY, **kw)
    return p.anchor.step if p.anchor else None, {i.step: i.verification for i in p.items}


def shard_of(root: str, step: int) -> str:
    d = ckpt_dir(root, step)
    return os.path.join(d, next(n for n in os.listdir(d) if n.endswith(".safetensors")))


def flip_byte_keep_times(path: str) -> None:
    """Change one byte; put the size and mtime (to the nanosecond) back as they were."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(-7, 2)
        b = f.read(1)
        f.seek(-7, 2)
        f.write(bytes([b[0] ^ 0x55]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.fixture
def root(tmp_path):
    make_checkpoints(str(tmp_path), [1, 2, 3], size=50_000)
    return str(tmp_path)


def test_unchanged_checkpoint_is_not_re_read(root):
    step, v = anchor_of(root)
    assert step == 3 and not v[3]["cached"] and v[3]["bytes_read"] > 0
    step, v = anchor_of(root)
    assert step == 3 and v[3]["cached"] and v[3]["bytes_read"] == 0 and "unchanged since" in v[3]["note"]
    # the CLI says so too, and --reverify reads it again
    doc = cli("prune", root, "--keep-last", "3", "--dry-run", "--json").json()
    assert doc["plan"]["items"][-1]["verification"]["cached"] is True
    doc = cli("prune", root, "--keep-last", "3", "--dry-run", "--json", "--reverify").json()
    assert doc["plan"]["items"][-1]["verification"]["cached"] is False
    assert doc["plan"]["items"][-1]["verification"]["bytes_read"] > 0


def test_changed_byte_with_same_size_and_mtime_is_caught_by_reverify(root):
    anchor_of(root)  # records step 3 as verified
    flip_byte_keep_times(shard_of(root, 3))
    step, v = anchor_of(root, reverify=True)
    assert step == 2 and not v[3]["ok"] and "checksum" in v[3]["problems"][0]
    # On POSIX the edit also changed the file's ctime (which os.utime cannot restore), so the
    # record is not trusted even without --reverify.
    step, v = anchor_of(root)
    assert step == 2 and not v[3]["cached"]


def test_reverify_catches_what_no_metadata_shows(root):
    """Bit rot below the filesystem changes no size, mtime or ctime; only a re-read sees it."""
    storage = open_storage(root)
    anchor_of(root)
    flip_byte_keep_times(shard_of(root, 3))
    # Make the record match the file's current metadata, as silent corruption would leave it.
    cache = VerifyCache.load(storage)
    entry = cache.entries["step-0000000003"]
    entry.update(fingerprint(storage.sub("step-0000000003"), NativeLayout()).to_doc())
    with open(os.path.join(root, CACHE_KEY), "w") as f:
        json.dump({"format": "ckptctl-verified", "version": 1, "entries": cache.entries}, f)
    step, v = anchor_of(root)
    assert step == 3 and v[3]["cached"]  # the record cannot know
    step, v = anchor_of(root, reverify=True)
    assert step == 2 and not v[3]["ok"]


@pytest.mark.parametrize("change", ["size", "mtime"])
def test_size_or_mtime_change_is_re_read_without_reverify(root, change):
    anchor_of(root)
    path = shard_of(root, 3)
    if change == "size":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # one nanosecond
    step, v = anchor_of(root)
    assert not v[3]["cached"]
    if change == "size":
        assert step == 2 and not v[3]["ok"] and "manifest says" in v[3]["problems"][0]
    else:
        assert v[3]["bytes_read"] > 0
        assert step == 3 and v[3]["ok"]  # re-read, still good, recorded again
        assert anchor_of(root)[1][3]["cached"]


def test_failures_are_never_recorded(root):
    flip_byte_keep_times(shard_of(root, 3))
    for _ in range(2):
        step, v = anchor_of(root)
        assert step == 2 and not v[3]["cached"] and v[3]["bytes_read"] > 0
    entries = VerifyCache.load(open_storage(root)).entries
    assert "step-0000000003" not in entries and "step-0000000002" in entries


class _RewrittenWhileRead(LocalStorage):
    """A disk on which another writer touches step 3's shard while ckptctl reads it: opening
    the shard moves its mtime on by a microsecond (the bytes read are still good)."""

    def open_reader(self, key: str):
        reader = super().open_reader(key)
        path = self.local_path(key)
        if "step-0000000003" in path.split(os.sep) and key.endswith(".safetensors"):
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        return reader


def test_a_checkpoint_changing_while_verified_is_neither_recorded_nor_trusted(root):
    before = os.stat(shard_of(root, 3)).st_mtime_ns
    p = make_plan(_RewrittenWhileRead(root), POLICY)
    assert os.stat(shard_of(root, 3)).st_mtime_ns > before  # the fault landed
    assert p.anchor.step == 2
    assert "changed while it was being verified" in p.items[-1].reason
    assert "step-0000000003" not in VerifyCache.load(open_storage(root)).entries


def test_garbled_record_is_ignored_with_a_note(root):
    with open(os.path.join(root, CACHE_KEY), "w") as f:
        f.write("{not json")
    p = make_plan(open_storage(root), POLICY)
    assert p.anchor.step == 3 and any("ignored the unreadable verification record" in n for n in p.notes)
    assert anchor_of(root)[1][3]["cached"]  # rewritten properly


def test_record_forgets_deleted_checkpoints(root):
    assert cli("prune", root, "--keep-last", "3", "--reverify", "--dry-run").exit_code == 0
    assert cli("prune", root, "--keep-last", "1", "--yes").exit_code == 0
    assert set(VerifyCache.load(open_storage(root)).entries) == {"step-0000000003"}
