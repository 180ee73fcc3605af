"""The storage interface: the only way ckptctl touches bytes at rest.

A ``Storage`` is rooted at one URL (a directory or an ``s3://bucket/prefix``) and addresses
everything below it by *relative keys*: ``/``-separated, no empty, ``.`` or ``..`` components,
never absolute. ``sub(key)`` gives a storage rooted deeper, so code that handles one checkpoint
cannot name anything outside it.

Storage moves bytes; it does not interpret them (format/ does). Backends raise
``ckptctl.errors.NotFound`` for a missing key and ``ckptctl.errors.StorageError`` (exit 3) for
everything environmental (permission denied, disk full, unreachable, throttled past retries).
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Literal, Sequence

from ckptctl.errors import NotFound, StorageError

EntryKind = Literal["file", "dir", "link"]


@dataclass(frozen=True)
class ObjectInfo:
    """One file or object. ``key`` is relative to the storage root that listed it."""

    key: str
    size: int
    mtime: float  # seconds since the epoch
    kind: EntryKind = "file"
    # The store's tag of the object's content where it keeps one (S3's ETag): it changes with
    # the bytes, also within the one second that is all S3's LastModified tells apart.
    etag: str | None = None


class Reader(ABC):
    """Random-access reads of one object, kept open for many ranged reads."""

    size: int
    # Ranged reads a caller streaming the object front to back keeps in flight at once to reach
    # the store's speed: one for a local file (the kernel reads ahead of it); more on object
    # storage, where one connection moves 50-100 MB/s and throughput comes from several.
    reads_in_flight: int = 1
    # Whether each read is a request with a round trip (object storage): a caller that will
    # likely need more than its first small read (a shard's header) asks for more at once.
    # Locally a read is a syscall, and reading past what is needed only costs bytes.
    reads_are_requests: bool = False

    @abstractmethod
    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` (writable, contiguous; any item format, addressed as bytes) from
        ``offset``; raises ``InvalidCheckpoint`` ("truncated") if the object ends before
        ``out.nbytes`` bytes were read."""

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    @abstractmethod
    def close(self) -> None: ...

    def local_fd(self) -> int | None:
        """The open local file descriptor behind this reader (for readers that need a path:
        ``/proc/self/fd/N``), or None on object storage."""
        return None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Writer(ABC):
    """A streaming write of one object. Nothing is visible as complete until ``commit``."""

    @abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    @abstractmethod
    def commit(self) -> None:
        """Make the object durable (fsync of file and directory; completed PUT/multipart)."""

    @abstractmethod
    def abort(self) -> None:
        """Discard what was written (removes the partial file; aborts the multipart upload)."""

    def expect(self, size: int) -> None:
        """A hint: at least ``size`` bytes will be written (a copy knows each file's size). A backend
        may start work it would otherwise start later (``S3Writer``: the multipart upload);
        this default ignores it."""

    def publish(self, fallbacks: Sequence[str] = ()) -> int | None:
        """``commit``, but never replacing anything: under the key this writer was opened for
        if nothing has that key, else under the first of ``fallbacks`` (plain names in the same
        directory) that nothing has. Returns which name it took (0: the writer's own key, k:
        ``fallbacks[k - 1]``), or None when every name it tried was taken: then nothing was
        published and what was written is discarded. A backend that must fix the key before
        the bytes go out (an S3 multipart upload) tries its own key only, and the caller
        writes again under the next name. Atomic against concurrent publishers (a hard link
        locally, ``If-None-Match: *`` on S3).

        This default, for writers that cannot publish conditionally, is ``commit`` (which
        replaces): the no-replace guarantee is the backend's, and ``LocalWriter`` and
        ``S3Writer`` keep it."""
        self.commit()
        return 0

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Storage(ABC):
    """A small interface with two backends: ``LocalStorage`` (POSIX) and ``S3Storage``."""

    url: str  # the URL this storage is rooted at, as a user would type it

    @abstractmethod
    def sub(self, key: str) -> "Storage":
        """A storage rooted at ``key`` below this one."""

    @abstractmethod
    def children(self, prefix: str = "") -> list[ObjectInfo]:
        """Immediate children of ``prefix``: files, dirs (S3: common prefixes) and, locally,
        symlinks (kind "link", never followed). Sorted by key."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every file/object below ``prefix``, recursively (symlinks reported, not followed)."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Size and mtime of ``key``, or None when it does not exist; kind "dir" for a
        directory (on object storage: a key that only prefixes others, ``key/...``). Callers
        ask it on the path of every commit and copy (is the marker there?): one request on
        object storage, whatever the answer."""

    @abstractmethod
    def open_reader(self, key: str) -> Reader:
        """Open ``key`` for ranged reads. Raises NotFound if absent; a symlink (or a path
        through one) is refused with InvalidCheckpoint."""

    def open_root_reader(self) -> Reader:
        """Open the object this storage is rooted at, for a storage rooted at one file (a
        Lightning ``.ckpt``, a checkpoint that is a single file). Refuses as ``open_reader``. A
        backend without single-file roots keeps this default: nothing is there."""
        from ckptctl.errors import NotFound

        raise NotFound(f"{self.url}: this storage does not open the object it is rooted at",
                       hint="copy the file to a local path or s3:// first")

    def read(self, key: str, *, max_size: int = 64 << 20) -> bytes:
        """The whole (small) object. ``max_size`` guards against a hostile huge file."""
        data, size = self.read_if_small(key, max_size)
        if data is None:
            raise StorageError(
                f"{self.url_of(key)}: {size} bytes is larger than the {max_size} allowed",
                hint="this file is not what ckptctl expects here",
            )
        return data

    def read_if_small(self, key: str, limit: int) -> tuple[bytes | None, int]:
        """The whole object ``key`` and its size when it holds at most ``limit`` bytes, else
        ``(None, size)`` with none of it read: one consistent version either way. Raises
        NotFound or refuses as ``open_reader``. ``S3Storage``: one GET instead of a HEAD and
        then a GET, two round trips in series for every small file read."""
        with self.open_reader(key) as r:
            if r.size > limit:
                return None, r.size
            return r.read(0, r.size), r.size

    @abstractmethod
    def open_writer(self, key: str) -> Writer:
        """Stream an object to ``key`` (created or replaced on ``commit``)."""

    @abstractmethod
    def write_atomic(self, key: str, data: bytes) -> None:
        """Replace ``key`` atomically and durably: a reader sees the old or the new bytes, never
        a mix (POSIX: temp name, fsync, rename, directory fsync; S3: one PUT)."""

    @abstractmethod
    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; False if it already did. Atomic against
        concurrent callers (O_EXCL; S3 ``If-None-Match: *``)."""

    def compare_and_swap(self, key: str, expected: bytes | None, data: bytes) -> bytes | None:
        """Write ``data`` under ``key`` only if ``key`` still holds ``expected`` (None: absent),
        checked once ``data`` is ready to take its place: a pointer moved by a tool must not
        undo what another writer put there meanwhile. Returns what ``key`` held (``expected``
        when ``data`` took its place; otherwise the content found, its first 4 KiB past the
        length of ``expected``, and nothing was written).

        This default, for backends that cannot do better, checks by reading just before an
        atomic write; ``LocalStorage`` and ``S3Storage`` close that gap (a hard link and a
        rename, re-checked after; ``If-Match``)."""
        found = self._content(key, len(expected or b"") + 4096)
        if found == expected:
            self.write_atomic(key, data)
        return found

    def _content(self, key: str, limit: int) -> bytes | None:
        """The first ``limit`` bytes of ``key``, or None when there is no such object."""
        try:
            with self.open_reader(key) as r:
                return r.read(0, min(r.size, limit))
        except NotFound:
            return None

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove one file/object (a symlink itself, never its target). False if absent."""

    @abstractmethod
    def remove_dir(self, prefix: str) -> None:
        """Remove the now-empty directory ``prefix`` (and empty subdirectories). No-op on S3."""

    def abort_stale_uploads(
        self,
        prefix: str = "",
        *,
        idle_for_s: float,
        keys: Collection[str] = (),
        where: Callable[[str], bool] | None = None,
        dry_run: bool = False,
    ) -> list[str]:
        """Abort the unfinished multipart uploads below ``prefix`` that a killed writer left:
        those of ``keys`` (this run is about to write them), and those whose key ``where``
        accepts (all, for None) that nothing touched for ``idle_for_s`` seconds on the store's
        clock, so a live writer's upload of another key is never aborted. Keys are relative
        to this storage. Returns the keys aborted, sorted (``dry_run``: those it would abort,
        aborting none; a key of ``keys`` with no upload needs no look by its writer either
        way). A backend without such uploads returns [] and removes nothing: local
        temporaries are cleaned by the layers that write them. Rules: ``storage/s3_uploads``."""
        check_key(prefix, allow_empty=True)
        return []

    def local_path(self, key: str = "") -> str | None:
        """The filesystem path of ``key`` on a POSIX backend; None for object stores."""
        return None

    def url_of(self, key: str = "") -> str:
        """The user-facing URL of ``key``, for messages."""
        return self.url.rstrip("/") + ("/" + key if key else "")


def byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a flat memoryview of bytes, without copying.

    Callers hand over views of typed buffers (a float32 numpy array, a tensor's storage); both
    backends address bytes, so the view is recast. Non-contiguous buffers raise TypeError.
    """
    view = memoryview(data)
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B")


def is_key(key: str) -> bool:
    """Whether ``key`` is a relative key ``check_key`` takes (never ""): no absolute path,
    ``..``, empty or ``.`` component, backslash or NUL."""
    return not (
        not key
        or key.startswith("/")
        or "\\" in key
        or "\0" in key
        or any(part in ("", ".", "..") for part in key.split("/"))
    )


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Validate a relative key. Raises ``InvalidCheckpoint`` for anything that could escape the
    storage root: absolute paths, ``..``, empty or ``.`` components, backslashes, NUL."""
    from ckptctl.errors import InvalidCheckpoint

    if key == "" and allow_empty:
        return key
    if not is_key(key):
        raise InvalidCheckpoint(
            f"refusing path {key!r}: it is absolute or escapes its checkpoint",
            hint="the manifest or header was altered; treat this checkpoint as untrusted",
        )
    return posixpath.normpath(key)
