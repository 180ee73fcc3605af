"""The storage contract, run against every backend on real files and real HTTP (moto server).

The first part is one suite parametrised over ``local``, ``s3`` and ``express`` (an S3 Express
One Zone directory bucket): whatever the layers above may rely on must hold for all three.
Then the behaviour only one backend has: links, full disks and permissions on POSIX;
multipart uploads, stream drops and AWS errors on S3 (the uploads' on both kinds of bucket).
"""

from __future__ import annotations

import array
import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from ckptctl.errors import InvalidCheckpoint, NotFound, StorageError, UsageError
from ckptctl.settings import WRITE_BEHIND, WRITE_BEHIND_LAG
from ckptctl.storage import Storage, open_storage
from ckptctl.storage.local import LocalStorage
from ckptctl.storage.s3 import MAX_PART_SIZE, MAX_PARTS, MIN_PART_SIZE, S3Storage, part_size_for
from helpers import tmpfs

MiB = 1 << 20
BAD_KEYS = ["../x", "/abs", "a//b", "a/./b", "a/..", "a\\b", "x\0y"]


def _pattern(size: int, seed: int = 0) -> bytes:
    """Bytes where every offset is distinguishable, so a misplaced range shows."""
    block = bytes((i * 7 + seed) % 251 for i in range(251 * 16))
    return (block * (size // len(block) + 1))[:size]


def _assert_one_line_with_hint(err: BaseException) -> None:
    assert "\n" not in str(err)
    assert getattr(err, "hint", None)


@pytest.fixture(params=["local", "s3", "express"])
def store(request: pytest.FixtureRequest, tmp_path) -> Storage:
    """Each backend: a directory, a general-purpose bucket, and an S3 Express One Zone directory
    bucket (emulated: refuses what AWS refuses there and lists in no order)."""
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    return open_storage(request.getfixturevalue("s3_url" if request.param == "s3" else "express_url"))


# --- conformance: both backends ------------------------------------------------------------


def test_open_storage_chooses_backend_by_scheme(tmp_path) -> None:
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    via_file_url = open_storage(f"file://{tmp_path}")
    assert isinstance(via_file_url, LocalStorage)
    assert via_file_url.local_path("a") == os.path.join(str(tmp_path), "a")
    assert isinstance(open_storage("s3://bucket/some/prefix/"), S3Storage)
    assert open_storage("s3://bucket/some/prefix/").url == "s3://bucket/some/prefix"
    for bad in ["gs://bucket/x", "http://host/x", ""]:
        with pytest.raises(UsageError) as info:
            open_storage(bad)
        _assert_one_line_with_hint(info.value)
    with pytest.raises(UsageError, match="'gs'"):
        open_storage("gs://bucket/x")
    with pytest.raises(UsageError):
        open_storage("file://otherhost/x")
    with pytest.raises(UsageError):
        open_storage("s3://bucket/a//b")


def test_sub_and_url_of(store: Storage) -> None:
    step = store.sub("runs/step_100")
    assert step.url == store.url_of("runs/step_100")
    assert step.url_of("shard") == store.url.rstrip("/") + "/runs/step_100/shard"
    step.write_atomic("shard", b"abc")
    assert store.read("runs/step_100/shard") == b"abc"
    assert step.sub("deeper").url == store.url_of("runs/step_100/deeper")
    assert [i.key for i in step.list()] == ["shard"]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_check_key_rejections_on_every_method(store: Storage, bad: str) -> None:
    calls = [
        lambda: store.sub(bad),
        lambda: store.stat(bad),
        lambda: store.open_reader(bad),
        lambda: store.open_writer(bad),
        lambda: store.write_atomic(bad, b"x"),
        lambda: store.write_if_absent(bad, b"x"),
        lambda: store.delete(bad),
        lambda: store.children(bad),
        lambda: list(store.list(bad)),
        lambda: store.remove_dir(bad),
    ]
    for call in calls:
        with pytest.raises(InvalidCheckpoint, match="refusing path") as info:
            call()
        _assert_one_line_with_hint(info.value)
    assert list(store.list()) == []


def test_children_and_list(store: Storage) -> None:
    for key in ["b", "a/1", "a/2", "a/sub/x", "a.txt", "a0"]:
        store.write_atomic(key, key.encode())
    top = store.children()
    assert [(i.key, i.kind) for i in top] == [
        ("a", "dir"), ("a.txt", "file"), ("a0", "file"), ("b", "file"),
    ]
    assert [(i.key, i.kind, i.size) for i in store.children("a")] == [
        ("a/1", "file", 3), ("a/2", "file", 3), ("a/sub", "dir", 0),
    ]
    assert store.children("missing") == []
    # Recursive listing: files only, in key order on both backends.
    assert [i.key for i in store.list()] == ["a.txt", "a/1", "a/2", "a/sub/x", "a0", "b"]
    assert [i.key for i in store.list("a")] == ["a/1", "a/2", "a/sub/x"]
    assert all(i.kind == "file" for i in store.list())
    assert list(store.list("missing")) == []


def test_listing_past_one_thousand_entries(store: Storage) -> None:
    # S3 answers at most 1,000 keys or prefixes per page: both kinds must paginate.
    def put(i: int) -> None:
        key = f"many/f{i:04d}" if i % 2 else f"many/d{i:04d}/x"
        store.write_atomic(key, b"")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(1100)))
    kids = store.children("many")
    assert len(kids) == 1100
    assert sum(1 for i in kids if i.kind == "dir") == 550
    assert [i.key for i in kids] == sorted(i.key for i in kids)
    assert len(list(store.list("many"))) == 1100
    assert len(list(store.list())) == 1100


def test_stat(store: Storage) -> None:
    before = time.time()
    store.write_atomic("dir/obj", b"12345")
    info = store.stat("dir/obj")
    assert info is not None
    assert (info.key, info.size, info.kind) == ("dir/obj", 5, "file")
    assert before - 2 <= info.mtime <= time.time() + 2  # S3 keeps whole seconds
    assert store.stat("dir/nope") is None
    assert store.stat("nope/deeper") is None
    # Longer than a POSIX filesystem's 255-byte name: absent, not a storage failure (a hostile
    # index naming such a file once made `ls` exit 3).
    assert store.stat("dir/" + "x" * 300) is None and store.stat("y" * 300 + "/obj") is None
    d = store.stat("dir")
    assert d is not None and d.kind == "dir"


def test_stat_among_keys_it_prefixes(store: Storage) -> None:
    # On S3 a key is a prefix of its neighbours ("m.tmp", "m-1", "m/"): stat must tell the
    # object itself and a "directory" below it from keys that merely start alike.
    for key in ("m.tmp", "m-1", "mx", "m/y", "n.tmp", "o", "o.bak", "ox/y"):
        store.write_atomic(key, b"12")
    m = store.stat("m")
    assert m is not None and m.kind == "dir"
    assert store.stat("n") is None
    o = store.stat("o")
    assert o is not None and (o.kind, o.size) == ("file", 2)
    assert store.stat("o/x") is None


def test_stat_of_a_directory_listed_after_a_thousand_neighbours(store: Storage) -> None:
    # "q.0000" ... sort before "q/" ("." < "/"): past S3's 1,000 keys a page, the directory
    # is on the second page of the listing, and an absent key's answer must not stop early.
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: store.write_atomic(f"q.{i:04d}", b""), range(1001)))
    assert store.stat("q") is None
    store.write_atomic("q/z", b"")
    q = store.stat("q")
    assert q is not None and q.kind == "dir"


def test_ranged_reads(store: Storage) -> None:
    data = _pattern(1 * MiB + 123)
    store.write_atomic("blob", data)
    with store.open_reader("blob") as reader:
        assert reader.size == len(data)
        for offset, length in [(0, 10), (1000, 4096), (len(data) - 7, 7), (5, 0), (0, len(data))]:
            assert reader.read(offset, length) == data[offset : offset + length]
        buf = bytearray(300)
        reader.read_into(777, memoryview(buf)[100:])
        assert buf[100:] == data[777:977] and buf[:100] == bytes(100)
        # A typed view (what a tensor's buffer looks like) is addressed as bytes.
        doubles = array.array("d", bytes(64))
        reader.read_into(8, memoryview(doubles))
        assert doubles.tobytes() == data[8:72]
    assert store.read("blob") == data
    with pytest.raises(StorageError, match="larger than"):
        store.read("blob", max_size=10)


def test_compare_and_swap_writes_only_over_what_was_expected(store: Storage) -> None:
    """What a pointer mover relies on (``ops.repoint``; concurrent writers in tests/test_repoint.py)."""
    assert store.compare_and_swap("ptr", None, b"tag10") is None  # absent: created
    assert store.compare_and_swap("ptr", None, b"tag20") == b"tag10" and store.read("ptr") == b"tag10"
    assert store.compare_and_swap("ptr", b"tag1", b"tag20") == b"tag10"  # a prefix is not the content
    assert store.compare_and_swap("ptr", b"tag10", b"tag20") == b"tag10" and store.read("ptr") == b"tag20"
    assert store.compare_and_swap("ptr", b"tag10", b"tag30") == b"tag20" and store.read("ptr") == b"tag20"
    assert [i.key for i in store.list()] == ["ptr"]  # no temporary left, whatever the outcome
    local = store.local_path()
    if local is not None:  # a link under the name is never followed, nor replaced
        os.symlink("/dev/null", os.path.join(local, "link"))
        with pytest.raises(InvalidCheckpoint, match="symlink"):
            store.compare_and_swap("link", b"", b"x")
        assert os.path.islink(os.path.join(local, "link")) and sorted(os.listdir(local)) == ["link", "ptr"]


def test_truncated_read_is_invalid_checkpoint(store: Storage) -> None:
    store.write_atomic("short", b"0123456789")
    with store.open_reader("short") as reader:
        with pytest.raises(InvalidCheckpoint, match=r"truncated: wanted 8 bytes at offset 5, \w+ has 10") as info:
            reader.read(5, 8)
        assert store.url_of("short") in str(info.value)
        _assert_one_line_with_hint(info.value)
        with pytest.raises(InvalidCheckpoint, match="truncated"):
            reader.read(100, 1)


def test_open_reader_missing_is_not_found(store: Storage) -> None:
    with pytest.raises(NotFound) as info:
        store.open_reader("nope")
    assert store.url_of("nope") in str(info.value)
    _assert_one_line_with_hint(info.value)
    with pytest.raises(NotFound):
        store.open_reader("no/such/dir/file")


def test_writer_commit(store: Storage) -> None:
    data = _pattern(3 * MiB)
    writer = store.open_writer("step/shard")
    writer.write(data[:10])
    writer.write(bytearray(data[10 : 1 * MiB]))
    writer.write(memoryview(data)[1 * MiB :])
    assert store.stat("step/shard") is None  # nothing visible before commit
    writer.commit()
    assert store.read("step/shard") == data
    assert [i.key for i in store.list()] == ["step/shard"]  # no temporary left behind


def test_writer_accepts_typed_memoryview(store: Storage) -> None:
    values = array.array("f", [1.5, -2.0, 3.25])
    with store.open_writer("floats") as writer:
        writer.write(memoryview(values))
    assert store.read("floats") == values.tobytes()


def test_writer_abort_leaves_nothing(store: Storage) -> None:
    writer = store.open_writer("step/shard")
    writer.write(b"partial")
    writer.abort()
    writer.abort()  # idempotent
    assert store.stat("step/shard") is None
    assert list(store.list()) == []
    with pytest.raises(ValueError):
        writer.write(b"more")


def test_writer_context_manager_aborts_on_error(store: Storage) -> None:
    with pytest.raises(RuntimeError):
        with store.open_writer("x") as writer:
            writer.write(b"abc")
            raise RuntimeError("training crashed")
    assert store.stat("x") is None
    assert list(store.list()) == []


def test_writer_replaces_existing(store: Storage) -> None:
    store.write_atomic("k", b"old")
    with store.open_writer("k") as writer:
        writer.write(b"new!")
    assert store.read("k") == b"new!"


def test_write_atomic_replaces(store: Storage) -> None:
    store.write_atomic("marker", b"first")
    store.write_atomic("marker", b"second, longer")
    assert store.read("marker") == b"second, longer"
    store.write_atomic("marker", b"")
    assert store.read("marker") == b""


def test_write_if_absent(store: Storage) -> None:
    assert store.write_if_absent("lock", b"mine") is True
    assert store.write_if_absent("lock", b"theirs") is False
    assert store.read("lock") == b"mine"
    assert [i.key for i in store.list()] == ["lock"]


def test_write_if_absent_race_has_one_winner(store: Storage) -> None:
    racers = 8
    barrier = threading.Barrier(racers)

    def race(i: int) -> bool:
        barrier.wait()
        return store.write_if_absent("commit", f"rank {i}".encode())

    with ThreadPoolExecutor(racers) as pool:
        results = list(pool.map(race, range(racers)))
    assert results.count(True) == 1
    assert store.read("commit") == f"rank {results.index(True)}".encode()


def test_delete(store: Storage) -> None:
    store.write_atomic("d/a", b"1")
    assert store.delete("d/a") is True
    assert store.delete("d/a") is False
    assert store.delete("never/was") is False
    assert store.stat("d/a") is None


def test_remove_dir(store: Storage) -> None:
    store.write_atomic("ckpt/sub/a", b"1")
    store.write_atomic("ckpt/b", b"2")
    store.write_atomic("keep/c", b"3")
    store.remove_dir("ckpt")  # not empty: left alone, no error
    assert store.read("ckpt/sub/a") == b"1"
    for info in list(store.list("ckpt")):
        store.delete(info.key)
    store.remove_dir("ckpt")
    assert [i.key for i in store.children()] == ["keep"]
    store.remove_dir("absent")
    store.remove_dir("")
    assert store.read("keep/c") == b"3"


def test_abort_stale_uploads_removes_nothing_else(store: Storage) -> None:
    """Whatever the backend, only unfinished multipart uploads are aborted: committed objects
    and a writer still in progress (locally, its temporary file) are untouched."""
    store.write_atomic("step/kept", b"committed")
    pending = store.open_writer("step/pending")
    pending.write(b"in progress")
    before = sorted(i.key for i in store.list())
    assert store.abort_stale_uploads(idle_for_s=0, keys=["step/kept", "step/pending"]) == []
    assert store.abort_stale_uploads("step", idle_for_s=0, where=lambda key: True, dry_run=True) == []
    assert sorted(i.key for i in store.list()) == before
    pending.commit()
    assert store.read("step/pending") == b"in progress" and store.read("step/kept") == b"committed"
    with pytest.raises(InvalidCheckpoint):
        store.abort_stale_uploads("../x", idle_for_s=0)


# --- local only ----------------------------------------------------------------------------


@pytest.fixture
def local(tmp_path) -> LocalStorage:
    root = tmp_path / "root"
    root.mkdir()
    return LocalStorage(str(root))


def test_local_symlinked_file_is_refused_and_listed_as_link(local: LocalStorage, tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"outside")
    os.symlink(secret, local.local_path("shard"))
    with pytest.raises(InvalidCheckpoint, match="is a symlink; ckptctl does not follow links") as info:
        local.open_reader("shard")
    assert local.url_of("shard") in str(info.value)
    _assert_one_line_with_hint(info.value)
    assert [(i.key, i.kind) for i in local.children()] == [("shard", "link")]
    assert [(i.key, i.kind) for i in local.list()] == [("shard", "link")]
    st = local.stat("shard")
    assert st is not None and st.kind == "link"


def test_local_symlinked_directory_is_never_entered(local: LocalStorage, tmp_path) -> None:
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "f").write_bytes(b"outside")
    os.symlink(outside, local.local_path("step"))
    for call in [
        lambda: local.open_reader("step/deep/f"),
        lambda: local.sub("step").open_reader("deep/f"),
        lambda: local.write_atomic("step/new", b"x"),
        lambda: local.open_writer("step/deep/new"),
        lambda: local.write_if_absent("step/new", b"x"),
        lambda: local.delete("step/deep/f"),
        lambda: local.stat("step/deep/f"),
        lambda: local.children("step"),
    ]:
        with pytest.raises(InvalidCheckpoint, match="step is a symlink"):
            call()
    assert [(i.key, i.kind) for i in local.children()] == [("step", "link")]
    assert [(i.key, i.kind) for i in local.list()] == [("step", "link")]
    assert sorted(os.listdir(outside)) == ["deep"]
    assert (outside / "deep" / "f").read_bytes() == b"outside"


def test_local_root_may_be_a_symlink(tmp_path) -> None:
    real = tmp_path / "big-volume"
    real.mkdir()
    os.symlink(real, tmp_path / "ckpt")
    store = LocalStorage(str(tmp_path / "ckpt"))
    store.write_atomic("step_1/marker", b"ok")
    assert store.read("step_1/marker") == b"ok"
    assert (real / "step_1" / "marker").read_bytes() == b"ok"
    assert store.local_path("step_1/marker") == str(tmp_path / "ckpt" / "step_1" / "marker")


def test_local_delete_removes_the_link_not_its_target(local: LocalStorage, tmp_path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    os.symlink(target, local.local_path("link"))
    assert local.delete("link") is True
    assert not os.path.lexists(local.local_path("link"))
    assert target.read_bytes() == b"precious"


def test_local_write_replaces_a_link_instead_of_writing_through_it(local: LocalStorage, tmp_path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    os.symlink(target, local.local_path("marker"))
    assert local.write_if_absent("marker", b"new") is False  # a link counts as existing
    local.write_atomic("marker", b"new")
    assert not os.path.islink(local.local_path("marker"))
    assert local.read("marker") == b"new"
    assert target.read_bytes() == b"precious"


def test_local_delete_refuses_directories(local: LocalStorage) -> None:
    local.write_atomic("d/f", b"")
    with pytest.raises(StorageError, match="is a directory") as info:
        local.delete("d")
    _assert_one_line_with_hint(info.value)


def test_local_remove_dir_never_leaves_the_root(tmp_path) -> None:
    outside = tmp_path / "outside"
    (outside / "empty" / "nested").mkdir(parents=True)
    root = tmp_path / "root"
    (root / "ckpt" / "empty").mkdir(parents=True)
    os.symlink(outside, root / "ckpt" / "link")
    os.symlink(outside, root / "toplink")
    store = LocalStorage(str(root))
    store.remove_dir("ckpt")
    store.remove_dir("toplink")
    store.remove_dir("")
    assert (outside / "empty" / "nested").is_dir()
    assert os.path.islink(root / "ckpt" / "link") and os.path.islink(root / "toplink")
    assert not (root / "ckpt" / "empty").exists()  # our own empty dir went
    os.unlink(root / "ckpt" / "link")
    os.unlink(root / "toplink")
    store.sub("ckpt").remove_dir("")  # a sub() may remove its own (empty) root...
    assert not (root / "ckpt").exists()
    store.remove_dir("")  # ...but the user's root stays
    assert root.is_dir()


def test_local_writer_uses_hidden_temporary_in_final_directory(local: LocalStorage) -> None:
    writer = local.open_writer("step/shard")
    writer.write(b"abc")
    names = os.listdir(local.local_path("step"))
    assert len(names) == 1 and names[0].startswith(".shard.tmp-")
    writer.commit()
    assert os.listdir(local.local_path("step")) == ["shard"]


def _cached(path: str, offset: int, length: int) -> bool | None:
    """Whether the range is in the page cache (a RWF_NOWAIT read succeeds), None if unknown."""
    if not hasattr(os, "RWF_NOWAIT"):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(length)], offset, os.RWF_NOWAIT) == length
    except BlockingIOError:
        return False
    except OSError:
        return None  # RWF_NOWAIT not supported for this file
    finally:
        os.close(fd)


def test_local_write_behind_keeps_bytes_and_leaves_the_cache(local: LocalStorage) -> None:
    # Odd-sized pieces across several write-behind windows: every byte must land where it was
    # written, and the committed file must not stay in the page cache (it is on disk).
    size = 3 * (WRITE_BEHIND or 32 * MiB) + 12345
    data = _pattern(size, seed=7)
    with local.open_writer("step/big") as writer:
        for pos in range(0, size, 7 * MiB + 3):
            writer.write(memoryview(data)[pos : pos + 7 * MiB + 3])
    path = local.local_path("step/big")
    with open(path, "rb") as f:
        assert f.read() == data
    local.write_atomic("step/small", b"x" * 4096)
    small = local.local_path("step/small")
    if _cached(small, 0, 4096) is None:
        pytest.skip("this filesystem does not answer RWF_NOWAIT reads")
    assert _cached(small, 0, 4096)  # small files are left in the cache
    local.delete("step/big")
    with local.open_writer("step/big") as writer:
        writer.write(data)
    assert _cached(path, 0, 1 << 20) is False
    assert _cached(path, size - (1 << 20), 1 << 20) is False


def test_local_write_behind_bounds_the_cache_while_writing(local: LocalStorage) -> None:
    # Memory bounded by a few windows, not the file: while a large file is still being written,
    # its first window is already on disk and out of the page cache, its newest still cached.
    if not WRITE_BEHIND:
        pytest.skip("write-behind turned off (CKPTCTL_WRITE_BEHIND_MIB=0)")
    window = WRITE_BEHIND
    with local.open_writer("step/big") as writer:
        for i in range(WRITE_BEHIND_LAG + 3):
            writer.write(_pattern(window, seed=i))
        (tmp,) = [e.path for e in os.scandir(local.local_path("step")) if e.name.startswith(".big.tmp-")]
        first = _cached(tmp, 0, 1 << 20)
        if first is None:
            pytest.skip("this filesystem does not answer RWF_NOWAIT reads")
        assert first is False
        assert _cached(tmp, (WRITE_BEHIND_LAG + 3) * window - (1 << 20), 1 << 20)


def test_local_writer_overwrite_replaces_written_bytes_only(local: LocalStorage) -> None:
    with local.open_writer("f") as writer:
        writer.write(b"HEADER--" + b"data" * 4)
        with pytest.raises(ValueError, match="outside"):
            writer.overwrite(20, b"past the end")  # only bytes already written
        writer.overwrite(0, b"header")
    assert local.read("f") == b"header--" + b"data" * 4


def test_local_reader_keeps_file_open(local: LocalStorage) -> None:
    local.write_atomic("f", b"still here")
    with local.open_reader("f") as reader:
        local.delete("f")  # a concurrent prune
        assert reader.read(0, 10) == b"still here"


def test_local_refuses_non_regular_files(local: LocalStorage) -> None:
    local.write_atomic("d/f", b"")
    with pytest.raises(InvalidCheckpoint, match="is a directory"):
        local.open_reader("d")
    os.mkfifo(local.local_path("fifo"))
    with pytest.raises(InvalidCheckpoint, match="not a regular file"):
        local.open_reader("fifo")  # must not hang waiting for a FIFO writer


def test_local_disk_full_is_storage_error_and_leaves_nothing(tmp_path) -> None:
    with tmpfs("1m") as mountpoint:
        store = LocalStorage(os.path.join(mountpoint, "root"))
        with pytest.raises(StorageError, match="disk full while writing") as info:
            with store.open_writer("step/shard") as writer:
                for _ in range(8):
                    writer.write(bytes(256 * 1024))
        assert store.url_of("step/shard") in str(info.value)
        assert "uncommitted" in (info.value.hint or "")
        _assert_one_line_with_hint(info.value)
        assert os.listdir(store.local_path("step")) == []  # the temporary was removed
        with pytest.raises(StorageError, match="disk full"):
            store.write_atomic("marker", bytes(2 * MiB))
        store.write_atomic("small", b"fits")  # space came back
        assert store.read("small") == b"fits"


@contextlib.contextmanager
def _unprivileged() -> Iterator[None]:
    """Run the block without root's permission override (we run as root in CI sandboxes)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)  # nobody; the real uid stays 0, so we can switch back
    try:
        yield
    finally:
        os.seteuid(0)


def test_local_permission_denied_is_storage_error() -> None:
    base = tempfile.mkdtemp(prefix="ckptctl-perm-")
    try:
        os.chmod(base, 0o755)
        readonly = os.path.join(base, "readonly")
        os.mkdir(readonly, 0o555)
        secret = os.path.join(base, "secret")
        with open(secret, "wb") as f:
            f.write(b"x")
        os.chmod(secret, 0o600)
        with _unprivileged():
            with pytest.raises(StorageError, match="permission denied") as info:
                LocalStorage(readonly).write_atomic("step/marker", b"x")
            assert "readonly/step/marker" in str(info.value)
            _assert_one_line_with_hint(info.value)
            with pytest.raises(StorageError, match="permission denied"):
                LocalStorage(base).open_reader("secret")
    finally:
        shutil.rmtree(base)


# --- S3 only -------------------------------------------------------------------------------


def _bucket_and_prefix(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    return bucket, prefix


def _raw_client(s3_server: str):
    """A client straight to moto, to set up and look behind the code under test (on a directory
    bucket too: no session asked of a store that has none)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=s3_server, config=Config(s3={"disable_s3_express_session_auth": True}))


@pytest.fixture(params=["s3", "express"])
def bucket_url(request: pytest.FixtureRequest) -> str:
    """A general-purpose bucket, and a directory bucket (emulated), for the uploads' tests: the
    listings of unfinished uploads are what differ."""
    return request.getfixturevalue("s3_url" if request.param == "s3" else "express_url")


def test_part_size_grows_to_cover_s3_object_limit() -> None:
    sizes = [part_size_for(MIN_PART_SIZE, n) for n in range(1, MAX_PARTS + 1)]
    assert sizes[0] == MIN_PART_SIZE and sizes[999] == MIN_PART_SIZE and sizes[1000] == 2 * MIN_PART_SIZE
    assert sum(sizes) >= int(4.8 * (1 << 40))  # ~S3's 5 TiB object cap, with no size hint
    assert max(part_size_for(1 << 30, n) for n in range(1, MAX_PARTS + 1)) == MAX_PART_SIZE
    with pytest.raises(UsageError):
        S3Storage("s3://bucket/x", part_size=1 * MiB)


def _open_upload(raw, bucket: str, key: str, *, part: bool) -> str:
    """An upload left open, as a killed writer leaves it: with a part uploaded now (moto dates
    it now), or none (moto reports every upload as initiated in 2010: idle for years)."""
    upload_id = raw.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    if part:
        raw.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * 1024)
    return upload_id


def _open_keys(raw, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_s3_abort_stale_uploads_idle_named_and_filtered(bucket_url: str, s3_server: str) -> None:
    store = open_storage(bucket_url)
    raw = _raw_client(s3_server)
    bucket, prefix = _bucket_and_prefix(bucket_url)
    for key, part in [("a/dead", False), ("a/live", True), ("b/named", True), ("b/other", False), ("c/dead", False)]:
        _open_upload(raw, bucket, f"{prefix}/{key}", part=part)
    _open_upload(raw, bucket, "outside/dead", part=False)  # not below the storage: never seen
    everything = _open_keys(raw, bucket)

    # Idle for an hour: only the upload without a fresh part, and only below the prefix asked.
    assert store.abort_stale_uploads("a", idle_for_s=3600, dry_run=True) == ["a/dead"]
    assert _open_keys(raw, bucket) == everything  # a dry run aborts nothing
    # A key about to be written is aborted whatever its age; `where` filters the idle ones.
    got = store.abort_stale_uploads(idle_for_s=3600, keys=["b/named"], where=lambda key: not key.startswith("c/"))
    assert got == ["a/dead", "b/named", "b/other"]
    assert _open_keys(raw, bucket) == sorted([f"{prefix}/a/live", f"{prefix}/c/dead", "outside/dead"])
    assert store.sub("c").abort_stale_uploads(idle_for_s=3600) == ["dead"]  # keys relative to the storage
    assert store.abort_stale_uploads(idle_for_s=3600) == []  # the live one stays


def test_s3_writer_aborts_an_open_upload_of_its_key(s3_small_parts: S3Storage, bucket_url: str, s3_server: str) -> None:
    """A killed writer's upload of the same key, however fresh, is aborted by the next writer
    of the key; an upload of another key is not. The object records who wrote it."""
    raw = _raw_client(s3_server)
    bucket, prefix = _bucket_and_prefix(bucket_url)
    _open_upload(raw, bucket, f"{prefix}/step/shard", part=True)
    _open_upload(raw, bucket, f"{prefix}/step/shard2", part=True)  # a live writer of another key
    _open_upload(raw, bucket, f"{prefix}/step/shard.bak", part=True)  # same prefix, another key
    data = _pattern(12 * MiB, seed=5)
    with s3_small_parts.open_writer("step/shard") as writer:
        writer.write(data)
    assert _open_keys(raw, bucket) == [f"{prefix}/step/shard.bak", f"{prefix}/step/shard2"]
    assert s3_small_parts.read("step/shard") == data
    meta = raw.head_object(Bucket=bucket, Key=f"{prefix}/step/shard")["Metadata"]
    assert meta["ckptctl-pid"] == str(os.getpid()) and meta["ckptctl-host"] and meta["ckptctl-started"]


def test_s3_a_directory_only_an_unfinished_upload_holds_is_not_listed(bucket_url: str, s3_server: str) -> None:
    """A directory bucket lists the prefixes unfinished uploads hold; a save in progress (or a
    killed one) must not look like a checkpoint directory there either."""
    store = open_storage(bucket_url)
    raw = _raw_client(s3_server)
    bucket, prefix = _bucket_and_prefix(bucket_url)
    store.write_atomic("kept/x", b"1")
    store.write_atomic("both", b"2")  # a file, and a directory only an upload holds
    for key in ("pending/x", "kept/y", "both/x", "deep/er/x"):
        _open_upload(raw, bucket, f"{prefix}/{key}", part=True)
    assert [(i.key, i.kind) for i in store.children()] == [("both", "file"), ("kept", "dir")]
    assert store.children("deep") == [] and store.stat("pending") is None and store.stat("deep") is None
    assert [i.key for i in store.list()] == ["both", "kept/x"]


@pytest.fixture
def s3_small_parts(bucket_url: str) -> S3Storage:
    return S3Storage(
        bucket_url,
        multipart_threshold=5 * MiB,
        part_size=5 * MiB,
        read_chunk_size=1 * MiB,
        read_concurrency=4,
    )


def _uploads_once_created(raw, bucket: str) -> list[dict]:
    """The bucket's unfinished uploads, once there is one: a writer creates its upload on its
    part pool while the bytes arrive, so it may not exist yet when ``write`` returns."""
    for _ in range(200):
        uploads = raw.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        if uploads:
            return uploads
        time.sleep(0.05)
    return []


def test_s3_multipart_upload_commit(s3_small_parts: S3Storage, bucket_url: str, s3_server: str) -> None:
    store = s3_small_parts
    raw = _raw_client(s3_server)
    bucket, prefix = _bucket_and_prefix(bucket_url)
    data = _pattern(12 * MiB, seed=3)
    writer = store.open_writer("step/shard")
    for start in range(0, len(data), 1 * MiB):
        writer.write(memoryview(data)[start : start + 1 * MiB])
    assert store.stat("step/shard") is None  # parts uploaded, object not yet visible
    assert len(_uploads_once_created(raw, bucket)) == 1
    writer.commit()
    assert raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    head = raw.head_object(Bucket=bucket, Key=f"{prefix}/step/shard")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].endswith('-3"')  # 5 + 5 + 2 MiB
    with store.open_reader("step/shard") as reader:
        for offset, length in [(5 * MiB - 10, 20), (10 * MiB - 1, 2 * MiB + 1), (0, 1)]:
            assert reader.read(offset, length) == data[offset : offset + length]
        whole = bytearray(len(data))  # 12 ranged GETs of 1 MiB, four at a time
        reader.read_into(0, memoryview(whole))
        assert whole == data


def test_s3_multipart_abort_leaves_no_parts(s3_small_parts: S3Storage, bucket_url: str, s3_server: str) -> None:
    raw = _raw_client(s3_server)
    bucket, _ = _bucket_and_prefix(bucket_url)
    writer = s3_small_parts.open_writer("a")
    writer.write(bytes(12 * MiB))
    assert len(_uploads_once_created(raw, bucket)) == 1
    writer.abort()
    assert raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert s3_small_parts.stat("a") is None

    with pytest.raises(RuntimeError):
        with s3_small_parts.open_writer("b") as writer:
            writer.write(bytes(11 * MiB))
            raise RuntimeError("rank died")
    assert raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert list(s3_small_parts.list()) == []


def test_s3_failed_part_fails_the_writer(
    s3_small_parts: S3Storage, bucket_url: str, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # moto answers a part for an aborted upload with a 500 (AWS: 404 NoSuchUpload), which
    # botocore would retry with backoff; one attempt keeps the test fast.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    raw = _raw_client(s3_server)
    bucket, _ = _bucket_and_prefix(bucket_url)
    writer = s3_small_parts.open_writer("a")
    writer.write(bytes(6 * MiB))  # past the threshold: the upload exists, part 1 is going up
    (upload,) = _uploads_once_created(raw, bucket)
    # Another process (a lifecycle rule, an operator) aborts it: the next part must fail.
    raw.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    with pytest.raises(StorageError) as info:
        writer.write(bytes(5 * MiB))
        writer.commit()
    assert s3_small_parts.url_of("a") in str(info.value)
    _assert_one_line_with_hint(info.value)
    with pytest.raises(ValueError):
        writer.write(b"x")  # the writer aborted itself
    assert s3_small_parts.stat("a") is None
    assert raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_s3_below_threshold_is_one_put(s3_small_parts: S3Storage, bucket_url: str, s3_server: str) -> None:
    raw = _raw_client(s3_server)
    bucket, prefix = _bucket_and_prefix(bucket_url)
    with s3_small_parts.open_writer("small") as writer:
        writer.write(bytes(5 * MiB))  # exactly the threshold
    head = raw.head_object(Bucket=bucket, Key=f"{prefix}/small")
    assert "-" not in head["ETag"]


def test_s3_object_replaced_while_reading(s3_url: str) -> None:
    store = open_storage(s3_url)
    store.write_atomic("k", b"version one")
    with store.open_reader("k") as reader:
        store.write_atomic("k", b"version two")
        with pytest.raises(InvalidCheckpoint, match="changed while being read"):
            reader.read(0, 4)


def test_s3_missing_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    store = open_storage("s3://ckptctl-no-such-bucket/x")
    with pytest.raises(StorageError, match="bucket ckptctl-no-such-bucket does not exist") as info:
        store.children()
    _assert_one_line_with_hint(info.value)


def test_s3_no_credentials(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    for name in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"]:
        monkeypatch.delenv(name, raising=False)
    store = open_storage("s3://some-bucket/x")
    with pytest.raises(StorageError, match=r"no AWS credentials found for s3://some-bucket/x/k") as info:
        store.stat("k")
    assert "AWS_PROFILE" in (info.value.hint or "")


def test_s3_unreachable_endpoint(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # standard config; keeps the test fast
    store = S3Storage("s3://bucket/x", endpoint_url=f"http://127.0.0.1:{port}")
    with pytest.raises(StorageError, match=f"cannot reach http://127.0.0.1:{port}") as info:
        store.stat("k")
    _assert_one_line_with_hint(info.value)


def test_s3_sub_storages_share_one_client(s3_url: str) -> None:
    store = open_storage(s3_url)
    assert isinstance(store, S3Storage)
    store.write_atomic("a/b", b"x")
    child = store.sub("a")
    assert child.read("b") == b"x"
    assert child._client is store._client
    assert open_storage(s3_url)._client is store._client


class _DroppingProxy:
    """A TCP proxy to the S3 server that cuts ranged-GET responses mid-body, the way a flaky
    network does, so the reader's re-issue runs against real sockets."""

    def __init__(self, upstream: str, drops: int, after: int = 64 * 1024) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self.drops_left = drops
        self.dropped = 0
        self._after = after
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, responses: bool) -> None:
        cut_at: int | None = None
        sent = 0
        try:
            while data := src.recv(65536):
                if responses and cut_at is None and b" 206 " in data[:64]:
                    with self._lock:
                        if self.drops_left > 0:
                            self.drops_left -= 1
                            self.dropped += 1
                            cut_at = sent + self._after
                if cut_at is not None and sent + len(data) >= cut_at:
                    dst.sendall(data[: cut_at - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def test_s3_ranged_get_resumes_after_stream_drop(s3_url: str, s3_server: str) -> None:
    data = _pattern(1 * MiB, seed=5)
    open_storage(s3_url).write_atomic("shard", data)
    proxy = _DroppingProxy(s3_server, drops=2)
    try:
        store = S3Storage(s3_url, endpoint_url=proxy.url, read_concurrency=1)
        with store.open_reader("shard") as reader:
            assert reader.read(0, len(data)) == data
        assert proxy.dropped == 2
    finally:
        proxy.close()


def test_s3_ranged_get_gives_up_after_repeated_drops(s3_url: str, s3_server: str) -> None:
    open_storage(s3_url).write_atomic("shard", bytes(1 * MiB))
    proxy = _DroppingProxy(s3_server, drops=1000)
    try:
        store = S3Storage(s3_url, endpoint_url=proxy.url, read_concurrency=1)
        with store.open_reader("shard") as reader:
            with pytest.raises(StorageError, match="connection dropped 6 times") as info:
                reader.read(0, 1 * MiB)
        _assert_one_line_with_hint(info.value)
    finally:
        proxy.close()
