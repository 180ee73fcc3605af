"""Hugging Face safetensors: one file, or a directory of shards with
``model.safetensors.index.json``, read and written one tensor at a time.

Reading parses each header with ckptctl's own defensive parser (bounded length, offsets checked
against the file size, entries tiling the data section) and copies each tensor with one ranged
read: no mmap, so resident memory stays one tensor however large the files are. Links are
refused, except in a Hugging Face hub cache snapshot, whose files are links into ``blobs/``:
those are followed while they stay inside the cache (``interop.hub_cache``).

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
from ckptctl.format import dtypes, parse
from ckptctl.format.shard import MAX_HEADER_BYTES, read_header_with
from ckptctl.interop.base import Fill, Source, TensorMeta, Written, group_of
from ckptctl.state.buffers import TensorBuffer, tensor_bytes as byte_view
from ckptctl.interop.detect import SAFETENSORS_INDEX as INDEX
from ckptctl.settings import WRITE_PIECE
from ckptctl.state import tree as statetree
from ckptctl.interop.hub_cache import resolve_link
from ckptctl.interop.steps import StepClue, as_step
from ckptctl.storage import Storage, open_storage

SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20  # an index lists one line per tensor; far above any real model's
STATE_KEY = "ckptctl.state"
STEP_KEY = "ckptctl.step"


class SafetensorsSource(Source):
    kind = "safetensors"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.url = path
        self._places: dict[str, tuple[Storage, str]] = {}  # file -> where its bytes are read (hub cache links)
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
            self.tree = self._saved_tree(state)
        step = self.metadata.pop(STEP_KEY, None)
        if step is not None and step.isdigit() and as_step(int(step)) is not None:
            self.step_clues.append(StepClue(int(step), f"{STEP_KEY} metadata"))
            self.step = int(step)

    def _place(self, fname: str) -> tuple[Storage, str]:
        """Where file ``fname`` of the checkpoint is read: itself, or for a link in a Hugging
        Face hub cache snapshot, its blob (``interop.hub_cache``; any other link is refused)."""
        place = self._places.get(fname)
        if place is None:
            info = self.storage.stat(fname)
            place = (self.storage, fname)
            local = self.storage.local_path()
            if info is not None and info.kind == "link" and local is not None:
                d, name = resolve_link(local, fname)
                place = (open_storage(d), name)
            self._places[fname] = place
        return place

    def _files(self) -> list[str]:
        idx = self.storage.stat(INDEX)
        if idx is None:
            files = sorted(i.key for i in self.storage.children()
                           if i.key.endswith(".safetensors") and i.kind in ("file", "link"))
            if not files:
                raise UsageError(f"{self.storage.url}: no *.safetensors files and no {INDEX}")
            return files
        where = self.storage.url_of(INDEX)
        ist, ikey = self._place(INDEX)
        idx = ist.stat(ikey) or idx
        if idx.size > MAX_INDEX_BYTES:
            raise InvalidCheckpoint(f"{where}: {idx.size} bytes, more than the {MAX_INDEX_BYTES} an index may have",
                                    hint="this is not a safetensors index; do not trust this checkpoint")
        doc = parse.load_json(ist.read(ikey, max_size=MAX_INDEX_BYTES), where, "safetensors index",
                              max_bytes=MAX_INDEX_BYTES, max_depth=16)
        weight_map = parse.Obj(doc, where, "safetensors index").dict("weight_map")
        for tensor, f in weight_map.items():
            # Reading stays inside the checkpoint: one plain file name, as our own manifest requires.
            if not parse.plain_file_name(f):
                raise InvalidCheckpoint(f"{where}: tensor {tensor!r}: refusing shard name {f!r}: not a plain file "
                                        "name inside the checkpoint directory",
                                        hint="the index was altered; treat this checkpoint as untrusted")
        files = sorted(set(weight_map.values()))
        for f in files:
            info = self.storage.stat(f)
            if info is not None and info.kind == "link":
                st, key = self._place(f)
                info = st.stat(key)
            if info is None or info.kind != "file":
                raise InvalidCheckpoint(f"{where}: names shard {f!r}, which is "
                                        f"{'missing' if info is None else 'not a regular file'}",
                                        hint="the checkpoint is incomplete or was altered")
        return files

    def _saved_tree(self, text: str) -> Any:
        """The ckptctl state tree a ckptctl-written file carries, when it still describes the
        tensors the files hold; otherwise None (flat names), with what is lost listed."""
        try:
            tree = parse.load_json(text, self.url, f"{STATE_KEY} metadata", max_bytes=MAX_HEADER_BYTES,
                                   allow_nonfinite=True)
            statetree.check(tree, self.url)
        except InvalidCheckpoint as e:
            self.dropped.append(f"{STATE_KEY} metadata: {e}")
            return None
        refs = set(statetree.tensor_refs(tree))
        missing, unnamed = sorted(refs - set(self.tensors)), sorted(set(self.tensors) - refs)
        if not missing and not unnamed:
            return tree
        # Tensors renamed or removed since the structure was written: keep every tensor under its
        # own name, and say that the saved structure and its non-tensor values did not come along.
        what = "; ".join(x for x in (
            f"names tensors the files do not hold ({_few(missing)})" if missing else "",
            f"does not name tensors the files hold ({_few(unnamed)})" if unnamed else "") if x)
        self.dropped.append(f"{STATE_KEY} metadata (the saved structure and non-tensor state): it {what}; "
                            "tensors are kept under their own names")
        return None

    def _add_file(self, fname: str) -> None:
        st, key = self._place(fname)
        with st.open_reader(key) as r:  # the parser validates bounds and tiling
            h = read_header_with(r.read, r.size, self.storage.url_of(fname))
        for c in h.chunks:
            if any(c.offsets):
                raise UsageError(f"{self.storage.url_of(fname)} is one shard of a ckptctl checkpoint, not whole tensors",
                                 hint="convert the checkpoint directory that holds its manifest.json")
            if c.name in self._where:
                raise InvalidCheckpoint(f"{self.storage.url_of(fname)}: tensor {c.name!r} also appears in {self._where[c.name][0]}")
            self._where[c.name] = (fname, h.data_start + c.begin, h.data_start + c.end)
            self.tensors[c.name] = TensorMeta(c.name, c.dtype, tuple(c.shape), group_of(c.name))
        raw = parse.load_json(h.header_bytes[8:], self.storage.url_of(fname), "safetensors header",
                              max_bytes=MAX_HEADER_BYTES)
        meta = raw.get("__metadata__") or {}
        if isinstance(meta, dict):
            for k, v in meta.items():
                if isinstance(k, str) and isinstance(v, str) and k != "ckptctl":
                    self.metadata.setdefault(k, v)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        fname, begin, end = self._where[name]
        r = self._readers.get(fname)
        if r is None:
            st, key = self._place(fname)
            r = self._readers[fname] = st.open_reader(key)
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


def _few(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
