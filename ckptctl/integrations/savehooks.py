"""Hashing each file the Hugging Face Trainer or accelerate's ``save_state`` writes as soon as
it is closed, while the save goes on: neither stack hands its bytes over, but both write their
large files through ``torch.save`` and safetensors' ``save_file``.

Inside ``recording()``, on the thread that entered it and until it leaves (by an exception
too), those functions run unchanged (the same bytes, the same files), and when one returns
having written a file named by its path, that file is queued for one background thread that
reads it back from the page cache (where it was just written: no disk read) and hashes it
(``layouts.seal_check.hash_object``: whole file and per chunk, as ``ckptctl seal`` does). The
model's file is hashed while the optimizer's is written, and so on, so that by the end of the
save little is left to hash; the training thread itself does no hashing.

Why not hash the bytes on their way to the file, with no read at all: measured on the
Trainer's and accelerate's saves (``scripts/bench_integrations.py``, 256 MiB, a quiet machine),
hashing on the training thread made the save block training 1.12-1.13x as long (the target is
1.05x), this read-back 1.01-1.03x, and time to durable was no better (``docs/decisions.md``).

Each entry is kept with the file's identity when it was closed (device, inode, size, mtime,
ctime), checked again after it was read and when the seal asks for it (``Recorded.entry``): a
file changed or replaced since gets no entry, and the sealer reads it again, as it does every
file no hook saw written (``trainer_state.json``, JSON configs, another process's RNG file).
Calls from other threads, to file objects or bytes paths, pass straight through.

The functions are swapped where the stacks look them up at each call (``torch.save``,
``safetensors.torch.save_file``, and the aliases a caller names, such as
``transformers.modeling_utils.safe_save_file``) while at least one recording is open, and put
back when the last one closes.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import safetensors.torch
import torch

from ckptctl.errors import CkptError
from ckptctl.format.seal import CHUNK_SIZE, SealedFile, chunk_count
from ckptctl.layouts.seal_check import hash_object
from ckptctl.storage import open_storage

Identity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class _Hashed:
    identity: Identity
    entry: SealedFile  # named by the file's base name, checked too (an inode may be reused)


class Recorded:
    """The files written inside one ``recording``, each hashed once after it was closed."""

    def __init__(self, chunk_size: int = CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._files: dict[tuple[int, int], _Hashed] = {}  # by device and inode: however the path is spelled

    def closed(self, path: str) -> None:
        """``path`` was just written and closed: hash it on the background thread."""
        try:
            identity = _identity(os.stat(path, follow_symlinks=False))
        except OSError:  # gone already: the sealer will find what is there
            return
        self._pending.append(_hasher().submit(self._hash, path, identity))

    def _hash(self, path: str, identity: Identity) -> None:
        head, name = os.path.split(path)
        try:
            got = hash_object(open_storage(head), name, self.chunk_size)
            after = _identity(os.stat(path, follow_symlinks=False))
        except (OSError, CkptError):  # gone or refused: the sealer reads what is there, or refuses it
            return
        assert got is not None
        if after == identity:  # else it changed while it was read: no entry, the sealer reads it
            with self._lock:
                self._files[identity[:2]] = _Hashed(identity, SealedFile(name, got.size, got.xxh3, got.chunks))

    def wait(self) -> None:
        """Wait until every file closed so far is hashed."""
        for future in self._pending:
            future.result()

    def entry(self, path: str, chunk_size: int) -> SealedFile | None:
        """``path``'s entry, hashed after it was closed, or None: no hook saw it written, it is
        no longer exactly the file written then (changed, replaced), or its chunks are of
        another size. Waits for the files still being hashed."""
        self.wait()
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        with self._lock:
            got = self._files.get((st.st_dev, st.st_ino))
        if (got is None or got.identity != _identity(st) or got.entry.name != os.path.basename(path)
                or chunk_size != self.chunk_size
                or len(got.entry.chunks) != chunk_count(st.st_size, chunk_size)):
            return None
        return got.entry


_hashing_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
    """The one thread that hashes what every recording saw closed, in order."""
    global _hashing_pool
    with _lock:
        if _hashing_pool is None:
            _hashing_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-hash")
        return _hashing_pool


_local = threading.local()  # .recorded: the innermost open recording of this thread


def _path(f: Any) -> str | None:
    """The path a save names, or None for a file object or a bytes path (passed through)."""
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        return path if isinstance(path, str) else None
    return None


def _noting(original: Callable[..., Any], keyword: str) -> Callable[..., Any]:
    """``original`` (``torch.save(obj, f)``, ``save_file(tensors, filename)``: the file is the
    second argument, or ``keyword``) telling this thread's recording which file it closed."""

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        recorded: Recorded | None = getattr(_local, "recorded", None)
        path = _path(args[1] if len(args) > 1 else kwargs.get(keyword))
        if recorded is not None and path is not None:
            recorded.closed(path)
        return result

    return save


@dataclass
class _Swap:
    module: ModuleType
    name: str
    original: Any
    noting: Any
    users: int = 0


_swaps: dict[tuple[int, str], _Swap] = {}


def _swap_in(targets: Sequence[tuple[ModuleType, str, str]]) -> list[tuple[int, str]]:
    taken: list[tuple[int, str]] = []
    with _lock:
        for module, name, keyword in targets:
            key = (id(module), name)
            swap = _swaps.get(key)
            if swap is None:
                original = getattr(module, name, None)
                if not callable(original):
                    continue
                swap = _swaps[key] = _Swap(module, name, original, _noting(original, keyword))
                setattr(module, name, swap.noting)
            swap.users += 1
            taken.append(key)
    return taken


def _swap_out(taken: list[tuple[int, str]]) -> None:
    with _lock:
        for key in taken:
            swap = _swaps[key]
            swap.users -= 1
            if swap.users == 0:
                del _swaps[key]
                if getattr(swap.module, swap.name, None) is swap.noting:  # else swapped since by another: theirs stays
                    setattr(swap.module, swap.name, swap.original)


@contextmanager
def recording(also: Sequence[tuple[ModuleType, str]] = (), chunk_size: int = CHUNK_SIZE) -> Iterator[Recorded]:
    """Hash each file this thread saves with ``torch.save`` or safetensors' ``save_file`` as
    soon as it is closed, until the block ends; ``also``: the other names the stack calls
    safetensors' ``save_file`` by (``(transformers.modeling_utils, "safe_save_file")``). See
    the module docstring."""
    recorded = Recorded(chunk_size)
    targets = [(torch, "save", "f"), (safetensors.torch, "save_file", "filename")]
    targets += [(module, name, "filename") for module, name in also]
    taken = _swap_in(targets)
    outer = getattr(_local, "recorded", None)
    _local.recorded = recorded
    try:
        yield recorded
    finally:
        _local.recorded = outer
        _swap_out(taken)


__all__ = ["Recorded", "recording"]
