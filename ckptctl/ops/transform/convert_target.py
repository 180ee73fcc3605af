"""Where and how ``convert`` writes its target (``ops.transform.convert`` decides what).

The place: never the source itself, nor inside it, nor around it (``refuse_same``). A ckptctl
target follows the rules every transform keeps (``ops.transform.safety.prepare_target``: a new
step directory, never another step's); a file or directory of another format is replaced only
with ``--overwrite``, and then only its files: a directory inside it is never removed.

The format: safetensors (one file, or shards plus an index, the state tree and the step in
``__metadata__``), torch (one file of nested dicts), dcp (the state tree and step as entries)
through the ``interop`` writers; ckptctl's own (``_write_ckptctl``) as one shard holding every
tensor (``ckptctl reshard`` spreads them afterwards), a shard header of its own for each rank
whose per-rank state the source carried, then the manifest and the marker, verified before
``convert`` reports success.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ckptctl.errors import RefusedForSafety, UsageError
from ckptctl.format.layout import MARKER, shard_name
from ckptctl.format.manifest import Manifest, TensorEntry
from ckptctl.interop.base import Source, TensorMeta
from ckptctl.layouts.native_commit import commit
from ckptctl.ops.transform.safety import prepare_target, require_verified, same_place
from ckptctl.ops.transform.stream_shard import ChunkSpec, write_shard_streaming
from ckptctl.storage import Storage, open_storage


def write_target(to: str, dst: str, metas: dict[str, TensorMeta], fill: Any, *, tree: Any, step: int | None,
                 metadata: dict[str, str], max_shard_size: int | None, source: Source,
                 rank_states: dict[int, dict]) -> list[str]:
    """Every tensor of ``metas`` (its bytes from ``fill``) and the state ``tree`` in format
    ``to`` at ``dst``; returns the files written."""
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
    assert step is not None  # convert refuses a ckptctl target without one
    return _write_ckptctl(open_storage(dst), metas, fill, tree=tree, step=step, metadata=metadata, source=source,
                          rank_states=rank_states)


def _write_ckptctl(dst: Storage, metas: dict[str, TensorMeta], fill: Any, *, tree: Any, step: int,
                   metadata: dict[str, str], source: Source, rank_states: dict[int, dict]) -> list[str]:
    """Every tensor in rank 0's shard (``ckptctl reshard`` spreads them afterwards). A source's
    per-rank state keeps its ranks: rank r's header goes in a shard r of its own, without
    tensors, so a job of the source's size resumes each rank with its own RNG state."""
    specs = [ChunkSpec(m.name, m.dtype, m.shape, tuple(0 for _ in m.shape)) for m in metas.values()]
    by_name = metas
    world = max([1, *(r + 1 for r in rank_states)])
    world = max(world, getattr(source, "world_size", 1) if rank_states else 1)

    def fill_chunk(spec: ChunkSpec, out: torch.Tensor, row: int) -> None:
        fill(by_name[spec.name], out)

    # Whole chunks: sources read whole tensors (a DCP record is one unit).
    written = [write_shard_streaming(dst, shard_name(0, world), specs, fill_chunk, rank=0, piece_bytes=None,
                                     rank_state=rank_states.get(0))]
    for r in range(1, world):
        written.append(write_shard_streaming(dst, shard_name(r, world), [], fill_chunk, rank=r, piece_bytes=None,
                                             rank_state=rank_states.get(r)))
    manifest = Manifest.new(
        step, world, [w.file for w in written],
        {n: TensorEntry(m.dtype, m.shape, m.group, 1) for n, m in metas.items()},
        tree if isinstance(tree, dict) else {"state": tree},
        {"bytes": float(sum(w.file.size for w in written))},
        extra={"converted_from": {"url": source.url, "format": source.kind, "checksums": source.has_checksums},
               **({"safetensors_metadata": metadata} if metadata else {})},
    )
    name = commit(dst, manifest, published=[w.file.name for w in written])  # another writer's marker wins: ours go
    require_verified(dst, after_write=True)
    return [dst.url_of(w.file.name) for w in written] + [dst.url_of(name), dst.url_of(MARKER)]


def refuse_same(src: str, dst: str) -> None:
    """A target that is the source itself, or inside it, or holds it: refused (UsageError)."""
    if "://" in src or "://" in dst:
        if same_place(open_storage(src), open_storage(dst)):
            raise UsageError(f"{dst} is the source itself", hint="convert into a new file or directory")
        return
    a, b = os.path.realpath(src), os.path.realpath(dst)
    if a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/"):
        raise UsageError(f"{dst} is the source itself or inside it",
                         hint="convert into a new file or directory; the source is never modified")


def prepare_dst(src: str, dst: str, to: str, overwrite: bool, *, step: int) -> None:
    """The target's place made ready: a ckptctl one by ``safety.prepare_target``; another
    format's file or directory replaced only with ``overwrite``, never a directory in it."""
    if to == "ckptctl":
        prepare_target(open_storage(src), open_storage(dst), overwrite=overwrite, step=step)
        return
    if to == "torch" and os.path.isdir(dst):
        raise UsageError(f"{dst} is a directory; --to torch writes one file", hint="give a file name, e.g. model.pt")
    if os.path.lexists(dst) and not (os.path.isdir(dst) and not os.listdir(dst)):
        if not overwrite:
            raise RefusedForSafety(f"{dst} already exists", hint="choose a new path, or pass --overwrite to replace it")
        if os.path.isdir(dst) and not os.path.islink(dst):
            names = os.listdir(dst)
            # Every entry is judged before the first is removed: a refusal deletes nothing.
            for name in names:
                p = os.path.join(dst, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    raise RefusedForSafety(f"{dst} holds a directory ({name}); not removing it", hint="remove it yourself")
            for name in names:
                os.unlink(os.path.join(dst, name))
        else:
            os.unlink(dst)
