"""A multipart upload reuses its part buffers (``S3Writer``): a buffer whose part is uploaded
takes a later part's bytes, so an upload touches a bounded amount of new memory whatever the
object's size, and every byte still arrives where it belongs (moto's server over HTTP)."""

from __future__ import annotations

import os

import pytest

from ckptctl.storage import open_storage

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
