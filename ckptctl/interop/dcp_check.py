"""Validation of DCP's ``.metadata`` after the restricted unpickler built it: the metadata is
untrusted input like any of ckptctl's own files.

Reading stays inside the checkpoint: every storage record must name one plain file in the
checkpoint directory (no ``../other_run/__0_0.distcp``, no absolute path, no subdirectory: DCP
itself writes flat ``__R_N.distcp`` names), that file must be a regular file (never a FIFO that
would block the reader, never a symlink out of the directory), and the record's byte range must
lie inside it. Tensor sizes and chunks are checked too: non-negative, within int64 once
multiplied by the element size, chunks inside their tensor.
"""

from __future__ import annotations

import os
from typing import Any

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes, parse
from ckptctl.storage.base import Storage
from ckptctl.storage.stored_file import regular_size

_HINT = "the DCP metadata was altered or is damaged; do not trust this checkpoint"


def check_metadata(md: Any, store: Storage, where: str) -> None:
    """Raise InvalidCheckpoint naming ``where`` and the record unless ``md`` (a DCP Metadata)
    is in range and every record stays inside the checkpoint ``store``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        raise _bad(where, "state_dict_metadata is not a dict")
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise _bad(where, "planner_data is not a dict")
    for fqn, meta in sdm.items():
        if not isinstance(fqn, str) or not fqn.isprintable():
            raise _bad(where, f"entry name {ascii(fqn)[:80]} is not a printable string")
        if isinstance(meta, TensorStorageMetadata):
            _check_tensor(fqn, meta, where)
        elif not isinstance(meta, BytesStorageMetadata):
            raise _bad(where, f"entry {fqn!r}: unknown metadata type {type(meta).__name__}")
    storage = md.storage_data
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise _bad(where, "storage_data is not a dict")
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", "?")
        rel = getattr(info, "relative_path", None)
        name = os.fspath(rel) if isinstance(rel, os.PathLike) else rel
        if not parse.plain_file_name(name):
            raise InvalidCheckpoint(
                f"{where}: record {fqn!r} names {name!r}, not a plain file name inside the checkpoint directory",
                hint=_HINT,
            )
        if name not in sizes:
            sizes[name] = _regular_size(store, name, fqn, where)
        err = lambda why, fqn=fqn: _bad(where, f"record {fqn!r}: {why}")  # noqa: E731
        offset = parse.as_int(getattr(info, "offset", None), lo=0, hi=parse.INT64_MAX, err=lambda w: err(f"offset {w}"))
        length = parse.as_int(getattr(info, "length", None), lo=0, hi=parse.INT64_MAX, err=lambda w: err(f"length {w}"))
        if offset + length > sizes[name]:
            # The metadata may be fine and the data file short: say both, and what to do.
            raise InvalidCheckpoint(
                f"{where}: record {fqn!r}: bytes {offset}..{offset + length} lie past the end of {name} "
                f"({sizes[name]} bytes)",
                hint=f"{name} was cut short (an interrupted copy or a full disk), or the metadata was altered; "
                     "use an older checkpoint")


def _check_tensor(fqn: str, meta: Any, where: str) -> None:
    err = lambda why: _bad(where, f"tensor {fqn!r}: {why}")  # noqa: E731
    dtype = getattr(getattr(meta, "properties", None), "dtype", None)
    try:
        itemsize = dtypes.itemsize(dtypes.name_of(dtype))
    except ValueError:
        itemsize = 1  # an unsupported dtype is dropped by the reader, never read
    size = parse.shape(_ints(meta.size, err), itemsize, lambda why: err(f"size {why}"))
    chunks = meta.chunks
    if not isinstance(chunks, list):
        raise err("chunks is not a list")
    for c in chunks:
        offsets = parse.shape(_ints(getattr(c, "offsets", None), err), 1, lambda why: err(f"chunk offsets {why}"))
        sizes = parse.shape(_ints(getattr(c, "sizes", None), err), itemsize, lambda why: err(f"chunk sizes {why}"))
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise err(f"a chunk has {len(offsets)}/{len(sizes)} dimensions, the tensor {len(size)}")
        if any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise err(f"chunk at {list(offsets)} of size {list(sizes)} lies outside size {list(size)}")


def _ints(v: Any, err: Any) -> list[Any]:
    """A torch.Size or sequence as a plain list for ``parse.shape``; anything else refused."""
    if isinstance(v, (list, tuple)):
        return list(v)
    raise err(f"size {type(v).__name__} is not a sequence")


def _regular_size(store: Storage, name: str, fqn: str, where: str) -> int:
    size = regular_size(store, name)
    if size is not None:
        return size
    if store.stat(name) is None:
        raise _bad(where, f"record {fqn!r}: {name} is missing")
    raise InvalidCheckpoint(
        f"{store.url_of(name)} is not a regular file (a symlink, FIFO, device or directory); named by record {fqn!r}",
        hint=_HINT,
    )


def _bad(where: str, message: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"{where}: {message}", hint=_HINT)
