"""Loading one committed checkpoint into a training state, as one rank of a job of any size.

``load_checkpoint`` opens the checkpoint (marker, manifest, the shard headers it needs), reads
every tensor of the state into place, checking the checksum of every chunk it reads from, and
restores the rest of the state. Choosing *which* checkpoint to load, and agreeing on it across
ranks, is ``ckptctl.Checkpointer.load_latest``'s.
"""

from __future__ import annotations

from typing import Any

from ckptctl.load.into_state import load_into
from ckptctl.load.reader import CheckpointReader
from ckptctl.load.staged import HostLender
from ckptctl.storage.base import Storage


def load_checkpoint(ckpt: Storage, state: dict[str, Any], *, strict: bool = True, rank: int = 0,
                    spool_dir: str | None = None, host: HostLender | None = None) -> int:
    """Restore ``state`` in place from the committed checkpoint ``ckpt``; returns its step.

    Raises ``InvalidCheckpoint``/``NotFound`` when the checkpoint is not committed or any byte
    read fails its checksum (an older checkpoint may do), ``StateError`` when the state does
    not match the checkpoint (no older checkpoint fixes that).

    ``host`` lends host memory the size of this rank's share: each byte is then read once into
    it and checked before the state changes (``load.staged``). Without it the load reads and
    checks every chunk, then reads it again into place; from object storage the first pass
    fetches the bytes once into a temporary file in ``spool_dir`` (default ``$TMPDIR``;
    ``load.spool``), removed before this returns or raises."""
    with CheckpointReader(ckpt, spool_dir=spool_dir) as reader:
        return load_into(reader, state, strict=strict, rank=rank, host=host).step
