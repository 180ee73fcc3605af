"""``convert``: read a checkpoint in any supported format and write it in another, one tensor
at a time.

Input formats, detected from what is on disk (``detect``):

- ``ckptctl``: a directory with ``manifest.json`` and the ``COMMITTED`` marker (verified first);
- ``dcp``: a directory with ``.metadata`` (PyTorch Distributed Checkpoint);
- ``safetensors``: a ``.safetensors`` file, or a directory with ``model.safetensors.index.json``
  or ``*.safetensors`` files;
- ``torch``: a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``, or any zip of that layout),
  loaded only with ``weights_only=True``.

Outputs (``--to``): ``ckptctl`` (one shard, manifest, checksums, marker; verified), ``safetensors``
(one file, or shards plus an index), ``torch`` (one file of nested dicts), ``dcp``.

Names are ckptctl's (``model/fc.weight``, ``optimizer/state/fc.weight/exp_avg``): as they are
in ckptctl and safetensors outputs, as the nesting of dicts in torch and DCP outputs (DCP then
names the entry ``model.fc.weight`` itself; reading DCP joins its recorded nesting with ``/``). Non-tensor state travels as the ckptctl state tree: in the manifest (ckptctl), as JSON
in ``__metadata__`` (safetensors), as the nested dict itself (torch), as a string entry (dcp);
every format can hold it, so nothing is dropped on output. What a source cannot hand over (a
DCP entry that needs pickle, a ckptctl per-rank RNG state) is listed in the report's
``dropped``.

Memory: one buffer of the largest tensor, plus one more of it when ``--dtype`` casts, plus the
source format's own temporaries (a DCP read holds one serialized tensor record).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from ckptctl.errors import UsageError
from ckptctl.format.layout import MANIFEST, MARKER, shard_name
from ckptctl.format.manifest import Manifest, TensorEntry
from ckptctl.interop.base import Source, TensorMeta
from ckptctl.interop.detect import FORMATS, Format, detect
from ckptctl.layouts.native import commit
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.ops.reshard import prepare_target, require_verified, same_place
from ckptctl.ops.stream_shard import ChunkSpec, write_shard_streaming
from ckptctl.state import tree as statetree
from ckptctl.state.buffers import TensorBuffer
from ckptctl.storage import Storage, open_storage
from ckptctl.progress import Progress

CASTS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
         "fp32": "float32", "float32": "float32"}
FLOATING = ("float64", "float32", "float16", "bfloat16")



@dataclass
class ConvertReport:
    src: str
    dst: str
    source_format: str
    target_format: str
    tensors: int = 0
    skipped_by_only: int = 0
    cast: str | None = None
    bytes: int = 0  # tensor bytes written
    files: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    source_checksums: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class CkptctlSource(Source):
    """A committed ckptctl checkpoint through the shared reader (chunk checksums checked)."""

    kind = "ckptctl"
    has_checksums = True

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.url = storage.url
        self.reader = CheckpointReader(storage)
        m = self.reader.manifest
        self.step = m.step
        self.tree = m.state
        self.tensors = {n: TensorMeta(n, t.dtype, tuple(t.shape), t.group) for n, t in m.tensors.items()}
        if any(self.reader.rank_states().values()):
            self.dropped.append("per-rank state (RNG) in the shard headers: only a ckptctl checkpoint holds it")

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self.reader.read_into(ReadJob(name, out))

    def close(self) -> None:
        self.reader.close()


def open_source(path: str, fmt: Format | None = None) -> Source:
    fmt = fmt or detect(path)
    if fmt == "ckptctl":
        st = open_storage(path)
        if st.stat(MARKER) is None:
            from ckptctl.errors import NotFound

            raise NotFound(f"{st.url}: no {MARKER} marker, so the checkpoint is not committed",
                           hint="it is still being written or its save failed; use a committed checkpoint")
        return CkptctlSource(st)
    if fmt == "dcp":
        from ckptctl.interop.dcp_io import DcpSource

        return DcpSource(path)
    if fmt == "safetensors":
        from ckptctl.interop.safetensors_io import SafetensorsSource

        return SafetensorsSource(path)
    from ckptctl.interop.torch_io import TorchSource

    return TorchSource(path)


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise UsageError(f"--max-shard-size {text!r} is not a size", hint="use e.g. 5GB, 500MiB or a number of bytes")
    return int(value * units[unit])


def convert(src_path: str, dst_path: str, to: str, *, only: Sequence[str] = (), dtype: str | None = None,
            max_shard_size: int | None = None, overwrite: bool = False, progress: Progress | None = None) -> ConvertReport:
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise UsageError(f"--to {to!r} is not one of {', '.join(FORMATS)}")
    cast = None
    if dtype is not None:
        cast = CASTS.get(dtype.lower())
        if cast is None:
            raise UsageError(f"--dtype {dtype!r} is not one of bf16, fp16, fp32")
    if max_shard_size is not None and to != "safetensors":
        raise UsageError("--max-shard-size applies to --to safetensors only")
    if to in ("torch", "dcp") and "://" in dst_path and not dst_path.startswith("file://"):
        raise UsageError(f"--to {to} writes local files only, not {dst_path}",
                         hint="write to a local path, or use --to ckptctl or safetensors for object storage")
    src_fmt = detect(src_path)
    _refuse_same(src_path, dst_path)
    if src_fmt == "ckptctl":
        require_verified(open_storage(src_path))  # every checksum, before anything is written
    with open_source(src_path, src_fmt) as src:
        report = ConvertReport(src.url, dst_path, src.kind, to, cast=cast, source_checksums=src.has_checksums)
        # Once the source's step is known: a ckptctl result must not land in another step's directory.
        _prepare_dst(src_path, dst_path, to, overwrite, step=src.step if src.step is not None else 0)
        keep = [m for n, m in src.tensors.items() if not only or any(n.startswith(p) for p in only)]
        report.skipped_by_only = len(src.tensors) - len(keep)
        if not keep:
            raise UsageError(f"{src.url}: no tensor name starts with {', '.join(only)}",
                             hint="run `ckptctl inspect --tensors` on a ckptctl checkpoint to see the names")
        out_metas = {m.name: _cast_meta(m, cast) for m in keep}
        tree = _filter_tree(src.tree if src.tree is not None else _tree_of(list(src.tensors)), set(out_metas), only)
        report.dropped = list(src.dropped)
        scratch = TensorBuffer()

        def fill(meta: TensorMeta, out: torch.Tensor) -> None:
            orig = src.tensors[meta.name]
            if orig.dtype == meta.dtype:
                src.read_into(meta.name, out)
            else:
                tmp = scratch.view(orig.dtype, orig.shape)
                src.read_into(meta.name, tmp)
                out.copy_(tmp)
            if progress:
                progress(out.numel() * out.element_size())

        files = _write(to, dst_path, out_metas, fill, tree=tree, step=src.step, metadata=src.metadata,
                       max_shard_size=max_shard_size, source=src)
        report.files = files
        report.tensors = len(out_metas)
        report.bytes = sum(m.nbytes for m in out_metas.values())
    report.seconds = time.perf_counter() - t0
    return report


def _write(to: str, dst: str, metas: dict[str, TensorMeta], fill: Any, *, tree: Any, step: int | None,
           metadata: dict[str, str], max_shard_size: int | None, source: Source) -> list[str]:
    if to == "safetensors":
        from ckptctl.interop.safetensors_io import STATE_KEY, STEP_KEY, write_safetensors

        meta = {"format": "pt", **metadata, STATE_KEY: json.dumps(tree, separators=(",", ":"))}
        if step is not None:
            meta[STEP_KEY] = str(step)
        return write_safetensors(dst, list(metas.values()), fill, metadata=meta, max_shard_size=max_shard_size).files
    if to == "torch":
        from ckptctl.interop.torch_io import write_torch

        return write_torch(dst, tree, metas, fill).files
    if to == "dcp":
        from ckptctl.interop.dcp_io import write_dcp

        return write_dcp(dst, metas, fill, tree=tree, step=step).files
    return _write_ckptctl(open_storage(dst), metas, fill, tree=tree, step=step, metadata=metadata, source=source)


def _write_ckptctl(dst: Storage, metas: dict[str, TensorMeta], fill: Any, *, tree: Any, step: int | None,
                   metadata: dict[str, str], source: Source) -> list[str]:
    """One shard (rank 0 of 1); ``ckptctl reshard`` spreads it over more ranks afterwards."""
    specs = [ChunkSpec(m.name, m.dtype, m.shape, tuple(0 for _ in m.shape)) for m in metas.values()]
    by_name = metas

    def fill_chunk(spec: ChunkSpec, out: torch.Tensor, row: int) -> None:
        fill(by_name[spec.name], out)

    # Whole chunks: sources read whole tensors (a DCP record is one unit).
    written = write_shard_streaming(dst, shard_name(0, 1), specs, fill_chunk, rank=0, piece_bytes=None)
    manifest = Manifest.new(
        step if step is not None else 0, 1, [written.file],
        {n: TensorEntry(m.dtype, m.shape, m.group, 1) for n, m in metas.items()},
        tree if isinstance(tree, dict) else {"state": tree},
        {"bytes": float(written.file.size)},
        extra={"converted_from": {"url": source.url, "format": source.kind, "checksums": source.has_checksums},
               **({"safetensors_metadata": metadata} if metadata else {})},
    )
    commit(dst, manifest)
    require_verified(dst, after_write=True)
    return [dst.url_of(written.file.name), dst.url_of(MANIFEST), dst.url_of(MARKER)]


def _cast_meta(m: TensorMeta, cast: str | None) -> TensorMeta:
    if cast is None or m.dtype not in FLOATING or m.dtype == cast:
        return m
    return TensorMeta(m.name, cast, m.shape, m.group)


def _tree_of(names: list[str]) -> dict:
    """Structure for a source that has only flat names: split on ``/`` as ckptctl joins them."""
    root: dict = {}
    for n in names:
        parts = [p.replace("%2F", "/").replace("%25", "%") for p in n.split("/")]
        node = root
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict) or statetree.TENSOR in nxt:
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = {statetree.TENSOR: n}
    return root


def _filter_tree(doc: Any, keep: set[str], only: Sequence[str]) -> Any:
    """Drop references to tensors not kept. With ``--only``, non-tensor values are kept only
    under the top-level keys the prefixes name (the model's config, not the optimizer's)."""
    tops = {p.split("/", 1)[0] for p in only}

    def walk(node: Any, depth: int, top: str | None) -> tuple[bool, Any]:
        if isinstance(node, dict) and statetree.TENSOR in node and len(node) == 1:
            return node[statetree.TENSOR] in keep, node
        if isinstance(node, dict) and len(node) == 1 and (statetree.TUPLE in node or statetree.ITEMS in node):
            return (not only or top in tops), node  # tuples and odd-keyed dicts stay whole
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                ok, val = walk(v, depth + 1, k if depth == 0 else top)
                if ok:
                    out[k] = val
            return bool(out) or not node, out
        if isinstance(node, list):
            kept = [walk(v, depth + 1, top) for v in node]
            if any(statetree.tensor_refs(v) for v in node):
                return True, [v for ok, v in kept if ok]
            return (not only or top in tops), node
        return (not only or top in tops), node

    return walk(doc, 0, None)[1]


def _refuse_same(src: str, dst: str) -> None:
    if "://" in src or "://" in dst:
        if same_place(open_storage(src), open_storage(dst)):
            raise UsageError(f"{dst} is the source itself", hint="convert into a new file or directory")
        return
    a, b = os.path.realpath(src), os.path.realpath(dst)
    if a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/"):
        raise UsageError(f"{dst} is the source itself or inside it",
                         hint="convert into a new file or directory; the source is never modified")


def _prepare_dst(src: str, dst: str, to: str, overwrite: bool, *, step: int) -> None:
    from ckptctl.errors import RefusedForSafety

    if to == "ckptctl":
        prepare_target(open_storage(src), open_storage(dst), overwrite=overwrite, step=step)
        return
    if to == "torch" and os.path.isdir(dst):
        raise UsageError(f"{dst} is a directory; --to torch writes one file", hint="give a file name, e.g. model.pt")
    if os.path.lexists(dst) and not (os.path.isdir(dst) and not os.listdir(dst)):
        if not overwrite:
            raise RefusedForSafety(f"{dst} already exists", hint="choose a new path, or pass --overwrite to replace it")
        if os.path.isdir(dst) and not os.path.islink(dst):
            for name in os.listdir(dst):
                p = os.path.join(dst, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    raise RefusedForSafety(f"{dst} holds a directory ({name}); not removing it", hint="remove it yourself")
                os.unlink(p)
        else:
            os.unlink(dst)

