"""Which format a checkpoint path holds, from names and magic bytes only.

Kept apart from the format readers (``dcp_io``, ``safetensors_io``, ``torch_io``), which import
torch: ``ckptctl verify`` and ``ckptctl inspect`` ask "is this another tool's checkpoint?"
first, and for a ckptctl checkpoint the answer must not cost a torch import (seconds of start-up
in shell loops and cron jobs). The readers import their file names from here.
"""

from __future__ import annotations

import os
from typing import Literal

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.format.formats import FILE_FORMATS, name_among
from ckptctl.format.layout import MANIFEST, MARKER, is_own_shard_name
from ckptctl.storage import open_storage
from ckptctl.storage.plain_file import open_plain

Format = Literal["ckptctl", "dcp", "safetensors", "torch"]
# The file formats of the shared vocabulary (``format.formats``), which names layouts too.
FORMATS: tuple[Format, ...] = FILE_FORMATS  # type: ignore[assignment]


def format_named(name: str) -> Format:
    """The file format ``name`` (a name or an alias of ``format.formats``) stands for. Raises
    UsageError for an unknown name or a layout that is no file format (``--to hf-trainer``)."""
    try:
        return name_among(name, FILE_FORMATS)  # type: ignore[return-value]
    except ValueError as e:
        raise UsageError(f"--to: {e}", hint=f"use one of {', '.join(FILE_FORMATS)}") from None

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def is_torch_file(path: str) -> bool:
    """A torch.save file: by suffix, else by the zip magic its layout starts with."""
    if path.endswith(TORCH_SUFFIXES):
        return True
    f = open_plain(path)  # never blocks on a FIFO
    if f is None:
        return False
    with f:
        return f.read(4) == b"PK\x03\x04"


def format_by_name(name: str, kind: str, names: frozenset[str] = frozenset()) -> Format | None:
    """safetensors or torch from names only, where reading magic bytes costs a request (object
    storage): a file ``name`` by its suffix, a directory (``kind`` "dir") by the ``names`` of
    its files. None for anything else; ckptctl's and DCP's directories are their layouts'."""
    if kind == "file":
        return "safetensors" if name.endswith(".safetensors") else "torch" if name.endswith(TORCH_SUFFIXES) else None
    return "safetensors" if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names) else None


def detect(path: str) -> Format:
    """Which format ``path`` holds. Raises UsageError naming the path when none matches, and
    InvalidCheckpoint for a DCP directory whose save did not finish (no ``.metadata``)."""
    if "://" in path and not path.startswith("file://"):
        st = open_storage(path)
        if st.stat(MARKER) is not None or st.stat(MANIFEST) is not None:
            return "ckptctl"
        raise UsageError(f"{path}: only ckptctl checkpoints are read from object storage",
                         hint="copy foreign checkpoints to a local directory first")
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if MARKER in names or MANIFEST in names or any(is_own_shard_name(n) for n in names):
            return "ckptctl"  # committed, or a ckptctl save still in progress (shards, no manifest yet)
        if ".metadata" in names:
            return "dcp"
        if any(n.endswith(".distcp") for n in names):
            # DCP writes .metadata last (after every rank's files): without it the save did not finish.
            raise InvalidCheckpoint(f"{path}: DCP files (*.distcp) but no .metadata, which DCP writes last: "
                                    "this save did not finish",
                                    hint="use a checkpoint whose save completed (`ckptctl latest ROOT` names the newest)")
        if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        raise UsageError(f"{path}: no manifest.json (ckptctl), .metadata (DCP) or *.safetensors here",
                         hint="point at the checkpoint directory or file itself")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return "safetensors"
        if is_torch_file(path):
            return "torch"
        raise UsageError(f"{path}: not a .safetensors or torch.save (.pt/.pth/.bin) file")
    raise UsageError(f"{path} does not exist")


def foreign_format(path: str) -> Format | None:
    """The format of ``path`` when it is a local checkpoint of another tool, else None (a
    ckptctl checkpoint, an object-store URL, or nothing recognisable: the caller's own errors
    apply)."""
    if "://" in path:
        return None
    try:
        fmt = detect(path)
    except (UsageError, InvalidCheckpoint):  # nothing recognisable, or a DCP save that did not finish
        return None
    return None if fmt == "ckptctl" else fmt
