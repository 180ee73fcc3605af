"""``format.seal.FileDigest``: a seal entry computed from bytes as they stream past (what the
integrations' writers and ``hash_object`` use) equals the one computed from the whole file, for
every size around the chunk boundaries and any way the bytes are cut into pieces."""

from __future__ import annotations

import os
import random

import pytest

from ckptctl.format.checksum import digest
from ckptctl.format.seal import FileDigest, chunk_count

CHUNK = 1 << 16


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 5, 3 * CHUNK - 1, 5 * CHUNK])
def test_streamed_digest_equals_the_whole_file_one(size: int) -> None:
    data = os.urandom(size)
    want = tuple(digest(data[i:i + CHUNK]) for i in range(0, size, CHUNK)) if chunk_count(size, CHUNK) else ()
    rng = random.Random(size)
    for _ in range(4):
        streamed = FileDigest(CHUNK)
        at = 0
        while at < size:
            n = rng.choice([1, 7, 4096, CHUNK // 3, CHUNK, 2 * CHUNK + 3])
            streamed.update(memoryview(data)[at:at + n])
            at += n
        got = streamed.sealed("f")
        assert (got.name, got.size, got.xxh3, got.chunks) == ("f", size, digest(data), want)
