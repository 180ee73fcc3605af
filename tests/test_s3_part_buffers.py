"""A multipart upload reuses its part buffers (``S3Writer``): a buffer whose part is uploaded
takes a later part's bytes, so an upload touches a bounded amount of new memory whatever the
object's size, and every byte still arrives where it belongs (moto's server over HTTP)."""

from __future__ import annotations

import os

import pytest

from ckptctl.storage import open_storage
from ckptctl.storage.base import Reader
from ckptctl.storage.local import LocalStorage

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part


@pytest.mark.parametrize("size", [6 * PART, 6 * PART + 123_457])  # whole parts only; a short last part
def test_parts_reuse_their_buffers_and_arrive_bitwise(s3_url, size):
    store = open_storage(s3_url, part_size=PART, multipart_threshold=PART, max_inflight_parts=2)
    bodies: list[int] = []

    def seen(params: dict, **_kw: object) -> None:
        bodies.append(id(params["Body"]))

    s3 = store._client.s3  # the client every writer of this storage uses
    s3.meta.events.register("provide-client-params.s3.UploadPart", seen)
    data = os.urandom(size)
    try:
        with store.open_writer("obj") as w:  # committed on leaving the block
            for pos in range(0, size, 3 * MiB + 7):  # writes that straddle part boundaries
                w.write(memoryview(data)[pos : pos + 3 * MiB + 7])
    finally:
        s3.meta.events.unregister("provide-client-params.s3.UploadPart", seen)
    assert len(bodies) == -(-size // PART)
    # In flight (2), being filled (1) and one sealed while both uploads run: at most 4 buffers.
    assert len(set(bodies)) <= 4, f"{len(set(bodies))} buffers for {len(bodies)} parts"
    out = bytearray(size)
    with store.open_reader("obj") as r:
        assert r.size == size
        r.read_into(0, memoryview(out))
    assert bytes(out) == data


class _ReadsRecorded(LocalStorage):
    """A source that records the buffers its file reads fill."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.filled: set[int] = set()

    def open_reader(self, key: str) -> Reader:
        reader = super().open_reader(key)
        inner, filled = reader.read_into, self.filled

        def read_into(offset: int, out: memoryview) -> None:
            filled.add(id(out.obj))
            inner(offset, out)

        reader.read_into = read_into  # type: ignore[method-assign]
        return reader


def test_a_copy_uploads_the_buffers_it_read_into(tmp_path, s3_url):
    # A copy reads each piece into a part buffer the S3 writer lends (``S3Writer.spare``),
    # checks it there, and the buffer goes out as the part: each byte copied once, by the
    # read. On main every piece was copied again into the writer's own buffers. At the default
    # part size (the copy's piece size), a 40 MiB shard: whole parts and a short last one.
    import torch

    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint

    state = {"w": torch.randn(10 * MiB)}
    with Checkpointer(str(tmp_path / "src")) as ck:
        ck.save(1, state).wait()
    src = _ReadsRecorded(str(tmp_path / "src" / step_dir(1)))
    dst = open_storage(s3_url)
    bodies: list[tuple[int, int]] = []

    def seen(params: dict, **_kw: object) -> None:
        bodies.append((id(params["Body"]), len(params["Body"])))

    s3 = dst._client.s3  # type: ignore[attr-defined]
    s3.meta.events.register("provide-client-params.s3.UploadPart", seen)
    try:
        copy_checkpoint(src, dst.sub(step_dir(1)))
    finally:
        s3.meta.events.unregister("provide-client-params.s3.UploadPart", seen)
    part = dst._opts.part_size  # type: ignore[attr-defined]
    size = sum(os.path.getsize(e.path) for e in os.scandir(tmp_path / "src" / step_dir(1)) if e.name.startswith("rank-"))
    whole = [body for body, n in bodies if n == part]
    assert len(bodies) == -(-size // part) and len(whole) == size // part >= 2, bodies
    assert all(body in src.filled for body in whole), "a whole part was copied out of the buffer it was read into"
    loaded = {"w": torch.zeros(10 * MiB)}
    with Checkpointer(s3_url) as ck:
        assert ck.load_latest(loaded) == 1
    assert torch.equal(loaded["w"], state["w"])


def test_lent_buffers_out_of_step_with_the_parts_are_copied_bitwise(s3_url):
    # ``hand_over`` takes a lent buffer as a part only when it is exactly the next part; a
    # byte written before shifts every piece against the parts, and each is then copied.
    store = open_storage(s3_url, part_size=PART, multipart_threshold=PART, max_inflight_parts=2)
    data = os.urandom(1 + 3 * PART)
    with store.open_writer("shifted") as w:
        assert w.spare(PART + 1) is None  # not a part's size: the caller uses its own memory
        w.expect(len(data))
        w.write(data[:1])
        for pos in range(1, len(data), PART):
            room = w.spare(PART)
            room[:] = data[pos : pos + PART]
            w.hand_over(room)
    assert store.read("shifted") == data


@pytest.mark.parametrize("publish", [False, True])
def test_an_object_below_the_threshold_is_only_the_bytes_written_when_a_part_buffer_was_pooled(s3_url, publish):
    """With a threshold above the part size, an object between the two is one PUT of its
    sealed parts and the start of the next; that next part's buffer may come from the pool at
    full size (an earlier upload's), and only what was written of it is the object's. Before,
    the PUT sent the whole pooled buffer: an object longer than what was written."""
    store = open_storage(s3_url, part_size=PART, multipart_threshold=4 * PART, max_inflight_parts=2)
    with store.open_writer("earlier") as w:  # a multipart upload: its part buffers go to the pool
        w.write(os.urandom(6 * PART))
    data = os.urandom(PART + 123_457)  # one whole part and a short one, below the threshold
    w = store.open_writer("obj")
    w.write(data)
    if publish:
        w.publish()
    else:
        w.commit()
    with store.open_reader("obj") as r:
        assert r.size == len(data)
        out = bytearray(len(data))
        r.read_into(0, memoryview(out))
    assert bytes(out) == data


def test_an_object_of_known_size_is_uploaded_in_parts_of_one_size(tmp_path, s3_url, monkeypatch):
    # Parts double every PART_GROWTH_EVERY parts so that an upload of unknown size fits in
    # 10,000; past that point (8 GiB at 8 MiB parts) a writer held parts twice as large and a
    # copy's pieces, read at the first part's size, no longer matched its parts: each was
    # copied into the writer's own buffers. A copy and a save know each file's size
    # (``expect``): every part is then one size, and every whole piece goes out as it was
    # read. Growth every 2 parts here stands in for every 1,000 (the same code, 5 GiB less).
    import torch

    import ckptctl.storage.s3_transfer as s3_transfer
    from ckptctl import Checkpointer
    from ckptctl.format.layout import step_dir
    from ckptctl.ops.transfer.copy import copy_checkpoint

    monkeypatch.setattr(s3_transfer, "PART_GROWTH_EVERY", 2)
    state = {"w": torch.randn(10 * MiB)}  # a 40 MiB shard: 8 parts of 5 MiB and a short one
    with Checkpointer(str(tmp_path / "src")) as ck:
        ck.save(1, state).wait()
    src = _ReadsRecorded(str(tmp_path / "src" / step_dir(1)))
    dst = open_storage(s3_url, part_size=PART, multipart_threshold=PART)
    bodies: list[tuple[int, int]] = []

    def seen(params: dict, **_kw: object) -> None:
        bodies.append((id(params["Body"]), len(params["Body"])))

    s3 = dst._client.s3  # type: ignore[attr-defined]
    s3.meta.events.register("provide-client-params.s3.UploadPart", seen)
    try:
        copy_checkpoint(src, dst.sub("copied").sub(step_dir(1)))
        with Checkpointer(f"{s3_url}/saved", storage=dst.sub("saved")) as ck:
            ck.save(1, state).wait()
    finally:
        s3.meta.events.unregister("provide-client-params.s3.UploadPart", seen)
    size = sum(os.path.getsize(e.path) for e in os.scandir(tmp_path / "src" / step_dir(1)) if e.name.startswith("rank-"))
    assert len(bodies) == 2 * -(-size // PART), [n for _, n in bodies]  # the copy's and the save's
    assert max(n for _, n in bodies) == PART, [n for _, n in bodies]
    copied = bodies[: len(bodies) // 2]
    assert all(body in src.filled for body, n in copied if n == PART), "a whole part was copied again"
    for where in ("copied", "saved"):
        loaded = {"w": torch.zeros(10 * MiB)}
        with Checkpointer(f"{s3_url}/{where}", storage=dst.sub(where)) as ck:
            assert ck.load_latest(loaded) == 1
        assert torch.equal(loaded["w"], state["w"])


def test_bytes_past_the_expected_size_go_on_in_growing_parts(s3_url, monkeypatch):
    import ckptctl.storage.s3_transfer as s3_transfer

    monkeypatch.setattr(s3_transfer, "PART_GROWTH_EVERY", 2)
    store = open_storage(s3_url, part_size=PART, multipart_threshold=PART, max_inflight_parts=2)
    sizes: list[int] = []
    s3 = store._client.s3  # type: ignore[attr-defined]

    def seen(params: dict, **_kw: object) -> None:
        sizes.append(len(params["Body"]))

    s3.meta.events.register("provide-client-params.s3.UploadPart", seen)
    data = os.urandom(7 * PART + 99)
    try:
        with store.open_writer("more") as w:
            w.expect(3 * PART)  # fewer than will come: still correct
            w.write(data)
    finally:
        s3.meta.events.unregister("provide-client-params.s3.UploadPart", seen)
    assert sizes[:3] == [PART] * 3 and sizes[3] >= PART and sum(sizes) == len(data), sizes
    assert store.read("more") == data


def test_uniform_part_size_fits_any_object_in_10000_parts():
    from ckptctl.storage.s3_transfer import MAX_PART_SIZE, MAX_PARTS, uniform_part_size

    base = 8 * MiB
    assert uniform_part_size(base, 1) == base
    assert uniform_part_size(base, MAX_PARTS * base) == base  # 78 GiB: 10,000 parts of 8 MiB
    assert uniform_part_size(base, MAX_PARTS * base + 1) == 2 * base
    for size in (100 << 30, 1 << 40, 5 << 40):
        part = uniform_part_size(base, size)
        assert part <= MAX_PART_SIZE and -(-size // part) <= MAX_PARTS and (part == base or -(-size // (part // 2)) > MAX_PARTS)
