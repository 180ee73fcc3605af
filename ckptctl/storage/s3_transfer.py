"""Writing an object's bytes: the multipart ``S3Writer`` (reads: ``s3_reader``).

Writes are visible only when complete, as S3 itself guarantees: small objects are one PUT on
``commit``; large ones are a multipart upload completed on ``commit`` and aborted on any
failure, so no orphaned parts are left to pay for; those a killed writer left are aborted
by the next writer of the key (``s3_uploads``). Uploads carry a CRC32 checksum (CRC32C
needs the optional awscrt package) so S3 refuses bytes corrupted on the way. Retries are
botocore's.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from botocore.exceptions import ClientError

from ckptctl.errors import CkptError, StorageError
from ckptctl.storage.base import Writer, byte_view
from ckptctl.storage.s3_bucket import Bucket
from ckptctl.storage.s3_errors import error_code
from ckptctl.storage.s3_uploads import supersede, writer_metadata

MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
# Part sizes double every this many parts, so an upload whose size is not known in advance
# still fits in 10,000 parts: from 5 MiB parts that reaches 4.9 TiB, about S3's 5 TiB cap.
PART_GROWTH_EVERY = 1_000


def part_size_for(base: int, part_number: int) -> int:
    """The size of part ``part_number`` (1-based) when parts start at ``base`` bytes."""
    return min(MAX_PART_SIZE, base << ((part_number - 1) // PART_GROWTH_EVERY))


def uniform_part_size(base: int, size: int) -> int:
    """One part size for an object known to be ``size`` bytes: ``base`` while its parts fit in
    ``MAX_PARTS`` (78 GiB at 8 MiB), else ``base`` doubled until they do."""
    part = base
    while part < MAX_PART_SIZE and -(-size // part) > MAX_PARTS:
        part *= 2
    return min(part, MAX_PART_SIZE)


@dataclass(frozen=True)
class TransferOptions:
    """How a storage splits writes into parts and reads into ranged GETs."""

    multipart_threshold: int
    part_size: int
    max_inflight_parts: int
    read_chunk_size: int
    read_concurrency: int


class _PartBuffers:
    """Full-size part buffers whose upload is done, for the process's next parts: at most
    ``keep`` of them are kept (the default upload's parts in flight: the memory one upload
    holds at its peak anyway), the rest are freed. An empty (growable) buffer when none of the
    size asked for is free."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):  # the one given back last: still in cache
                if len(self._free[i]) == size:
                    return self._free.pop(i)
        return bytearray()

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


_PART_BUFFERS = _PartBuffers(keep=16)


class S3Writer(Writer):
    """Buffers up to ``multipart_threshold``; past it, uploads parts in the background.

    Bytes are copied once, into part buffers (botocore takes bytes or bytearray, not a
    memoryview); a full part goes to the upload pool and ``write`` blocks while
    ``max_inflight_parts`` are in flight, so memory stays bounded however much is written.
    A part buffer whose upload is done takes a later part's bytes, of this upload or the
    process's next (``_PartBuffers``): fresh memory is faulted in page by page on first write,
    a large share of an upload's CPU time on a small VM, and the same few buffers serve every
    part instead.
    """

    def __init__(self, bucket: Bucket, opts: TransferOptions, obj_key: str, shown: str) -> None:
        self._bucket = bucket
        self._obj = obj_key
        self._shown = shown
        self._threshold = opts.multipart_threshold
        self._base_part = opts.part_size
        # Parts of one size (``expect``): the first ``_planned`` parts are ``_uniform`` bytes each.
        self._uniform, self._planned = opts.part_size, 0
        self._inflight = opts.max_inflight_parts
        self._cur = bytearray()  # destined to be part number self._next_part
        self._fill = 0  # bytes of it written; the first part grows, later ones are full-size buffers
        self._next_part = 1
        self._ready: list[tuple[int, bytearray]] = []  # full parts not yet handed to the pool
        self._total = 0
        # The multipart upload's id, once started: CreateMultipartUpload runs on the part pool,
        # so the first part's bytes are read while it is in flight (``expect``).
        self._created: Future[str] | None = None
        self._lent: dict[int, bytearray] = {}  # the ``spare`` buffers out with the caller, by id
        self._lent_lock = threading.Lock()  # spare() runs on the caller's read-ahead thread
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(self._inflight)
        self._futures: list[Future[None]] = []
        self._parts: dict[int, dict[str, Any]] = {}
        self._state = "open"

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._require_open()
        view = byte_view(data)
        pos = 0
        with self._aborting_on_failure():
            while pos < len(view):
                size = self._part_size(self._next_part)
                if not self._cur and (self._created is not None or self._next_part > 1):
                    self._cur = _PART_BUFFERS.take(size)  # the first part of a small object grows instead
                take = min(size - self._fill, len(view) - pos)
                if self._fill == len(self._cur):
                    self._cur += view[pos : pos + take]
                else:
                    self._cur[self._fill : self._fill + take] = view[pos : pos + take]
                self._fill += take
                pos += take
                self._total += take
                if self._fill == size:
                    self._seal_part()
                if self._created is None and self._total > self._threshold:
                    self._start_multipart()
                if self._created is not None:
                    self._submit_ready()

    def expect(self, size: int) -> None:
        """At least ``size`` bytes are coming: past the threshold, the multipart upload starts now,
        in the background, instead of once the threshold's worth was written. A copy knows
        each file's size; its first part then leaves as soon as its bytes are in, not a
        CreateMultipartUpload (and the listing before it) later. Writing fewer bytes after
        all is still correct (a multipart upload of one short part).

        Before the first byte, ``size`` also fixes the part size for the whole object: every
        part is the first one's size (``uniform_part_size``) instead of doubling every 1,000
        parts as an upload of unknown size must. A writer's memory then stays
        ``max_inflight_parts + 1`` parts of that size however large the object (past 8 GiB
        doubling parts held 2x, past 24 GiB 4x), and a copy's pieces, read at ``spare_size``,
        keep matching its parts to the end (each becomes its part without a copy). Bytes
        past ``size`` go on in parts that grow again (``part_size_for``), at least as large."""
        self._require_open()
        if self._total == 0 and self._next_part == 1 and size > 0:
            self._uniform = uniform_part_size(self._base_part, size)
            self._planned = -(-size // self._uniform)
        if self._created is None and size > self._threshold:
            self._start_multipart()

    @property
    def spare_size(self) -> int:
        """What ``spare`` lends: a copy reads its pieces at this size (the object's part size)."""
        return self._uniform

    def _part_size(self, number: int) -> int:
        """The size of part ``number`` (1-based): see ``expect``."""
        if number <= self._planned:
            return self._uniform
        return max(self._uniform, part_size_for(self._base_part, number))

    def spare(self, size: int) -> memoryview | None:
        """Room for the caller to read ``size`` bytes into and then ``hand_over``, when that
        many bytes make one of this upload's parts (its first part size): a part buffer whose
        upload is done when one is free (its memory already faulted in), else a new one. None
        for any other size: the caller reads into memory of its own, and ``hand_over`` copies."""
        if size != self.spare_size:
            return None
        buf = _PART_BUFFERS.take(size)
        buf = buf if len(buf) == size else bytearray(size)
        with self._lent_lock:
            self._lent[id(buf)] = buf
        return memoryview(buf)

    def hand_over(self, view: memoryview) -> None:
        """``write``, without copying when ``view`` is the whole of a ``spare`` buffer and the
        next part of a started multipart upload is its size: the buffer becomes that part.
        Any other view is copied, as ``write`` does (a spare buffer then goes back to the
        pool). Either way the caller does not touch a spare buffer again. A copy reads its
        pieces into spare buffers, so each byte is copied once, by the read, instead of twice."""
        buf = view.obj
        with self._lent_lock:
            lent = self._lent.pop(id(buf), None) is buf
        size = self._part_size(self._next_part)
        if not (lent and len(view) == len(buf) == size and self._created is not None and self._fill == 0):
            self.write(view)
            if lent:
                _PART_BUFFERS.give(buf)  # type: ignore[arg-type]
            return
        self._require_open()
        with self._aborting_on_failure():
            self._cur, self._fill = buf, size  # type: ignore[assignment]
            self._total += size
            self._seal_part()
            self._submit_ready()

    def commit(self) -> None:
        """One PUT below the threshold; else upload the last part and complete the upload."""
        self._require_open()
        s3 = self._bucket.client.s3
        with self._aborting_on_failure():
            if self._created is None:
                body = self._small_body()
                with self._bucket.errors(self._shown):
                    s3.put_object(
                        Bucket=self._bucket.name,
                        Key=self._obj,
                        Body=body,
                        **self._bucket.checksum_args(),
                    )
            else:
                if self._fill:
                    self._seal_part()
                self._submit_ready()
                wait(self._futures)
                self._raise_failed()
                with self._bucket.errors(self._shown):
                    s3.complete_multipart_upload(
                        Bucket=self._bucket.name,
                        Key=self._obj,
                        UploadId=self._created.result(),
                        MultipartUpload={"Parts": [self._parts[n] for n in sorted(self._parts)]},
                    )
        self._finish("committed")

    def publish(self, fallbacks: Sequence[str] = ()) -> int | None:
        """``commit`` with ``If-None-Match: *`` (see ``Writer.publish``). Below the threshold,
        one conditional PUT per name tried, the body kept until one lands; a multipart upload
        is completed conditionally under its own key only, and aborted when that key is taken
        (the caller writes again under the next name). A store that ignores the header (some
        older S3-compatible ones) replaces, as ``commit`` does."""
        self._require_open()
        if any(not n or "/" in n or n in (".", "..") for n in fallbacks):
            raise ValueError(f"fallbacks must be plain names beside {self._shown}: {list(fallbacks)}")
        s3, bucket, checksum = self._bucket.client.s3, self._bucket.name, self._bucket.checksum_args()
        taken: int | None = None
        with self._aborting_on_failure():
            if self._created is None:
                body = self._small_body()
                head, _, own = self._obj.rpartition("/")
                for i, name in enumerate((own, *fallbacks)):
                    obj, shown = f"{head}/{name}" if head else name, self._shown.rpartition("/")[0] + "/" + name

                    def put(obj: str = obj) -> object:
                        return s3.put_object(Bucket=bucket, Key=obj, Body=body, IfNoneMatch="*", **checksum)

                    if self._bucket.if_absent(shown, put):
                        taken = i
                        break
            else:
                if self._fill:
                    self._seal_part()
                self._submit_ready()
                wait(self._futures)
                self._raise_failed()
                parts_done = {"Parts": [self._parts[n] for n in sorted(self._parts)]}
                upload_id = self._created.result()
                if self._bucket.if_absent(self._shown, lambda: s3.complete_multipart_upload(
                        Bucket=bucket, Key=self._obj, UploadId=upload_id, MultipartUpload=parts_done, IfNoneMatch="*")):
                    taken = 0
        if taken is None:
            self._abort_quietly()  # nothing published: drop the body, or the upload's parts
        else:
            self._finish("committed")
        return taken

    def abort(self) -> None:
        """Discard everything; aborts the multipart upload so no parts are left billed."""
        if self._state != "open":
            return
        self._finish("aborted")  # waits for the CreateMultipartUpload too
        created, self._created = self._created, None
        if created is None or created.cancelled() or created.exception() is not None:
            return  # no upload, or none was created
        with self._bucket.errors(self._shown):
            try:
                self._bucket.client.s3.abort_multipart_upload(
                    Bucket=self._bucket.name, Key=self._obj, UploadId=created.result()
                )
            except ClientError as err:
                if error_code(err) != "NoSuchUpload":
                    raise

    @contextmanager
    def _aborting_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            # Whatever stopped us (an S3 error, an interrupt), leave no parts behind.
            self._abort_quietly()
            raise

    def _abort_quietly(self) -> None:
        # The error that made us abort is the one to report. If the abort fails too, the
        # bucket's AbortIncompleteMultipartUpload lifecycle rule is the backstop.
        try:
            self.abort()
        except CkptError:
            pass

    def _small_body(self) -> bytes | bytearray:
        """The whole object, below the threshold: its sealed parts, then what was written of
        the current one. A part after the first may be a pooled full-size buffer (``take``):
        only its first ``_fill`` bytes are the object's."""
        if self._fill < len(self._cur):
            del self._cur[self._fill :]
        parts = [buf for _, buf in self._ready] + [self._cur]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _seal_part(self) -> None:
        """Queue the current buffer as the next part for upload. The next part's buffer is
        taken when its first byte is written (a spare one of its size when an upload has
        handed one back, else a new one), or handed over whole (``hand_over``)."""
        if self._fill < len(self._cur):
            del self._cur[self._fill :]  # the last part: only what was written
        self._ready.append((self._next_part, self._cur))
        self._next_part += 1
        self._cur, self._fill = bytearray(), 0

    def _start_multipart(self) -> None:
        """Create the upload on the part pool; parts queued behind it wait for its id."""
        self._pool = ThreadPoolExecutor(self._inflight, thread_name_prefix="ckptctl-s3-part")
        self._created = self._pool.submit(self._create)
        self._futures.append(self._created)  # a failure surfaces at the next write, as a part's does

    def _create(self) -> str:
        # An upload of this key still open is a killed writer's, or a racing one's that cannot
        # both publish: one writer per object (s3_uploads).
        supersede(self._bucket, self._obj, self._shown)
        with self._bucket.errors(self._shown):
            response = self._bucket.client.s3.create_multipart_upload(
                Bucket=self._bucket.name,
                Key=self._obj,
                Metadata=writer_metadata(),
                **self._bucket.checksum_args(),
            )
        return response["UploadId"]

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
            assert self._created is not None
            upload_id = self._created.result()  # raises the CreateMultipartUpload's error
            checksum = self._bucket.checksum_args()
            with self._bucket.errors(f"{self._shown} (part {number})"):
                response = self._bucket.client.s3.upload_part(
                    Bucket=self._bucket.name,
                    Key=self._obj,
                    UploadId=upload_id,
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
            if len(buf) == self._part_size(number):  # not a short last part
                _PART_BUFFERS.give(buf)  # botocore is done with it: a later part's bytes may go in
        finally:
            self._slots.release()

    def _raise_failed(self) -> None:
        for future in self._futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _finish(self, state: str) -> None:
        self._state = state
        self._bucket.take_cleared(self._obj)  # a one-PUT object never asked: the mark goes with its writer
        for future in self._futures:
            future.cancel()
        # A part still uploading must land before the abort, or it would outlive it.
        wait(self._futures)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._cur, self._fill = bytearray(), 0
        self._ready.clear()
        with self._lent_lock:
            self._lent.clear()

    def _require_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"writer for {self._shown} is already {self._state}")
