"""Give back the disk that the in-process moto server holds for tests that are over.

moto stores each object, and each part of a multipart upload, in a ``SpooledTemporaryFile``
that spills to an unlinked file in ``/tmp`` past 8 MiB. The S3 tests' server lives for the
whole session in each xdist worker and no test deleted its bucket, so a suite run held every
checkpoint it left in S3 on disk, invisible to ``du`` (the files are unlinked), until CI's disk
filled and 274 tests failed with ENOSPC. Forgetting a bucket is not enough either: moto keeps a
reference to every object it ever made (``FakeKey.instances_tracked``), so the files of a
forgotten bucket stay open until someone closes them.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator


def _backends() -> Iterator[Any]:
    models = sys.modules.get("moto.s3.models")
    if models is None:  # no S3 test ran in this process
        return
    for regions in list(models.s3_backends.values()):
        yield from list(regions.values())


def drop_bucket(name: str) -> None:
    """Forget bucket ``name`` in this process's moto, objects and open uploads included."""
    for backend in _backends():
        backend.buckets.pop(name, None)
    release_unreachable()


def _reachable() -> set[int]:
    live: set[int] = set()

    def multipart(mp: Any) -> None:
        live.add(id(mp))
        live.update(id(part) for part in mp.parts.values())

    for backend in _backends():
        for bucket in list(backend.buckets.values()):
            for _, versions in list(bucket.keys.iterlists()):
                for key in versions:
                    live.add(id(key))
                    if getattr(key, "multipart", None) is not None:
                        multipart(key.multipart)
            for mp in list(bucket.multiparts.values()):
                multipart(mp)
    return live


def release_unreachable() -> None:
    """Close the temporary files of every object and upload no bucket holds any more."""
    models = sys.modules.get("moto.s3.models")
    if models is None:
        return
    live = _reachable()
    for cls in (models.FakeKey, models.FakeMultipart):
        tracked = cls.instances_tracked
        kept = [obj for obj in tracked if id(obj) in live]
        for obj in tracked:
            if id(obj) not in live:
                obj.dispose()
        tracked[:] = kept
