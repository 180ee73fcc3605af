"""DCP's file operations over ckptctl's ``Storage``, hashing every byte on its way out.

``torch.distributed.checkpoint.FileSystemWriter`` does all its I/O through one object, its
``fs`` (``create_stream``, ``rename``, ``exists``, ...). ``SealingFiles`` is that object for
``integrations.dcp.Writer``: the same DCP code writes the same files, but

- each file goes through a ``Storage`` writer (POSIX: a hidden temporary, fsync, rename,
  directory fsync; S3: a multipart upload completed on close), so a file is either whole or
  absent, and ``s3://`` works with the one S3 client the rest of ckptctl uses (no fsspec/s3fs);
- each byte is hashed as it is written (``format.seal.FileDigest``), so the seal costs no
  second read;
- ``.metadata``, DCP's commit file, is kept in memory until DCP renames its temporary into
  place; that rename calls ``commit`` (the writer's: seal first, then ``.metadata``).

DCP hands its writer one root path and joins file names onto it; here paths are keys relative
to the checkpoint's storage, so nothing can be written outside it.
"""

from __future__ import annotations

import io
import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from ckptctl.format.seal import CHUNK_SIZE, FileDigest, SealedFile
from ckptctl.integrations.stream import StorageStream
from ckptctl.storage import open_storage
from ckptctl.storage.base import Storage

METADATA = ".metadata"


class SealingFiles:
    """DCP's ``FileSystemBase`` for one checkpoint (``storage``): see the module docstring.
    ``commit(metadata_digest, metadata_bytes)`` is called when DCP renames ``.metadata.tmp``
    into place, on the coordinator only, after every rank's files are written."""

    def __init__(self, url: str, chunk_size: int = CHUNK_SIZE) -> None:
        self.url = url
        self.storage: Storage = open_storage(url)
        self.chunk_size = chunk_size
        self.commit: Callable[[SealedFile, bytes], None] | None = None
        self._lock = threading.Lock()
        self._written: list[SealedFile] = []
        self._held: dict[str, tuple[SealedFile, bytes]] = {}

    def take_written(self) -> list[SealedFile]:
        """The entries of the data files written since the last call (this rank's)."""
        with self._lock:
            out, self._written = self._written, []
        return out

    # --- torch.distributed.checkpoint.filesystem.FileSystemBase ------------------------------

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        key = os.fspath(path)
        if mode != "wb":
            raise ValueError(f"{self.storage.url_of(key)}: the sealing writer only writes (mode {mode!r})")
        digest = FileDigest(self.chunk_size)
        if key.endswith(".tmp"):  # a commit file DCP renames into place: kept in memory until then
            held = io.BytesIO()
            yield held
            digest.update(held.getbuffer())
            with self._lock:
                self._held[key] = (digest.sealed(key), held.getvalue())
            return
        with StorageStream(self.storage.open_writer(key), tap=digest.update) as stream:
            yield stream  # type: ignore[misc]
        with self._lock:
            self._written.append(digest.sealed(key))

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        # DCP only ever joins a file name onto the checkpoint's own path: keys are relative to it.
        return suffix

    def init_path(self, path: str | os.PathLike[str]) -> str:
        url = os.fspath(path)
        if url != self.url:  # dcp.save(checkpoint_id=...) names another directory than the writer's
            self.url, self.storage = url, open_storage(url)
        return url

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        src, dst = os.fspath(path), os.fspath(new_path)
        with self._lock:
            held = self._held.pop(src, None)
        if held is None or dst != METADATA or self.commit is None:
            raise ValueError(f"{self.storage.url_of(src)}: the sealing writer renames only DCP's {METADATA}.tmp")
        entry, data = held
        self.commit(SealedFile(METADATA, entry.size, entry.xxh3, entry.chunks), data)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing: a ``Storage`` writer creates the directories it needs."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.storage.stat(os.fspath(path)) is not None

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.storage.delete(os.fspath(path))
