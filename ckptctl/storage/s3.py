"""The S3 backend: ``s3://bucket/prefix`` on boto3, for AWS and S3-compatible stores.

Configuration is boto3's own and nothing else: the credential chain, ``AWS_PROFILE``, region,
``AWS_ENDPOINT_URL`` (or the ``endpoint_url=`` argument), ``AWS_RETRY_MODE`` /
``AWS_MAX_ATTEMPTS`` and ``AWS_REQUEST_CHECKSUM_CALCULATION``, from the environment or
``~/.aws/config``. Unset, retries default to botocore's "standard" mode with 10 attempts.

Retries are botocore's. The one loop of our own re-issues a ranged GET whose body stream broke
mid-read, from the byte where it broke: botocore retries a request, not a body being consumed.

Writes are visible only when complete, as S3 itself guarantees: small objects are one PUT on
``commit``; large ones are a multipart upload completed on ``commit`` and aborted on any
failure, so no orphaned parts are left to pay for. Uploads carry a CRC32 checksum (CRC32C
needs the optional awscrt package) so S3 refuses bytes corrupted on the way.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import boto3
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)

from ckptctl.errors import CkptError, InvalidCheckpoint, NotFound, StorageError, UsageError
from ckptctl.storage.base import ObjectInfo, Reader, Storage, Writer, byte_view, check_key

MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
# Part sizes double every this many parts, so an upload whose size is not known in advance
# still fits in 10,000 parts: from 5 MiB parts that reaches 4.9 TiB, about S3's 5 TiB cap.
PART_GROWTH_EVERY = 1_000

_BODY_CHUNK = 1 << 20  # urllib3 copies each readinto through a bytes object of this size
_STREAM_RETRIES = 5  # body streams that may break in a row before a read gives up
_CONFLICT_RETRIES = 5  # S3 answers 409 while another conditional PUT to the key is in flight

# Environment that changes what a client is (endpoint, identity, region, retries): clients are
# cached per distinct value so a test or a job that changes it gets a fresh one.
_CLIENT_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_RETRY_MODE",
    "AWS_MAX_ATTEMPTS",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
)


def part_size_for(base: int, part_number: int) -> int:
    """The size of part ``part_number`` (1-based) when parts start at ``base`` bytes."""
    return min(MAX_PART_SIZE, base << ((part_number - 1) // PART_GROWTH_EVERY))


# --- clients -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Client:
    s3: Any  # a botocore S3 client; thread-safe, shared by every storage with the same config
    checksum: str | None  # "CRC32", or None where the user set when_required
    endpoint: str


_clients: dict[tuple[str | None, ...], _Client] = {}
_clients_lock = threading.Lock()


def _shared_client(endpoint_url: str | None) -> _Client:
    key = (endpoint_url, *(os.environ.get(name) for name in _CLIENT_ENV))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = _make_client(endpoint_url)
        return client


def _make_client(endpoint_url: str | None) -> _Client:
    core = botocore.session.get_session()
    # An explicit Config outranks the user's settings, so pass theirs through where set.
    retries = {
        "mode": core.get_config_variable("retry_mode") or "standard",
        "total_max_attempts": core.get_config_variable("max_attempts") or 10,
    }
    config = Config(
        retries=retries,  # type: ignore[arg-type]
        connect_timeout=10,
        read_timeout=60,
        max_pool_connections=32,  # parallel parts and ranged reads of several writers
    )
    s3 = boto3.session.Session(botocore_session=core).client(
        "s3", endpoint_url=endpoint_url, config=config
    )
    # Stores that reject flexible checksums are served by AWS_REQUEST_CHECKSUM_CALCULATION=
    # when_required, the same switch that turns off botocore's own default checksums.
    wanted = core.get_config_variable("request_checksum_calculation") == "when_supported"
    return _Client(s3=s3, checksum="CRC32" if wanted else None, endpoint=s3.meta.endpoint_url)


class _ClientHolder:
    """Created lazily (constructing a storage touches no network and needs no credentials)
    and shared by a storage and every ``sub()`` of it."""

    def __init__(self, endpoint_url: str | None) -> None:
        self.endpoint_url = endpoint_url
        self._client: _Client | None = None

    def get(self) -> _Client:
        if self._client is None:
            self._client = _shared_client(self.endpoint_url)
        return self._client

    def endpoint(self) -> str:
        if self._client is not None:
            return self._client.endpoint
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or "the S3 endpoint"


# --- errors --------------------------------------------------------------------------------


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _status(err: ClientError) -> int:
    return int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _is_missing(err: ClientError) -> bool:
    return _code(err) in ("404", "NoSuchKey", "NotFound")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


_ACCESS_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_UNAVAILABLE = {"SlowDown", "503", "ServiceUnavailable", "RequestTimeout", "InternalError", "500"}


def s3_error(err: ClientError | BotoCoreError, shown: str, bucket: str, endpoint: str) -> CkptError:
    """Translate a botocore error about ``shown`` (an s3:// URL) into our tree."""
    if isinstance(err, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return StorageError(
            f"no AWS credentials found for {shown}",
            hint="set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or run where an instance or pod role provides them",
        )
    if isinstance(err, ProfileNotFound):
        return StorageError(
            f"{_one_line(err)} (needed for {shown})",
            hint="fix AWS_PROFILE or add the profile to ~/.aws/config",
        )
    if isinstance(err, (BotoConnectionError, HTTPClientError)):
        return StorageError(
            f"cannot reach {endpoint} for {shown}: {_one_line(err)}",
            hint="check the network, and AWS_ENDPOINT_URL for S3-compatible stores",
        )
    if isinstance(err, BotoCoreError):
        return StorageError(f"{shown}: {_one_line(err)}", hint="check the AWS configuration")
    code = _code(err)
    message = _one_line(err.response.get("Error", {}).get("Message", "")) or code
    if _is_missing(err):
        return NotFound(
            f"{shown}: no such object",
            hint="check the URL; the checkpoint may have been pruned or never committed",
        )
    if code == "NoSuchBucket":
        return StorageError(
            f"bucket {bucket} does not exist ({shown})",
            hint="create the bucket or fix the URL (and AWS_ENDPOINT_URL for other stores)",
        )
    if code in ("PermanentRedirect", "301", "AuthorizationHeaderMalformed"):
        return StorageError(
            f"bucket {bucket} is in another region ({shown}): {message}",
            hint="set AWS_REGION to the bucket's region",
        )
    if code in _ACCESS_DENIED:
        return StorageError(
            f"access denied: {shown}",
            hint="check the IAM policy (s3:ListBucket, GetObject, PutObject, DeleteObject, "
            "AbortMultipartUpload) for this bucket and prefix, and AWS_PROFILE",
        )
    if code in _BAD_CREDENTIALS:
        return StorageError(
            f"AWS credentials were rejected for {shown} ({code})",
            hint="refresh the session (aws sso login) or fix AWS_ACCESS_KEY_ID/SECRET",
        )
    if code in _UNAVAILABLE or _status(err) >= 500:
        return StorageError(
            f"{shown}: S3 still failing after retries ({code}: {message})",
            hint="the store is throttling or unavailable; retry later or lower concurrency",
        )
    return StorageError(f"{shown}: {code}: {message}", hint="see the S3 error code's documentation")


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


# --- the storage ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    multipart_threshold: int
    part_size: int
    max_inflight_parts: int
    read_chunk_size: int
    read_concurrency: int


class S3Storage(Storage):
    """Objects below ``s3://bucket/prefix``.

    ``multipart_threshold``: objects up to this size are one PUT; larger ones are uploaded in
    parts. ``part_size``: the first part size (at least 5 MiB); it doubles every 1,000 parts,
    so no size hint is needed to stay within S3's 10,000 parts. ``max_inflight_parts``: parts
    uploaded at once per writer, which also bounds a writer's memory to about
    ``(max_inflight_parts + 1) * part_size`` once past the threshold.
    ``read_chunk_size`` / ``read_concurrency``: a read larger than one chunk is split into
    ranged GETs run in parallel, each filling its own slice of the caller's buffer.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        # 16 MiB parts, 8 in flight: measured against 64 MiB x 4 with scripts/bench_s3.py, a
        # single large shard uploads 1.5-2x faster (more parts in parallel sooner), and a
        # writer's memory bound drops from ~320 to ~144 MiB.
        multipart_threshold: int = 16 << 20,
        part_size: int = 16 << 20,
        max_inflight_parts: int = 8,
        read_chunk_size: int = 32 << 20,
        read_concurrency: int = 4,
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
        self._bucket, self._prefix = parse_s3_url(url)
        self.url = f"s3://{self._bucket}" + (f"/{self._prefix}" if self._prefix else "")
        self._opts = _Options(
            multipart_threshold=multipart_threshold,
            part_size=part_size,
            max_inflight_parts=max_inflight_parts,
            read_chunk_size=read_chunk_size,
            read_concurrency=max(1, read_concurrency),
        )
        self._holder = _ClientHolder(endpoint_url)

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
        child._holder = self._holder
        return child

    def _obj_key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def _list_prefix(self, prefix: str) -> str:
        joined = self._obj_key(prefix) if prefix else self._prefix
        return joined + "/" if joined else ""

    @property
    def _client(self) -> _Client:
        return self._holder.get()

    @contextmanager
    def _errors(self, shown: str) -> Iterator[None]:
        try:
            yield
        except (ClientError, BotoCoreError) as err:
            raise s3_error(err, shown, self._bucket, self._holder.endpoint()) from err

    # --- listing ---------------------------------------------------------------------------

    def children(self, prefix: str = "") -> list[ObjectInfo]:
        prefix = check_key(prefix, allow_empty=True)
        start = self._list_prefix(prefix)
        found: list[ObjectInfo] = []
        with self._errors(self.url_of(prefix)):
            pages = self._client.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket, Prefix=start, Delimiter="/"
            )
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    name = common["Prefix"][len(start) : -1]
                    if name:
                        found.append(ObjectInfo(_join(prefix, name), 0, 0.0, "dir"))
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(start) :]
                    if name:  # "" is a console-made "folder" marker for the prefix itself
                        found.append(
                            ObjectInfo(_join(prefix, name), obj["Size"], obj["LastModified"].timestamp())
                        )
        return sorted(found, key=lambda info: info.key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below ``prefix``, in key order (S3's listing order)."""
        prefix = check_key(prefix, allow_empty=True)
        start = self._list_prefix(prefix)
        with self._errors(self.url_of(prefix)):
            pages = self._client.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket, Prefix=start
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(start) :]
                    if name and not name.endswith("/"):  # skip "folder" marker objects
                        yield ObjectInfo(
                            _join(prefix, name), obj["Size"], obj["LastModified"].timestamp()
                        )

    def stat(self, key: str) -> ObjectInfo | None:
        """An object's size and mtime; for a key that is only a prefix of others, kind "dir"
        (one extra LIST on a miss, so both backends answer alike)."""
        key = check_key(key)
        obj = self._obj_key(key)
        with self._errors(self.url_of(key)):
            try:
                head = self._client.s3.head_object(Bucket=self._bucket, Key=obj)
            except ClientError as err:
                if not _is_missing(err):
                    raise
            else:
                return ObjectInfo(key, head["ContentLength"], head["LastModified"].timestamp())
            below = self._client.s3.list_objects_v2(Bucket=self._bucket, Prefix=obj + "/", MaxKeys=1)
        return ObjectInfo(key, 0, 0.0, "dir") if below.get("KeyCount", 0) else None

    # --- reading and writing ---------------------------------------------------------------

    def open_reader(self, key: str) -> "S3Reader":
        key = check_key(key)
        shown = self.url_of(key)
        obj = self._obj_key(key)
        with self._errors(shown):
            head = self._client.s3.head_object(Bucket=self._bucket, Key=obj)
        return S3Reader(self, obj, shown, head["ContentLength"], head.get("ETag"))

    def open_writer(self, key: str) -> "S3Writer":
        key = check_key(key)
        return S3Writer(self, self._obj_key(key), self.url_of(key))

    def write_atomic(self, key: str, data: bytes) -> None:
        """One PUT: S3 makes it visible whole or not at all."""
        key = check_key(key)
        with self._errors(self.url_of(key)):
            self._client.s3.put_object(
                Bucket=self._bucket, Key=self._obj_key(key), Body=data, **self._checksum_args()
            )

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """A PUT with ``If-None-Match: *``. Stores that ignore the header (some older
        S3-compatible ones) overwrite instead; AWS S3, MinIO and Ceph RGW honour it."""
        key = check_key(key)
        shown = self.url_of(key)
        for attempt in range(_CONFLICT_RETRIES):
            with self._errors(shown):
                try:
                    self._client.s3.put_object(
                        Bucket=self._bucket,
                        Key=self._obj_key(key),
                        Body=data,
                        IfNoneMatch="*",
                        **self._checksum_args(),
                    )
                    return True
                except ClientError as err:
                    if _code(err) == "PreconditionFailed" or _status(err) == 412:
                        return False
                    conflict = _code(err) == "ConditionalRequestConflict" or _status(err) == 409
                    if not conflict or attempt == _CONFLICT_RETRIES - 1:
                        raise
            # Another conditional PUT is in flight; once it lands ours gets a clean 412.
            time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _checksum_args(self) -> dict[str, str]:
        algorithm = self._client.checksum
        return {"ChecksumAlgorithm": algorithm} if algorithm else {}

    # --- removing --------------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """DELETE one object; a HEAD first tells whether it existed (S3's DELETE does not)."""
        key = check_key(key)
        obj = self._obj_key(key)
        with self._errors(self.url_of(key)):
            try:
                self._client.s3.head_object(Bucket=self._bucket, Key=obj)
            except ClientError as err:
                if _is_missing(err):
                    return False
                raise
            self._client.s3.delete_object(Bucket=self._bucket, Key=obj)
        return True

    def remove_dir(self, prefix: str) -> None:
        """Nothing to do: a prefix with no objects does not exist on S3."""
        check_key(prefix, allow_empty=True)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


# --- reader --------------------------------------------------------------------------------

# A body stream that broke while being read; botocore does not retry these, we re-issue the GET.
_STREAM_DROPS = (HTTPClientError, IncompleteReadError)


class S3Reader(Reader):
    """Ranged GETs of one object, straight into the caller's buffer.

    Every GET carries ``If-Match`` with the ETag seen at open, so an object replaced while we
    read fails loudly instead of yielding a mix of two versions.
    """

    def __init__(self, storage: S3Storage, obj_key: str, shown: str, size: int, etag: str | None) -> None:
        self._storage = storage
        self._obj = obj_key
        self._shown = shown
        self._etag = etag
        self.size = size
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def read_into(self, offset: int, out: memoryview) -> None:
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        view = byte_view(out)
        want = len(view)
        if offset + want > self.size:
            raise InvalidCheckpoint(
                f"{self._shown}: truncated: wanted {want} bytes at offset {offset}, "
                f"object has {self.size}",
                hint="the object was cut short or replaced; restore it or use an older checkpoint",
            )
        if want == 0:
            return
        opts = self._storage._opts
        chunk = opts.read_chunk_size
        if opts.read_concurrency == 1 or want <= chunk:
            self._get_range(offset, view)
            return
        # One S3 connection streams ~100 MB/s; big reads go over several in parallel.
        pool = self._get_pool(opts.read_concurrency)
        futures = [
            pool.submit(self._get_range, offset + start, view[start : start + chunk])
            for start in range(0, want, chunk)
        ]
        # Every GET writes into the caller's buffer: all must stop before we return or raise.
        wait(futures)
        for future in futures:
            future.result()

    def _get_range(self, offset: int, view: memoryview) -> None:
        s3 = self._storage._client.s3
        last = offset + len(view) - 1
        done = 0
        drops = 0
        while True:
            first = offset + done
            with self._storage._errors(self._shown):
                try:
                    response = s3.get_object(
                        Bucket=self._storage._bucket,
                        Key=self._obj,
                        Range=f"bytes={first}-{last}",
                        **({"IfMatch": self._etag} if self._etag else {}),
                    )
                except ClientError as err:
                    if _code(err) == "PreconditionFailed" or _status(err) == 412:
                        raise InvalidCheckpoint(
                            f"{self._shown} changed while being read",
                            hint="another process replaced it; read again once writes are done",
                        ) from err
                    raise
            if response.get("ContentLength") != last - first + 1:
                raise StorageError(
                    f"{self._shown}: the server ignored the byte range {first}-{last}",
                    hint="this S3-compatible store does not support ranged GETs",
                )
            body = response["Body"]
            try:
                while done < len(view):
                    got = body.readinto(view[done : done + _BODY_CHUNK])
                    if got == 0:
                        break
                    done += got
            except _STREAM_DROPS as err:
                body.close()  # the connection is broken; do not hand it back to the pool
                drops += 1
                if drops > _STREAM_RETRIES:
                    raise StorageError(
                        f"{self._shown}: connection dropped {drops} times reading bytes "
                        f"{first}-{last}",
                        hint="check the network path to the S3 endpoint and retry",
                    ) from err
                continue
            if done == len(view):
                return
            drops += 1  # the stream ended early without an error: ask again for the rest
            if drops > _STREAM_RETRIES:
                raise StorageError(
                    f"{self._shown}: stream ended early {drops} times reading bytes {first}-{last}",
                    hint="check the network path to the S3 endpoint and retry",
                )

    def _get_pool(self, workers: int) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptctl-s3-read")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


# --- writer --------------------------------------------------------------------------------


class S3Writer(Writer):
    """Buffers up to ``multipart_threshold``; past it, uploads parts in the background.

    Bytes are copied once, into part buffers (botocore takes bytes or bytearray, not a
    memoryview); a full part goes to the upload pool and ``write`` blocks while
    ``max_inflight_parts`` are in flight, so memory stays bounded however much is written.
    """

    def __init__(self, storage: S3Storage, obj_key: str, shown: str) -> None:
        self._storage = storage
        self._obj = obj_key
        self._shown = shown
        opts = storage._opts
        self._threshold = opts.multipart_threshold
        self._base_part = opts.part_size
        self._inflight = opts.max_inflight_parts
        self._cur = bytearray()  # destined to be part number self._next_part
        self._next_part = 1
        self._ready: list[tuple[int, bytearray]] = []  # full parts not yet handed to the pool
        self._total = 0
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(self._inflight)
        self._futures: list[Future[None]] = []
        self._parts: dict[int, dict[str, Any]] = {}
        self._state = "open"

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._require_open()
        view = byte_view(data)
        pos = 0
        try:
            while pos < len(view):
                size = part_size_for(self._base_part, self._next_part)
                take = min(size - len(self._cur), len(view) - pos)
                self._cur += view[pos : pos + take]
                pos += take
                self._total += take
                if len(self._cur) == size:
                    self._ready.append((self._next_part, self._cur))
                    self._next_part += 1
                    self._cur = bytearray()
                if self._upload_id is None and self._total > self._threshold:
                    self._start_multipart()
                if self._upload_id is not None:
                    self._submit_ready()
        except BaseException:
            # Whatever stopped us (an S3 error, an interrupt), leave no parts behind.
            self._abort_quietly()
            raise

    def commit(self) -> None:
        """One PUT below the threshold; else upload the last part and complete the upload."""
        self._require_open()
        s3 = self._storage._client.s3
        try:
            if self._upload_id is None:
                parts = [buf for _, buf in self._ready] + [self._cur]
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                with self._storage._errors(self._shown):
                    s3.put_object(
                        Bucket=self._storage._bucket,
                        Key=self._obj,
                        Body=body,
                        **self._storage._checksum_args(),
                    )
            else:
                if self._cur:
                    self._ready.append((self._next_part, self._cur))
                    self._next_part += 1
                    self._cur = bytearray()
                self._submit_ready()
                wait(self._futures)
                self._raise_failed()
                with self._storage._errors(self._shown):
                    s3.complete_multipart_upload(
                        Bucket=self._storage._bucket,
                        Key=self._obj,
                        UploadId=self._upload_id,
                        MultipartUpload={"Parts": [self._parts[n] for n in sorted(self._parts)]},
                    )
        except BaseException:
            # Whatever stopped us (an S3 error, an interrupt), leave no parts behind.
            self._abort_quietly()
            raise
        self._finish("committed")

    def abort(self) -> None:
        """Discard everything; aborts the multipart upload so no parts are left billed."""
        if self._state != "open":
            return
        self._finish("aborted")
        if self._upload_id is None:
            return
        with self._storage._errors(self._shown):
            try:
                self._storage._client.s3.abort_multipart_upload(
                    Bucket=self._storage._bucket, Key=self._obj, UploadId=self._upload_id
                )
            except ClientError as err:
                if _code(err) != "NoSuchUpload":
                    raise

    def _abort_quietly(self) -> None:
        # The error that made us abort is the one to report. If the abort fails too, the
        # bucket's AbortIncompleteMultipartUpload lifecycle rule is the backstop.
        try:
            self.abort()
        except CkptError:
            pass

    def _start_multipart(self) -> None:
        with self._storage._errors(self._shown):
            response = self._storage._client.s3.create_multipart_upload(
                Bucket=self._storage._bucket, Key=self._obj, **self._storage._checksum_args()
            )
        self._upload_id = response["UploadId"]
        self._pool = ThreadPoolExecutor(self._inflight, thread_name_prefix="ckptctl-s3-part")

    def _submit_ready(self) -> None:
        assert self._pool is not None
        while self._ready:
            self._raise_failed()
            if self._ready[0][0] > MAX_PARTS:
                raise StorageError(
                    f"{self._shown}: more than {MAX_PARTS} parts (object too large for S3)",
                    hint="S3 objects are limited to 5 TiB; write smaller shards",
                )
            self._slots.acquire()  # blocks while max_inflight_parts are uploading
            number, buf = self._ready.pop(0)
            try:
                self._futures.append(self._pool.submit(self._upload_part, number, buf))
            except BaseException:
                self._slots.release()
                raise

    def _upload_part(self, number: int, buf: bytearray) -> None:
        try:
            checksum = self._storage._checksum_args()
            with self._storage._errors(f"{self._shown} (part {number})"):
                response = self._storage._client.s3.upload_part(
                    Bucket=self._storage._bucket,
                    Key=self._obj,
                    UploadId=self._upload_id,
                    PartNumber=number,
                    Body=buf,
                    **checksum,
                )
            part: dict[str, Any] = {"PartNumber": number, "ETag": response["ETag"]}
            if checksum:
                field = "Checksum" + checksum["ChecksumAlgorithm"]
                if response.get(field):
                    part[field] = response[field]  # S3 requires it on completion
            self._parts[number] = part
        finally:
            self._slots.release()

    def _raise_failed(self) -> None:
        for future in self._futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _finish(self, state: str) -> None:
        self._state = state
        for future in self._futures:
            future.cancel()
        # A part still uploading must land before the abort, or it would outlive it.
        wait(self._futures)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._cur = bytearray()
        self._ready.clear()

    def _require_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"writer for {self._shown} is already {self._state}")
