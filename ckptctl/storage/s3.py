"""The S3 backend: ``s3://bucket/prefix`` on boto3, for AWS and S3-compatible stores.

This module holds ``S3Storage``: addressing, listing, stat, delete and the one-PUT writes.
Around it, by concept:

* ``s3_client``: building, caching and sharing botocore clients from boto3's own
  configuration (credential chain, ``AWS_PROFILE``, region, ``AWS_ENDPOINT_URL``, retries).
* ``s3_bucket``: one bucket through one client: errors translated, request checksums,
  conditional writes, and whether it is an S3 Express One Zone directory bucket (which takes
  listings only below "/"-ended prefixes and answers them in no order). The modules below take a ``Bucket``, never an ``S3Storage``.
* ``s3_errors``: classifying botocore's errors and translating them into ckptctl's tree.
* ``s3_transfer``: the multipart ``S3Writer``. Writes are visible only when complete, as S3
  itself guarantees; a failed multipart upload is aborted so no orphaned parts are left to
  pay for. ``s3_reader``: the ranged, parallel ``S3Reader``.
* ``s3_uploads``: the uploads a killed writer left open: a new writer of the same key aborts
  them, and ``abort_stale_uploads`` those idle for longer than a bound.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterator

from botocore.exceptions import ClientError

from ckptctl.errors import InvalidCheckpoint, NotFound, StorageError, UsageError
from ckptctl.storage.base import ObjectInfo, Storage, check_key
from ckptctl.storage.s3_bucket import Bucket
from ckptctl.storage.s3_client import Client
from ckptctl.storage.s3_errors import is_missing, s3_error
from ckptctl.storage.s3_uploads import abort_idle, upload_keys
from ckptctl.storage.s3_reader import S3Reader, get_small
from ckptctl.storage.s3_transfer import (
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    PART_GROWTH_EVERY,
    S3Writer,
    TransferOptions,
    part_size_for,
)

__all__ = [
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "PART_GROWTH_EVERY",
    "S3Reader",
    "S3Storage",
    "S3Writer",
    "parse_s3_url",
    "part_size_for",
    "s3_error",
]

def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ("bucket", "a/b"). Raises UsageError for a malformed URL."""
    if not url.startswith("s3://"):
        raise UsageError(f"{url} is not an s3:// URL", hint="write s3://BUCKET/PREFIX")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise UsageError(f"{url} names no bucket", hint="write s3://BUCKET/PREFIX")
    try:
        check_key(prefix, allow_empty=True)
    except InvalidCheckpoint:
        raise UsageError(
            f"{url}: the prefix has empty, '.' or '..' components",
            hint="write s3://BUCKET/PREFIX with single slashes",
        ) from None
    return bucket, prefix


class S3Storage(Storage):
    """Objects below ``s3://bucket/prefix``.

    ``multipart_threshold``: objects up to this size are one PUT; larger ones are uploaded in
    parts. ``part_size``: the part size (at least 5 MiB) of an object up to 10,000 parts whose
    size the writer is told (``Writer.expect``: every save and copy), larger ones in parts
    just large enough to fit S3's 10,000; a write of unknown size starts at it and doubles it
    every 1,000 parts. ``max_inflight_parts``: parts uploaded at once per writer, which also
    bounds a writer's memory to about ``(max_inflight_parts + 1)`` parts once past the
    threshold.
    ``read_chunk_size`` / ``read_concurrency``: a read larger than one chunk is split into
    ranged GETs run in parallel, each filling its own slice of the caller's buffer; a caller
    streaming an object piece by piece (a copy, a verify) keeps ``read_concurrency`` pieces in
    flight (``Reader.reads_in_flight``).
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        # 8 MiB parts, 16 in flight: a store serves each connection at 50-100 MB/s, so one
        # large shard's upload scales with its parts in flight; a writer holds at most ~136 MiB
        # (docs/decisions.md, "S3: 8 MiB parts, 16 in flight").
        multipart_threshold: int = 16 << 20,
        part_size: int = 8 << 20,
        max_inflight_parts: int = 16,
        read_chunk_size: int = 32 << 20,
        # 8 GETs in flight per object streamed (a copy, a verify range): 8 connections' worth,
        # holding 9 pieces of 16 MiB; a large read splits into 32 MiB GETs, 8 at a time.
        read_concurrency: int = 8,
    ) -> None:
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise UsageError(
                f"part size {part_size} is outside S3's limits",
                hint=f"choose a part size between {MIN_PART_SIZE} and {MAX_PART_SIZE} bytes",
            )
        if multipart_threshold < 0 or max_inflight_parts < 1 or read_chunk_size < 1:
            raise UsageError(
                "multipart_threshold must be >= 0, max_inflight_parts and read_chunk_size >= 1",
                hint="fix the S3Storage arguments",
            )
        name, self._prefix = parse_s3_url(url)
        self.url = f"s3://{name}" + (f"/{self._prefix}" if self._prefix else "")
        self._opts = TransferOptions(
            multipart_threshold=multipart_threshold,
            part_size=part_size,
            max_inflight_parts=max_inflight_parts,
            read_chunk_size=read_chunk_size,
            read_concurrency=max(1, read_concurrency),
        )
        self._bucket = Bucket(name, endpoint_url)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    # --- addressing -----------------------------------------------------------------------

    def sub(self, key: str) -> "S3Storage":
        key = check_key(key)
        child = S3Storage.__new__(S3Storage)
        child._bucket = self._bucket
        child._prefix = self._obj_key(key)
        child.url = self.url_of(key)
        child._opts = self._opts
        return child

    def _obj_key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def _list_prefix(self, prefix: str) -> str:
        joined = self._obj_key(prefix) if prefix else self._prefix
        return joined + "/" if joined else ""

    @property
    def _client(self) -> Client:
        return self._bucket.client

    # --- listing ---------------------------------------------------------------------------

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        prefix = check_key(prefix, allow_empty=True)
        start = self._list_prefix(prefix)
        found: list[ObjectInfo] = []
        with self._bucket.errors(self.url_of(prefix)):
            pages = self._client.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket.name, Prefix=start, Delimiter="/"
            )
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    name = common["Prefix"][len(start) : -1]
                    if name:
                        found.append(ObjectInfo(_join(prefix, name), 0, 0.0, "dir"))
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(start) :]
                    if name:  # "" is a console-made "folder" marker for the prefix itself
                        found.append(_object_info(prefix, name, obj))
        if self._bucket.directory and any(info.kind == "dir" for info in found):
            hollow = self._held_by_uploads_only(prefix, start)
            found = [info for info in found if info.kind != "dir" or info.key not in hollow]
        return sorted(found, key=lambda info: info.key)

    def _held_by_uploads_only(self, prefix: str, start: str) -> set[str]:
        """The children of ``prefix`` that hold no object, only unfinished multipart uploads.
        A directory bucket lists them (an upload makes its directory), other buckets do not:
        a save in progress there looked like a partial checkpoint from 1970, which no
        listing of objects can tell apart. One ListMultipartUploads below ``prefix`` (none
        open: done), and a LIST of one key for each child an upload is under."""
        shown = self.url_of(prefix)
        keys = upload_keys(self._bucket, start, shown)
        busy = {key[len(start):].split("/", 1)[0] for key in keys or () if "/" in key[len(start):]}
        hollow: set[str] = set()
        with self._bucket.errors(shown):
            for name in busy:
                listed = self._client.s3.list_objects_v2(Bucket=self._bucket.name, Prefix=f"{start}{name}/", MaxKeys=1)
                if not listed.get("Contents"):
                    hollow.add(_join(prefix, name))
        return hollow

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix``, in key order: S3's listing order, except on a
        directory bucket, which lists in no order: there the whole listing is sorted first."""
        prefix = check_key(prefix, allow_empty=True)
        found = self._list(prefix)
        return iter(sorted(found, key=lambda info: info.key)) if self._bucket.directory else found

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        start = self._list_prefix(prefix)
        with self._bucket.errors(self.url_of(prefix)):
            pages = self._client.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket.name, Prefix=start
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(start) :]
                    if name and not name.endswith("/"):  # skip "folder" marker objects
                        yield _object_info(prefix, name, obj)

    def stat(self, key: str) -> ObjectInfo | None:
        """An object's size and mtime; for a key that is only a prefix of others, kind "dir"
        (as the local backend answers for a directory).

        One LIST (the key as prefix, "/" as delimiter) answers both: the object is the
        listing's own key, the "directory" its common prefix ``key/``. A HEAD answers only
        the first, so every miss cost a second request, in series: on the path of every
        commit (is the marker there?) and every copy. An object named ``key`` wins over
        keys below it, as a HEAD would find it.

        A directory bucket refuses that LIST (its prefix does not end in "/"): there a HEAD
        answers for the object, and only on a miss a LIST of ``key/`` (one key, no delimiter:
        a prefix that only unfinished uploads hold is no directory, as on other buckets)."""
        key = check_key(key)
        obj = self._obj_key(key)
        if self._bucket.directory:
            return self._stat_by_head(key, obj)
        below = obj + "/"
        with self._bucket.errors(self.url_of(key)):
            pages = self._client.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket.name, Prefix=obj, Delimiter="/"
            )
            for page in pages:
                contents, commons = page.get("Contents", []), page.get("CommonPrefixes", [])
                for found in contents:
                    if found["Key"] == obj:
                        return _object_info("", key, found)
                if any(common["Prefix"] == below for common in commons):
                    return ObjectInfo(key, 0, 0.0, "dir")
                # In key order: ``key`` itself comes first, and nothing after ``key/`` is either.
                seen = [found["Key"] for found in contents] + [common["Prefix"] for common in commons]
                if not seen or max(seen) > below:
                    break
        return None

    def _stat_by_head(self, key: str, obj: str) -> ObjectInfo | None:
        """``stat`` on a directory bucket: a HEAD, and on a miss a LIST of one key below it."""
        with self._bucket.errors(self.url_of(key)):
            try:
                head = self._client.s3.head_object(Bucket=self._bucket.name, Key=obj)
                return ObjectInfo(key, head["ContentLength"], head["LastModified"].timestamp(), etag=head.get("ETag"))
            except ClientError as err:
                if not is_missing(err):
                    raise
            below = self._client.s3.list_objects_v2(Bucket=self._bucket.name, Prefix=obj + "/", MaxKeys=1)
        return ObjectInfo(key, 0, 0.0, "dir") if below.get("Contents") else None

    # --- reading and writing ---------------------------------------------------------------

    def open_reader(self, key: str) -> S3Reader:
        key = check_key(key)
        shown = self.url_of(key)
        obj = self._obj_key(key)
        with self._bucket.errors(shown):
            head = self._client.s3.head_object(Bucket=self._bucket.name, Key=obj)
        return S3Reader(self._bucket, self._opts, obj, shown, head["ContentLength"], head.get("ETag"))

    def read_if_small(self, key: str, limit: int) -> tuple[bytes | None, int]:
        key = check_key(key)
        got = get_small(self._bucket, self._obj_key(key), self.url_of(key), limit)
        return got if got is not None else super().read_if_small(key, limit)

    def open_root_reader(self) -> S3Reader:
        if not self._prefix:
            raise NotFound(f"{self.url}: a bucket is not an object")
        with self._bucket.errors(self.url):
            head = self._client.s3.head_object(Bucket=self._bucket.name, Key=self._prefix)
        return S3Reader(self._bucket, self._opts, self._prefix, self.url, head["ContentLength"], head.get("ETag"))

    def open_writer(self, key: str) -> S3Writer:
        key = check_key(key)
        return S3Writer(self._bucket, self._opts, self._obj_key(key), self.url_of(key))

    def write_atomic(self, key: str, data: bytes) -> None:
        """One PUT: S3 makes it visible whole or not at all."""
        key = check_key(key)
        with self._bucket.errors(self.url_of(key)):
            self._client.s3.put_object(
                Bucket=self._bucket.name, Key=self._obj_key(key), Body=data, **self._bucket.checksum_args()
            )

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """A PUT with ``If-None-Match: *``. Stores that ignore the header (some older
        S3-compatible ones) overwrite instead; AWS S3, MinIO and Ceph RGW honour it."""
        key = check_key(key)
        return self._bucket.if_absent(self.url_of(key), lambda: self._client.s3.put_object(
            Bucket=self._bucket.name, Key=self._obj_key(key), Body=data, IfNoneMatch="*", **self._bucket.checksum_args()))

    def compare_and_swap(self, key: str, expected: bytes | None, data: bytes) -> bytes | None:
        """One conditional PUT: ``If-Match`` the ETag of the content just compared
        (``If-None-Match: *`` when it was absent), so S3 refuses it once anything else wrote.
        Refused, but the key holds exactly ``data``: the PUT had landed and a retry of it was
        refused (or another writer made the very same change), so it is swapped."""
        key = check_key(key)
        shown, obj = self.url_of(key), self._obj_key(key)
        limit = len(expected or b"") + 4096
        for _attempt in range(3):  # a rewrite of the same bytes meanwhile changes the ETag alone
            found, etag = None, None
            with self._bucket.errors(shown):
                try:
                    got = self._client.s3.get_object(Bucket=self._bucket.name, Key=obj)
                    etag, found = got["ETag"], got["Body"].read(limit)
                    got["Body"].close()
                except ClientError as err:
                    if not is_missing(err):
                        raise
            if found != expected:
                return found
            condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
            # ``if_absent`` runs any conditional request: False on a failed precondition (412)
            if self._bucket.if_absent(shown, lambda: self._client.s3.put_object(
                    Bucket=self._bucket.name, Key=obj, Body=data, **condition, **self._bucket.checksum_args())):
                return expected
            found = self._content(key, limit)
            if found == data:  # ours landed, its answer lost: botocore's retry met it (412)
                return expected
            if found != expected:
                return found
        raise StorageError(f"{shown} keeps being rewritten with the same content; not replaced",
                           hint="stop the other writer, then run the command again")

    # --- removing --------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """DELETE one object; a HEAD first tells whether it existed (S3's DELETE does not)."""
        key = check_key(key)
        obj = self._obj_key(key)
        with self._bucket.errors(self.url_of(key)):
            try:
                self._client.s3.head_object(Bucket=self._bucket.name, Key=obj)
            except ClientError as err:
                if is_missing(err):
                    return False
                raise
            self._client.s3.delete_object(Bucket=self._bucket.name, Key=obj)
        return True

    def remove_dir(self, prefix: str) -> None:
        """Nothing to do: a prefix with no objects does not exist on S3."""
        check_key(prefix, allow_empty=True)

    def abort_stale_uploads(
        self,
        prefix: str = "",
        *,
        idle_for_s: float,
        keys: Collection[str] = (),
        where: Callable[[str], bool] | None = None,
        dry_run: bool = False,
    ) -> list[str]:
        """Unfinished multipart uploads below ``prefix``: one LIST, plus a ListParts for each
        upload started longer than ``idle_for_s`` ago (see ``s3_uploads``)."""
        prefix = check_key(prefix, allow_empty=True)
        keys = {check_key(key) for key in keys}
        return abort_idle(self._bucket, self._list_prefix(prefix), self._list_prefix(""), self.url_of(prefix), idle_for_s=idle_for_s,
                          keys=keys, where=where, dry_run=dry_run)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _object_info(prefix: str, name: str, obj: dict[str, Any]) -> ObjectInfo:
    """An entry of a LIST answer's ``Contents``, keyed relative to the storage."""
    return ObjectInfo(_join(prefix, name), obj["Size"], obj["LastModified"].timestamp(), etag=obj.get("ETag"))
