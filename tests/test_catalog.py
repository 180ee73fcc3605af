"""The catalog: one listing of a root, its statuses, and the lazy newest-first walks."""

from __future__ import annotations

import os
import shutil

from ckptctl.format.layout import MANIFEST, MARKER, step_dir
from ckptctl.layouts import catalog, native_commit, native_read
from ckptctl.storage import open_storage
from ckptctl.storage.base import ObjectInfo
from ckptctl.storage.local import LocalStorage
from helpers import ckpt_dir, make_checkpoints


def _root_of_every_status(root: str) -> None:
    """step 1 committed, 2 corrupt (manifest changed after commit), 3 partial (no marker),
    4 a symlink, 5 committed; plus things that are not step directories at all."""
    make_checkpoints(root, [1, 2, 3, 5])
    with open(os.path.join(ckpt_dir(root, 2), MANIFEST), "ab") as f:
        f.write(b" ")
    os.unlink(os.path.join(ckpt_dir(root, 3), MARKER))
    os.symlink(ckpt_dir(root, 1), ckpt_dir(root, 4))
    os.makedirs(os.path.join(root, "notes"))
    open(os.path.join(root, "step-0000000006"), "w").close()  # a file, not a directory
    os.makedirs(os.path.join(root, ".restore-staging-" + step_dir(7)))  # an older version's restore staging copy
    os.makedirs(os.path.join(root, ".restore-staging-" + step_dir(8) + ".0123456789abcdef"))  # this version's: per run


def test_list_checkpoints_gives_every_status_oldest_first(tmp_path):
    root = str(tmp_path)
    _root_of_every_status(root)
    entries = catalog.list_checkpoints(open_storage(root))
    assert [(e.step, e.status) for e in entries] == [
        (1, "committed"), (2, "corrupt"), (3, "partial"), (4, "link"), (5, "committed")]
    assert {e.layout for e in entries} == {"ckptctl"}
    by_step = {e.step: e for e in entries}
    assert by_step[1].reason is None and by_step[1].manifest is not None and by_step[1].manifest.step == 1
    assert "marker" in (by_step[2].reason or "") and by_step[2].manifest is None
    assert by_step[3].reason is None and by_step[3].manifest is None
    assert by_step[4].storage is None and by_step[4].url == ckpt_dir(root, 4)  # never followed
    assert by_step[5].storage is not None and by_step[5].storage.url == ckpt_dir(root, 5) == by_step[5].url
    assert by_step[5].name == step_dir(5)


def test_steps_compare_as_integers(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [9, 10, 100])
    os.rename(ckpt_dir(root, 9), os.path.join(root, "step-9"))
    assert [e.name for e in catalog.list_checkpoints(open_storage(root))] == ["step-9", step_dir(10), step_dir(100)]
    assert [e.step for e in catalog.newest_committed(open_storage(root))] == [100, 10, 9]


def test_newest_committed_and_newest_marked(tmp_path):
    root = str(tmp_path)
    _root_of_every_status(root)
    st = open_storage(root)
    assert [e.step for e in catalog.newest_committed(st)] == [5, 1]
    assert [(e.step, e.status) for e in catalog.newest_marked(st)] == [(5, "committed"), (2, "corrupt"), (1, "committed")]
    assert [e.step for e in catalog.newest_marked(st, step=2)] == [2]
    assert list(catalog.newest_marked(st, step=3)) == []  # partial: no marker
    assert list(catalog.newest_marked(st, step=4)) == []  # a link is never followed


def test_status_is_decided_from_the_files_not_from_messages(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1])
    ckpt = open_storage(ckpt_dir(root, 1))
    os.unlink(os.path.join(ckpt_dir(root, 1), MANIFEST))
    state = native_read.read_state(ckpt)  # a marker without its manifest: corrupt, not partial
    assert state.status == "corrupt" and "missing" in str(state.error)
    os.unlink(os.path.join(ckpt_dir(root, 1), MARKER))
    assert native_read.read_state(ckpt).status == "partial"
    shutil.rmtree(ckpt_dir(root, 1))
    os.makedirs(ckpt_dir(root, 1))
    assert [(e.step, e.status) for e in catalog.list_checkpoints(open_storage(root))] == [(1, "partial")]


class _CountingDisk(LocalStorage):
    """A real disk that counts lookups of markers (the cost of "newest" on S3: one HEAD each)."""

    marker_stats: list[str] = []

    def stat(self, key: str) -> ObjectInfo | None:
        if key == MARKER:
            self.marker_stats.append(self.url)
        return super().stat(key)


def test_newest_committed_is_lazy(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, range(1, 9))
    _CountingDisk.marker_stats = []
    newest = next(catalog.newest_committed(_CountingDisk(root)))
    assert newest.step == 8
    assert _CountingDisk.marker_stats == [ckpt_dir(root, 8)]


def test_remove_takes_the_marker_first_and_leaves_nothing(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    native_commit.remove(open_storage(root).sub(step_dir(1)))
    assert not os.path.exists(ckpt_dir(root, 1))
    assert [e.step for e in catalog.list_checkpoints(open_storage(root))] == [2]


def test_remove_with_expected_files_stops_at_a_changed_one(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1])
    ckpt = open_storage(root).sub(step_dir(1))
    expected = {i.key: (i.size, i.mtime) for i in ckpt.list()}
    shard = next(k for k in expected if k.endswith(".safetensors"))
    expected[shard] = (expected[shard][0] + 1, expected[shard][1])  # as if it changed since
    changed = native_commit.remove(ckpt, expected=expected)
    assert changed == ckpt.url_of(shard)
    left = sorted(os.listdir(ckpt_dir(root, 1)))
    assert MARKER not in left and MANIFEST not in left and shard in left  # uncommitted first
    assert native_read.read_state(ckpt).status == "partial"
