from __future__ import annotations

import datetime as dt
from typing import Annotated

import typer
from rich.table import Table

from ckptctl.cli.common import JsonOpt, command, emit_json, human_bytes, out
from ckptctl.interop.detect import foreign_format
from ckptctl.ops.inspect import inspect_checkpoint
from ckptctl.storage import open_storage


@command
def inspect(
    ckpt: Annotated[str, typer.Argument(help="One checkpoint directory, e.g. ROOT/step-0000001000.")],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor: name, dtype, shape, bytes, chunks.")] = False,
    json: JsonOpt = False,
) -> None:
    """Show what a committed checkpoint holds: step, time, world size, bytes by group (model,
    optimizer, other), non-tensor state keys and save statistics. Reads only the manifest."""
    if foreign_format(ckpt) is not None:  # DCP, safetensors, torch.save: see ckptctl.ops.foreign
        _inspect_foreign(ckpt, tensors, json)
        return
    r = inspect_checkpoint(open_storage(ckpt), tensors=tensors)
    if json:
        emit_json(r.to_dict())
        return
    out.print(f"checkpoint  {r.url}", markup=False, highlight=False)
    out.print(f"step        {r.step}")
    out.print(f"created     {dt.datetime.fromtimestamp(r.created).isoformat(timespec='seconds')}")
    out.print(f"world size  {r.world_size}   files {len(r.files)}   tensors {r.tensor_count}   on storage {human_bytes(r.total_bytes)}")
    _print_groups(r.bytes_by_group, r.state_keys)
    if r.stats:
        s = r.stats
        out.print(
            f"save        stall {s.get('stall_s', 0):.3f}s"
            + (f" (capture {s['capture_s']:.3f}s, copy {s['copy_s']:.3f}s)" if "capture_s" in s and "copy_s" in s else "")
            + f"   write {s.get('write_s', 0):.3f}s   waited {s.get('wait_s', 0):.3f}s for the previous save"
        )
    if tensors:
        _print_tensors([(t.name, t.dtype, t.shape, t.bytes, t.chunks, t.group) for t in r.tensors])


def _inspect_foreign(path: str, tensors: bool, json: bool) -> None:
    # Imported here: reading other tools' formats needs torch; a ckptctl checkpoint's manifest
    # does not, and `ckptctl inspect` of one should not pay seconds for importing it.
    from ckptctl.ops.foreign import inspect_foreign

    r = inspect_foreign(path, tensors=tensors)
    if json:
        emit_json(r.to_dict())
        return
    out.print(f"checkpoint  {r.url}  ({r.format}; no checksums)", markup=False, highlight=False)
    out.print(f"step        {r.step if r.step is not None else '-'}")
    out.print(f"tensors     {r.tensor_count}   on disk {human_bytes(r.total_bytes)}")
    _print_groups(r.bytes_by_group, r.state_keys)
    for d in r.dropped:
        out.print(f"unreadable  {d}", markup=False, highlight=False)
    if tensors:
        _print_tensors([(t["name"], t["dtype"], t["shape"], t["bytes"], None, t["group"]) for t in r.tensors])


def _print_groups(bytes_by_group: dict[str, int], state_keys: list[str]) -> None:
    """Tensor bytes by group (model / optimizer / other) with their shares, then state keys."""
    total = sum(bytes_by_group.values()) or 1
    for group, n in bytes_by_group.items():
        out.print(f"  {group:<10}{human_bytes(n):>12}  {100 * n / total:5.1f}%")
    out.print(f"state keys  {', '.join(state_keys) or '-'}", markup=False)


def _print_tensors(rows: list[tuple]) -> None:
    """(name, dtype, shape, bytes, chunks or None, group) per tensor; CHUNKS only when known."""
    with_chunks = any(r[4] is not None for r in rows)
    table = Table(box=None, pad_edge=False)
    for col in ("NAME", "DTYPE", "SHAPE", "BYTES") + (("CHUNKS",) if with_chunks else ()) + ("GROUP",):
        table.add_column(col)
    for name, dtype, shape, nbytes, chunks, group in rows:
        cells = [name, dtype, "x".join(map(str, shape)) or "scalar", human_bytes(nbytes)]
        table.add_row(*cells, *([str(chunks)] if with_chunks else []), group)
    out.print(table)
