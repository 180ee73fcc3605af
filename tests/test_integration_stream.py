"""``ckptctl.integrations.stream.StorageStream``: the tap (the seal's digest) sees exactly the
bytes written, in order, once, when large pieces are hashed on a helper thread while the
writing thread writes them (real files, real xxhash; the caller reuses its buffer at once)."""

from __future__ import annotations

import threading

import pytest

from ckptctl.format.seal import FileDigest
from ckptctl.integrations.stream import SMALL_WRITE, TAP_BESIDE, StorageStream
from ckptctl.layouts.seal_check import hash_object
from ckptctl.storage import open_storage

CHUNK = 1 << 20  # small chunks, so that pieces straddle chunk boundaries


def test_the_digest_is_the_file_on_disk_when_large_pieces_are_hashed_beside_the_write(tmp_path) -> None:
    st = open_storage(str(tmp_path))
    digest = FileDigest(CHUNK)
    threads: list[tuple[int, threading.Thread]] = []

    def tap(view: memoryview) -> None:
        threads.append((len(view), threading.current_thread()))
        digest.update(view)

    reused = bytearray(TAP_BESIDE + 12345)  # one buffer, rewritten after every write returns
    with StorageStream(st.open_writer("f.distcp"), tap=tap) as stream:
        for i in range(5):
            stream.write(b"h" * (i + 7))  # small pieces: gathered
            reused[:] = bytes([i]) * len(reused)
            stream.write(reused)  # large: hashed on the helper while written
            stream.write(memoryview(reused)[: SMALL_WRITE + 1])  # mid-sized: inline
        reused[:] = b"\xff" * len(reused)  # what a caller does with its buffer once write returned

    got = hash_object(st, "f.distcp", CHUNK)
    assert got is not None
    entry = digest.sealed("f.distcp")
    assert (entry.size, entry.xxh3, entry.chunks) == (got.size, got.xxh3, got.chunks)  # every chunk's too
    large = [t for n, t in threads if n >= TAP_BESIDE]
    assert len(large) == 5 and all(t is not threading.current_thread() for t in large)
    assert [t.name for t in threading.enumerate() if t.name.startswith("ckptctl-tap")] == []  # stopped on close


def test_a_failing_write_leaves_nothing_and_stops_the_helper(tmp_path) -> None:
    st = open_storage(str(tmp_path))
    tapped: list[int] = []
    with pytest.raises(RuntimeError, match="the stack failed"):
        with StorageStream(st.open_writer("f.distcp"), tap=lambda v: tapped.append(len(v))) as stream:
            stream.write(bytes(TAP_BESIDE))
            raise RuntimeError("the stack failed")
    assert tapped == [TAP_BESIDE]
    assert [i.key for i in st.list()] == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("ckptctl-tap")] == []
