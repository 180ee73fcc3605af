"""``ls``: every checkpoint under a root with its step, status, size and age.

The catalog (``ckptctl.layouts.catalog``) decides what is a checkpoint and its status from
its layout's commit rule only (cheap): ``committed``, ``partial`` (not committed: being
written, or abandoned), ``corrupt`` (claims to be committed but is not self-consistent),
``link`` (a symlink, which ckptctl never follows) or ``unknown`` (named like a checkpoint, but
no layout recognises its files; never deleted). ``verify`` finds the rest. This module adds
what ``ls`` prints beside it: the layout (FORMAT: ckptctl, dcp, hf-trainer, megatron,
deepspeed, lightning), size and age.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from ckptctl.layouts import catalog
from ckptctl.layouts.native import total_size
from ckptctl.storage.base import Storage


@dataclass(frozen=True)
class Listed:
    step: int
    name: str
    url: str
    status: str
    size: int
    created: float  # manifest time when committed, else newest modification inside
    age_s: float
    reason: str | None = None  # why it is not committed: the layout's completeness rule
    layout: str = "ckptctl"  # the FORMAT column: which layout's checkpoint it is

    def to_dict(self) -> dict:
        return asdict(self)


def list_checkpoints(root: Storage, *, now: float | None = None) -> list[Listed]:
    """Every checkpoint under ``root``, oldest first, with its size and age."""
    now = time.time() if now is None else now
    out = []
    for e in catalog.list_checkpoints(root):
        if e.storage is None:  # a link: nothing behind it is looked at
            out.append(Listed(e.step, e.name, e.url, e.status, 0, 0.0, 0.0, e.reason, e.layout))
            continue
        info = root.stat(e.name)
        # A checkpoint that is one file (Lightning's *.ckpt): its own size and time.
        size, created = (info.size, info.mtime) if info is not None and info.kind == "file" else total_size(e.storage)
        sealed = catalog.sealed_commit_time(e)  # a sealed checkpoint's own commit time, not its seal's
        if sealed is not None:
            created = sealed
        if e.manifest is not None:
            created = e.manifest.created
        out.append(Listed(e.step, e.name, e.url, e.status, size, created, max(0.0, now - created), e.reason, e.layout))
    return out
