"""``inspect``: what one checkpoint holds, asked of its handler (one road for every kind): its
layout's ``inspect`` (a manifest's contents for ckptctl's own, no tensor data read; another
tool's checkpoint through the reader of its files' format), or a file format's.

The results are ``layouts.inspected``'s: ``InspectResult`` and ``ForeignInspect``, both with
``content``: resumable or a model-only export, as the layout tells.
"""

from __future__ import annotations

from ckptctl.errors import InvalidCheckpoint
from ckptctl.layouts.classify import classify
from ckptctl.layouts.inspected import ForeignInspect, InspectResult, Inspected
from ckptctl.storage.base import Storage

__all__ = ["ForeignInspect", "InspectResult", "Inspected", "inspect_checkpoint"]


def inspect_checkpoint(ckpt: Storage, *, tensors: bool = False) -> Inspected:
    """What the checkpoint ``ckpt`` holds, by whichever layout (or file format) its name and
    files say it is (``layouts.classify``); ``tensors`` lists each tensor. Raises
    InvalidCheckpoint when it is no checkpoint or no reader takes it."""
    found = classify(ckpt.url)
    if found.what not in ("checkpoint", "file"):
        raise InvalidCheckpoint(f"not a checkpoint: {ckpt.url} ({found.reason or found.what})")
    return found.handler.inspect(ckpt, tensors=tensors)
