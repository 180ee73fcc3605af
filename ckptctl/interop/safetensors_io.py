"""Hugging Face safetensors: one file, or a directory of shards with
``model.safetensors.index.json``, read and written one tensor at a time.

Reading parses each header with ckptctl's own defensive parser (bounded length, offsets checked
against the file size, entries tiling the data section) and copies each tensor with one ranged
read: no mmap, so resident memory stays one tensor however large the files are.

Writing computes each file's header from shapes alone (safetensors headers hold no checksums),
then streams the tensors behind it: every byte is read once and written once. The ckptctl state
tree, when there is one, travels in ``__metadata__["ckptctl.state"]`` so that a round trip
back to ckptctl restores the exact structure; ``__metadata__["format"] = "pt"`` is what
``transformers`` expects.
"""

from __future__ import annotations

import json
import posixpath
import struct
from typing import Any, Sequence

import torch

from ckptctl.errors import InvalidCheckpoint, UsageError
from ckptctl.format import dtypes
from ckptctl.format.checkpoint import read_header
from ckptctl.format.shard import MAX_HEADER_BYTES, header_length
from ckptctl.interop.base import Fill, Source, TensorBuffer, TensorMeta, Written, byte_view, group_of
from ckptctl.interop.detect import SAFETENSORS_INDEX as INDEX
from ckptctl.storage import Storage, open_storage

SINGLE = "model.safetensors"
STATE_KEY = "ckptctl.state"
STEP_KEY = "ckptctl.step"
WRITE_PIECE = 64 << 20


def is_safetensors_dir(storage: Storage) -> bool:
    names = [i.key for i in storage.children()]
    return INDEX in names or any(n.endswith(".safetensors") for n in names)


class SafetensorsSource(Source):
    kind = "safetensors"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.url = path
        if path.endswith(".safetensors"):
            parent, base = posixpath.split(path.rstrip("/"))
            self.storage = open_storage(parent or ".")
            files = [base]
        else:
            self.storage = open_storage(path)
            files = self._files()
        self._where: dict[str, tuple[str, int, int]] = {}  # name -> (file, begin, end) in the file
        self._readers: dict[str, Any] = {}
        for f in files:
            self._add_file(f)
        state = self.metadata.pop(STATE_KEY, None)
        if state is not None:
            try:
                self.tree = json.loads(state)
            except json.JSONDecodeError:
                self.dropped.append(f"{STATE_KEY} metadata is not valid JSON")
        step = self.metadata.pop(STEP_KEY, None)
        if step is not None and step.isdigit():
            self.step = int(step)

    def _files(self) -> list[str]:
        idx = self.storage.stat(INDEX)
        if idx is None:
            files = sorted(i.key for i in self.storage.children() if i.key.endswith(".safetensors") and i.kind == "file")
            if not files:
                raise UsageError(f"{self.storage.url}: no *.safetensors files and no {INDEX}")
            return files
        where = self.storage.url_of(INDEX)
        try:
            doc = json.loads(self.storage.read(INDEX, max_size=MAX_HEADER_BYTES))
            weight_map = doc["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise InvalidCheckpoint(f"{where}: not a valid safetensors index ({e!r})") from None
        for f in files:
            if not isinstance(f, str) or "/" in f or f in ("", ".", ".."):
                raise InvalidCheckpoint(f"{where}: refusing shard name {f!r}: not a plain file name in the directory",
                                        hint="the index was altered; treat this checkpoint as untrusted")
        return files

    def _add_file(self, fname: str) -> None:
        h = read_header(self.storage, fname)  # validates bounds and tiling
        for c in h.chunks:
            if any(c.offsets):
                raise UsageError(f"{self.storage.url_of(fname)} is one shard of a ckptctl checkpoint, not whole tensors",
                                 hint="convert the checkpoint directory that holds its manifest.json")
            if c.name in self._where:
                raise InvalidCheckpoint(f"{self.storage.url_of(fname)}: tensor {c.name!r} also appears in {self._where[c.name][0]}")
            self._where[c.name] = (fname, h.data_start + c.begin, h.data_start + c.end)
            self.tensors[c.name] = TensorMeta(c.name, c.dtype, tuple(c.shape), group_of(c.name))
        raw = json.loads(h.header_bytes[8:])
        meta = raw.get("__metadata__") or {}
        if isinstance(meta, dict):
            for k, v in meta.items():
                if isinstance(k, str) and isinstance(v, str) and k != "ckptctl":
                    self.metadata.setdefault(k, v)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        fname, begin, end = self._where[name]
        r = self._readers.get(fname)
        if r is None:
            r = self._readers[fname] = self.storage.open_reader(fname)
        view = byte_view(out)
        assert len(view) == end - begin, name
        if len(view):
            r.read_into(begin, view)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


def build_header(metas: Sequence[TensorMeta], metadata: dict[str, str]) -> tuple[bytes, list[TensorMeta]]:
    """The header bytes and the order the tensors follow it in (largest element size first, so
    every tensor is aligned to its element size, then by name)."""
    order = sorted(metas, key=lambda m: (-dtypes.itemsize(m.dtype), m.name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for m in order:
        header[m.name] = {"dtype": dtypes.code_of(m.dtype), "shape": list(m.shape), "data_offsets": [pos, pos + m.nbytes]}
        pos += m.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def write_safetensors(dst: str, metas: Sequence[TensorMeta], fill: Fill, *, metadata: dict[str, str],
                      max_shard_size: int | None = None) -> Written:
    """``dst`` ending in ``.safetensors``: one file. Otherwise a directory: ``model.safetensors``
    when everything fits in ``max_shard_size`` (or none is given), else
    ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (written last).
    Tensors stay in name order across shards; a tensor larger than the limit gets a shard alone."""
    total = sum(m.nbytes for m in metas)
    if dst.endswith(".safetensors"):
        if max_shard_size is not None and total > max_shard_size:
            raise UsageError(f"{dst}: {total} bytes of tensors do not fit in one file of --max-shard-size {max_shard_size}",
                             hint="give a directory as DST to write shards with an index")
        parent, base = posixpath.split(dst.rstrip("/"))
        storage = open_storage(parent or ".")
        groups, names = [list(metas)], [base]
    else:
        storage = open_storage(dst)
        groups = _pack(metas, max_shard_size)
        n = len(groups)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out = Written()
    buf = TensorBuffer()
    weight_map: dict[str, str] = {}
    for fname, group in zip(names, groups):
        header, order = build_header(group, metadata)
        with storage.open_writer(fname) as w:
            w.write(header)
            for m in order:
                t = buf.view(m.dtype, m.shape)
                fill(m, t)
                data = byte_view(t)
                for p in range(0, len(data), WRITE_PIECE):
                    w.write(data[p : p + WRITE_PIECE])
                weight_map[m.name] = fname
        out.files.append(storage.url_of(fname))
        out.bytes += len(header) + sum(m.nbytes for m in group)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        storage.write_atomic(INDEX, json.dumps(index, indent=2).encode())
        out.files.append(storage.url_of(INDEX))
    return out


def _pack(metas: Sequence[TensorMeta], limit: int | None) -> list[list[TensorMeta]]:
    ordered = sorted(metas, key=lambda m: m.name)
    if limit is None:
        return [ordered]
    groups: list[list[TensorMeta]] = [[]]
    size = 0
    for m in ordered:
        if groups[-1] and size + m.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(m)
        size += m.nbytes
    return groups
