"""PyTorch Distributed Checkpoint (DCP) with checksums: a ``StorageWriter`` that seals what it
writes and a ``StorageReader`` that loads nothing it cannot vouch for.

    import torch.distributed.checkpoint as dcp
    from ckptctl.integrations.dcp import Reader, Writer

    dcp.save(state, storage_writer=Writer("/ckpt/step-100"))           # or s3://bucket/run/step-100
    dcp.async_save(state, storage_writer=Writer("/ckpt/step-200"))     # the same, in the background
    dcp.load(state, storage_reader=Reader("/ckpt/step-200"))           # refuses damaged bytes

``Writer`` is DCP's own ``FileSystemWriter`` (same planner, same files, same ``.metadata``; any
DCP reader, torchtitan's included, loads the result) whose file operations go through ckptctl's
``Storage`` (``integrations.dcp_files``): every file is written whole or not at all (local:
temporary name, fsync, rename; S3: a completed upload), every byte is hashed as it is written
(XXH3-64, and per 64 MiB chunk), and each rank's digests travel to the coordinator with DCP's
own write results. In ``finish`` the coordinator writes the seal (``.ckptctl-seal.json``, what
``ckptctl seal`` writes, ``format.seal``) covering every file and ``.metadata`` itself, and only
then ``.metadata``, write-if-absent. ``.metadata`` is DCP's commit file, so the checkpoint is
complete by DCP's rule exactly when it is sealed: a save killed at any point leaves no
``.metadata``, which ``ls``, ``latest`` and torchtitan's own resume all read as unfinished.
A save into a directory a dead save left (no ``.metadata``) first removes that save's DCP files
and seal; a directory holding a committed checkpoint or files DCP does not write is refused.
S3 goes through the same ``Storage`` as every other ckptctl verb (one client, its retries and
conditional writes) rather than torch's fsspec writer, which would need s3fs and cannot write
if absent.

``Reader`` is DCP's ``FileSystemReader`` that, before DCP copies one byte into the state, reads
every range this rank will load (in the seal's chunks: the whole file for files of up to
64 MiB), hashes it and compares it with the seal; the ranks agree (one ``all_reduce``) and, if
any found a difference, every rank raises ``InvalidCheckpoint`` naming the file and byte
range and no state changes on any rank. ``.metadata`` is checked against the seal and read with
ckptctl's restricted unpickler (``interop.dcp_io``), never DCP's plain ``pickle.load``. The
tensors are then read by DCP's own code from the same open files (a local file: the descriptor
that was hashed; object storage: a temporary local copy of the ranges fetched in the first
pass), so a file swapped between the passes is never read.
Not covered: DCP's ``use_collectives=False`` (one ``.metadata`` per rank: refused) and storage
transforms (compression extensions): their bytes are hashed as written all the same.
"""

from __future__ import annotations

import io
import os
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptctl.errors import CkptError, InvalidCheckpoint, UsageError
from ckptctl.format.checksum import Hasher
from ckptctl.format.seal import CHUNK_SIZE, SEAL, Seal, SealedFile
from ckptctl.integrations.dcp_files import METADATA, SealingFiles
from ckptctl.interop.dcp_io import read_metadata
from ckptctl.layouts.dcp import DcpLayout
from ckptctl.layouts.seal_check import compare, hash_object, read_seal
from ckptctl.ops.seal.leftovers import remove_temporaries
from ckptctl.ops.seal.sealing import seal_as_written
from ckptctl.settings import VERIFY_PIECE
from ckptctl.storage import open_storage
from ckptctl.storage.base import Reader as StorageReader
from ckptctl.storage.base import ObjectInfo, Storage

_SEALED = "\x00ckptctl.sealed/"  # the fqn of a write result carrying one file's digests, never a tensor's
_DCP = DcpLayout()


class Writer(FileSystemWriter):
    """``FileSystemWriter`` that seals what it writes; see the module docstring. ``path`` is a
    directory or ``s3://bucket/prefix``; the other arguments are ``FileSystemWriter``'s."""

    def __init__(self, path: str | os.PathLike[str], *, single_file_per_rank: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 chunk_size: int = CHUNK_SIZE) -> None:
        url = os.fspath(path)
        # sync_files=False: each Storage writer makes its file durable on close (fsync of the
        # file and its directory, or a completed upload), which DCP's fsync alone does not.
        super().__init__(url, single_file_per_rank=single_file_per_rank, sync_files=False, thread_count=thread_count,
                         per_thread_copy_ahead=per_thread_copy_ahead, cache_staged_state_dict=cache_staged_state_dict,
                         overwrite=False)
        self.fs = SealingFiles(url, chunk_size)  # type: ignore[assignment]
        self.fs.commit = self._commit
        self.path = self.fs.init_path(url)  # type: ignore[assignment]
        self._files: list[SealedFile] = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise UsageError("ckptctl's DCP Writer needs dcp.save's collectives (use_collectives=True): one "
                             "coordinator seals the checkpoint after every rank's files are written",
                             hint="drop use_collectives=False, or use DCP's own FileSystemWriter")

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator, before any rank writes: the directory must hold no checkpoint, and
        # what a dead save of it left is removed (its seal would otherwise stand for old bytes).
        self._clear_dead_save(self.fs.storage)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner).value()  # DCP's file writer returns when done
        sealed = [WriteResult(index=MetadataIndex(_SEALED + f.name), size_in_bytes=0, storage_data=f)
                  for f in self.fs.take_written()]
        done: Future[list[WriteResult]] = Future()
        done.set_result(written + sealed)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._files = [r.storage_data for rs in results for r in rs if isinstance(r.storage_data, SealedFile)]
        plain = [[r for r in rs if not isinstance(r.storage_data, SealedFile)] for rs in results]
        super().finish(metadata, plain)  # writes .metadata.tmp, then "renames" it: ``_commit``

    def _commit(self, metadata: SealedFile, data: bytes) -> None:
        """Seal every file, ``.metadata`` included, then write ``.metadata``: DCP's commit."""
        st = self.fs.storage
        files = sorted([*self._files, metadata], key=lambda f: f.name)
        name = st.url.rstrip("/").rsplit("/", 1)[-1]
        done = seal_as_written(st, _DCP.name, _DCP.step_of(ObjectInfo(name, 0, 0.0, "dir")), files, chunk_size=self.fs.chunk_size)
        if done.status != "sealed" or not st.write_if_absent(METADATA, data):
            raise InvalidCheckpoint(f"{st.url}: another save of this checkpoint committed it meanwhile; this one "
                                    "was not committed", hint="two jobs are saving into one directory; stop one")

    @staticmethod
    def _clear_dead_save(st: Storage) -> None:
        if st.stat(METADATA) is not None:
            raise UsageError(f"{st.url_of(METADATA)} exists: a committed checkpoint is never written over",
                             hint="save each step into a directory of its own (step-N), or delete the old one first")
        remove_temporaries(st)
        foreign = [i.key for i in st.list() if i.key != SEAL and not _DCP.claims(st, frozenset({i.key.rsplit("/", 1)[-1]}))]
        if foreign:
            raise UsageError(f"{st.url} holds files DCP does not write ({', '.join(sorted(foreign)[:3])}); "
                             "the seal could not cover them", hint="save into an empty directory")
        for info in list(st.list()):  # a dead save's: it never reached .metadata, so nothing reads them
            st.delete(info.key)


class Reader(FileSystemReader):
    """``FileSystemReader`` that checks every byte it loads against the checkpoint's seal
    first; see the module docstring. ``process_group``: the group ``dcp.load`` runs in (the
    ranks agree on the verdict through it; default: the whole job)."""

    def __init__(self, path: str | os.PathLike[str], *, process_group: Any = None) -> None:
        super().__init__(os.fspath(path))
        self.storage = open_storage(os.fspath(path))
        self.path = os.fspath(path)  # type: ignore[assignment]
        self.process_group = process_group
        self._seal: Seal | None = None
        self.fs = _CheckedFiles()  # type: ignore[assignment]

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.fs = _CheckedFiles()  # type: ignore[assignment]
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.storage = open_storage(os.fspath(checkpoint_id))
        self._seal = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        st = self.storage
        seal = read_seal(st)
        if seal is None:
            raise InvalidCheckpoint(f"{st.url}: no {SEAL}: nothing to check its bytes against",
                                    hint="save with ckptctl.integrations.dcp.Writer, or run `ckptctl seal` on it "
                                         "(it test-loads the checkpoint first)")
        entry = seal.by_name().get(METADATA)
        if entry is None:
            raise InvalidCheckpoint(f"{st.url_of(METADATA)}: not covered by the seal; not loaded",
                                    hint="the seal is not this checkpoint's; do not trust it")
        got = hash_object(st, METADATA, seal.chunk_size)
        assert got is not None
        for p in compare(entry, got, seal.chunk_size):
            raise InvalidCheckpoint(f"{st.url_of(METADATA)}: {p.message}; not loaded", hint=p.hint)
        self._seal = seal
        md = read_metadata(st)  # the restricted unpickler; checks every record lies inside its file
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        wanted: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            wanted.setdefault(os.fspath(info.relative_path), []).append((info.offset, info.offset + info.length))
        files = self.fs
        try:
            problem = self._check(wanted, files)
            self._agree(problem)
            return super().read_data(plan, planner)
        finally:
            files.close()

    def _check(self, wanted: dict[str, list[tuple[int, int]]], files: "_CheckedFiles") -> str | None:
        """The first pass: every chunk this rank will read, hashed and compared with the seal;
        the open files are kept for DCP's pass. Returns what is wrong, or None."""
        assert self._seal is not None
        sealed = self._seal.by_name()
        try:
            for rel in sorted(wanted):
                entry = sealed.get(rel)
                if entry is None:
                    return f"{self.storage.url_of(rel)}: not covered by the seal; not loaded"
                found = files.open(self.storage, rel, entry, self._seal.chunk_size, wanted[rel])
                if found is not None:
                    return found
        except CkptError as e:
            return str(e)
        return None

    def _agree(self, problem: str | None) -> None:
        """Every rank raises if any rank found a problem, before any rank applies a byte."""
        failed = problem is not None
        if dist.is_available() and dist.is_initialized() and self.use_collectives:
            if dist.get_world_size(self.process_group) > 1:
                flag = torch.tensor([int(failed)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
                failed = bool(flag.item())
        if problem is not None:
            raise InvalidCheckpoint(problem, hint="no tensor was loaded; load an older checkpoint "
                                                  "(`ckptctl latest ROOT` names the newest that verifies)")
        if failed:
            raise InvalidCheckpoint(f"{self.storage.url}: another rank found bytes that differ from the seal; "
                                    "not loaded", hint="its error names the file and range; load an older checkpoint")


class _CheckedFiles:
    """The files one ``read_data`` checked, open, served to DCP's own reading code
    (``FileSystemReader`` calls ``create_stream``): a local file through the descriptor that
    was hashed; an object's checked ranges from a temporary local copy."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[StorageReader, Any]] = {}

    def open(self, st: Storage, rel: str, entry: SealedFile, chunk_size: int,
             ranges: Sequence[tuple[int, int]]) -> str | None:
        reader = st.open_reader(rel)
        spool = None if reader.local_fd() is not None else tempfile.TemporaryFile()
        self._open[rel] = (reader, spool)
        if reader.size != entry.size:
            return f"{st.url_of(rel)}: {reader.size} bytes, sealed with {entry.size}: resized after sealing; not loaded"
        pieces = list(entry.pieces(chunk_size))
        needed = sorted({i for lo, hi in ranges for i, (s, e, _d) in enumerate(pieces) if s < hi and lo < e})
        for i in needed:
            start, end, want = pieces[i]
            h = Hasher()
            offset = start
            while offset < end:
                data = reader.read(offset, min(VERIFY_PIECE, end - offset))
                h.update(data)
                if spool is not None:
                    spool.seek(offset)
                    spool.write(data)
                offset += len(data)
            if h.hexdigest() != (want or entry.xxh3):
                return (f"{st.url_of(rel)} bytes {start}-{end}: XXH3 differs from the seal: the bytes changed after "
                        "they were written (bit rot or an overwrite); not loaded")
        return None

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        reader, spool = self._open[os.fspath(path)]  # KeyError: DCP asked for a file it did not plan
        if spool is not None:
            spool.seek(0)
            yield spool
            return
        fd = reader.local_fd()
        assert fd is not None
        with os.fdopen(os.dup(fd), "rb") as f:
            yield f  # type: ignore[misc]

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return suffix

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)

    def close(self) -> None:
        for reader, spool in self._open.values():
            reader.close()
            if spool is not None:
                spool.close()
        self._open.clear()


__all__ = ["Reader", "Writer"]
