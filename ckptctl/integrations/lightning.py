"""Lightning: a ``CheckpointIO`` plugin that writes each ``.ckpt`` whole and durably, and loads
nothing that fails ``ckptctl verify``.

    from lightning.pytorch import Trainer
    from ckptctl.integrations.lightning import CheckpointIO

    trainer = Trainer(plugins=[CheckpointIO(asynchronous=True)], callbacks=[ModelCheckpoint(...)])

Saving: ``torch.save`` streams the checkpoint straight into a ``Storage`` writer (local: a
hidden temporary beside the final name, fsync, rename, directory fsync; ``s3://``: one upload
completed on close), so a ``.ckpt`` is either whole and durable or absent. Lightning's own
``TorchCheckpointIO`` serialises into memory and moves a file from the system temporary
directory, which is a copy when that is another filesystem (a kill mid-copy leaves a cut
``.ckpt``) and is never fsynced. The checksums are the archive's own: ``torch.save`` writes a
CRC-32 of every record as it writes it, and ``ckptctl verify`` checks them all, with the zip
structure (a checkpoint that is one file has no directory to hold a seal, ``layouts.lightning``).

``asynchronous=True`` works as Lightning's ``AsyncCheckpointIO``: the training thread only
clones the tensors (a consistent snapshot; the stall is that copy), and one background thread
serialises and writes. ``ModelCheckpoint``'s ``save_top_k`` removes its files through this
plugin as it always does, but a removal runs on that thread after every write handed over
before it, and not at all once a write has failed: Lightning's own ``AsyncCheckpointIO``
deletes the displaced file while the new one is still being written, so a job killed then has
lost both. ``load_checkpoint`` of a file still being written waits for it; an error of a
background write is raised at the next save or at ``teardown``.

Loading: the file is verified as ``ckptctl verify`` verifies it (zip structure and every
record's CRC-32: the one verify engine, ``ops.verify.engine.verify``) before anything is unpickled, then read
with ``torch.load(weights_only=True)``, allowing ``pathlib`` paths as ``layouts.lightning``
does (more with ``torch.serialization.add_safe_globals``); a damaged file raises
``InvalidCheckpoint`` naming it, and the model is left as it was.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from ckptctl.errors import InvalidCheckpoint
from ckptctl.integrations.stream import StorageStream
from ckptctl.layouts.lightning import PATHS, LightningLayout
from ckptctl.ops.verify.engine import verify
from ckptctl.storage import open_storage
from ckptctl.storage.base import Storage

log = logging.getLogger("ckptctl")

def _where(path: str | os.PathLike[str]) -> tuple[Storage, str]:
    """The storage of the file's directory and the file's name in it."""
    text = os.fspath(path)
    head, _, name = text.rstrip("/").rpartition("/")
    if not name:
        raise ValueError(f"{text!r} names no file")
    return open_storage(head or "."), name


class CheckpointIO(_LightningCheckpointIO):
    """See the module docstring."""

    def __init__(self, *, asynchronous: bool = False) -> None:
        super().__init__()
        self.asynchronous = asynchronous
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # raised at the next save or teardown
        self._failed = False  # a background write failed: removals are dropped from then on

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ckptctl's CheckpointIO takes no storage_options: give a local path or an s3:// URL")
        self._raise_error()
        key = os.fspath(path)
        if not self.asynchronous:
            _write(checkpoint, key)
            return
        snapshot = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-lightning")
        self.wait(key)  # a second save of the same name goes after the first, never beside it
        future = self._executor.submit(_write, snapshot, key)
        with self._lock:
            self._pending[key] = future
        future.add_done_callback(lambda f, key=key: self._done(key, f))

    def _done(self, key: str, future: "Future[None]") -> None:
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
            if future.exception() is not None:
                self._failed = True
                self._error = self._error or future.exception()

    def _raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self, path: Any = None) -> None:
        """Wait for the background write of ``path`` (every one for None) to finish."""
        with self._lock:
            futures = list(self._pending.values()) if path is None else [self._pending.get(os.fspath(path))]
        for f in futures:
            if f is not None:
                f.exception()  # waits; the error itself is kept for ``_raise_error``

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self.wait(path)
        st, name = _where(path)
        if st.stat(name) is None:
            raise FileNotFoundError(f"Checkpoint file not found: {os.fspath(path)}")
        report = verify(st.sub(name), LightningLayout().for_root(st), "checksums")
        if not report.ok:
            first = report.problems[0]
            raise InvalidCheckpoint(f"{st.url_of(name)}: {first.message}; not loaded",
                                    hint=first.hint or "load an older checkpoint (`ckptctl latest DIR` names one)")
        local = st.local_path(name)
        with torch.serialization.safe_globals(list(PATHS)):
            if local is not None:
                return torch.load(local, map_location=map_location, weights_only=True)
            return torch.load(io.BytesIO(st.read(name, max_size=1 << 40)), map_location=map_location, weights_only=True)

    def remove_checkpoint(self, path: Any) -> None:
        key = os.fspath(path)
        if self._executor is None:
            _remove(key)
            return
        # ModelCheckpoint removes the file a new save displaces right after handing that save
        # over: the removal waits its turn behind every write handed over before it, and is
        # dropped if one of them failed, so an older checkpoint never goes before the newer one
        # is durable (a job killed meanwhile keeps both).
        self._executor.submit(self._remove_if_written, key)

    def _remove_if_written(self, key: str) -> None:
        with self._lock:
            failed = self._failed
        if failed:
            log.warning("ckptctl: kept %s: a newer checkpoint's write failed", key)
            return
        _remove(key)

    def teardown(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._raise_error()


def _remove(path: str) -> None:
    st, name = _where(path)
    st.delete(name)


def _write(checkpoint: dict[str, Any], path: str) -> None:
    st, name = _where(path)
    with StorageStream(st.open_writer(name)) as stream:
        torch.save(checkpoint, stream)  # type: ignore[arg-type]


__all__ = ["CheckpointIO"]
