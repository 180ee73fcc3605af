"""Reading an object's bytes: the ranged, parallel ``S3Reader``, straight into the caller's buffer.

Retries are botocore's. The one loop of our own re-issues a ranged GET whose body stream broke
mid-read, from the byte where it broke: botocore retries a request, not a body being consumed.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

from botocore.exceptions import ClientError, FlexibleChecksumError, HTTPClientError, IncompleteReadError

from ckptctl.errors import InvalidCheckpoint, StorageError
from ckptctl.storage.base import Reader, byte_view
from ckptctl.storage.s3_bucket import Bucket
from ckptctl.storage.s3_errors import is_precondition_failed
from ckptctl.storage.s3_transfer import TransferOptions

_BODY_CHUNK = 1 << 20  # urllib3 copies each readinto through a bytes object of this size
_STREAM_RETRIES = 5  # body streams that may break in a row before a read gives up

# A body stream that broke while being read; botocore does not retry these, we re-issue the GET.
_STREAM_DROPS = (HTTPClientError, IncompleteReadError)


class S3Reader(Reader):
    """Ranged GETs of one object, straight into the caller's buffer.

    Every GET carries ``If-Match`` with the ETag seen at open, so an object replaced while we
    read fails loudly instead of yielding a mix of two versions.
    """

    def __init__(self, bucket: Bucket, opts: TransferOptions, obj_key: str, shown: str, size: int,
                 etag: str | None) -> None:
        self._bucket = bucket
        self._opts = opts
        self._obj = obj_key
        self._shown = shown
        self._etag = etag
        self.size = size
        self.reads_in_flight = opts.read_concurrency  # a streaming caller's GETs at once, as a large read's
        self.reads_are_requests = True
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
        opts = self._opts
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
        s3 = self._bucket.client.s3
        last = offset + len(view) - 1
        done = 0
        drops = 0
        while True:
            first = offset + done
            with self._bucket.errors(self._shown):
                try:
                    response = s3.get_object(
                        Bucket=self._bucket.name,
                        Key=self._obj,
                        Range=f"bytes={first}-{last}",
                        **({"IfMatch": self._etag} if self._etag else {}),
                    )
                except ClientError as err:
                    if is_precondition_failed(err):
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
                    raise self._gave_up(f"connection dropped {drops} times", first, last) from err
                continue
            if done == len(view):
                return
            drops += 1  # the stream ended early without an error: ask again for the rest
            if drops > _STREAM_RETRIES:
                raise self._gave_up(f"stream ended early {drops} times", first, last)

    def _gave_up(self, what: str, first: int, last: int) -> StorageError:
        return StorageError(
            f"{self._shown}: {what} reading bytes {first}-{last}",
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


def get_small(bucket: Bucket, obj_key: str, shown: str, limit: int) -> tuple[bytes | None, int] | None:
    """``Storage.read_if_small`` in one GET: the answer gives the size, and the body is read
    only when it is at most ``limit`` bytes (else the connection is closed unread: a hostile
    huge object costs nothing but that). None when the body stream broke: the caller reads
    again through an ``S3Reader``, which resumes a broken range."""
    with bucket.errors(shown):
        got = bucket.client.s3.get_object(Bucket=bucket.name, Key=obj_key)
    body, size = got["Body"], got["ContentLength"]
    try:
        if size > limit:
            return None, size
        # botocore checks that ContentLength bytes came, and the object's checksum where the
        # store sent one: a mismatch is bytes damaged on the way, read again as a broken stream.
        data = body.read()
    except (*_STREAM_DROPS, FlexibleChecksumError):
        return None
    finally:
        body.close()
    return data, size
