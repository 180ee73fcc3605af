from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.common import JsonOpt, command, emit_json, human_bytes, print_table, say
from ckptctl.ops.verbs import inspect_path

if TYPE_CHECKING:
    from ckptctl.ops.inspect import ForeignInspect, InspectResult


@command
def inspect(
    ckpt: Annotated[str, typer.Argument(help="One checkpoint directory, e.g. ROOT/step-0000001000.")],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor: name, dtype, shape, bytes, chunks.")] = False,
    json: JsonOpt = False,
) -> None:
    """Show what a committed checkpoint holds: step, time, world size, bytes by group (model,
    optimizer, other), non-tensor state keys and save statistics. Reads only the manifest.

    content says whether it is resumable or an export (model weights only, no optimizer
    state), which `ckptctl latest` and prune's anchor pass over.

    numbered_by (--json) says what step counts: a training step, or, for a checkpoint whose
    tool records none, what the number in its name counts (accelerate's automatic checkpoint_N:
    "save index", shown so instead of step; epoch_N: "epoch").
    """
    r = inspect_path(ckpt, tensors=tensors)
    if json:
        doc = r.to_dict()
        if "total_bytes" in doc:  # "bytes" as in every verb's JSON (ckptctl-json(7))
            doc.setdefault("bytes", doc["total_bytes"])
        emit_json(doc)
    elif hasattr(r, "format"):  # another tool's checkpoint (DCP, safetensors, torch.save)
        _print_foreign(r, tensors)  # type: ignore[arg-type]
    else:
        _print(r, tensors)  # type: ignore[arg-type]


def _print(r: "InspectResult", tensors: bool) -> None:
    say(f"checkpoint  {r.url}")
    say(f"step        {r.step}")
    say(f"created     {dt.datetime.fromtimestamp(r.created).isoformat(timespec='seconds')}")
    say(f"world size  {r.world_size}   files {len(r.files)}   tensors {r.tensor_count}   on storage {human_bytes(r.total_bytes)}")
    _print_groups(r.bytes_by_group, r.state_keys)
    _print_content(r.content, r.content_reason)
    if r.stats:
        s = r.stats
        say(
            f"save        stall {s.get('stall_s', 0):.3f}s"
            + (f" (capture {s['capture_s']:.3f}s, copy {s['copy_s']:.3f}s)" if "capture_s" in s and "copy_s" in s else "")
            + f"   write {s.get('write_s', 0):.3f}s   waited {s.get('wait_s', 0):.3f}s for the previous save"
        )
    if tensors:
        _print_tensors([(t.name, t.dtype, t.shape, t.bytes, t.chunks, t.group) for t in r.tensors])


def _print_foreign(r: "ForeignInspect", tensors: bool) -> None:
    say(f"checkpoint  {r.url}  ({r.format}; no checksums)")
    if r.numbered_by == "step":
        say(f"step        {r.step if r.step is not None else '-'}")
    else:  # accelerate's checkpoint_N: what the name counts, never shown as a step
        say(f"{r.numbered_by:<12}{r.step}   (not a training step: the number in the checkpoint's name)")
    say(f"tensors     {r.tensor_count}   on disk {human_bytes(r.total_bytes)}")
    _print_groups(r.bytes_by_group, r.state_keys)
    _print_content(r.content, r.content_reason)
    for d in r.dropped:
        say(f"unreadable  {d}")
    if tensors:
        _print_tensors([(t["name"], t["dtype"], t["shape"], t["bytes"], None, t["group"]) for t in r.tensors])


def _print_content(content: str | None, reason: str | None) -> None:
    """resumable, or export (model only: `latest` and prune's anchor pass over it)."""
    if content is not None:
        say(f"content     {content}: {reason}" + ("  (`ckptctl latest` skips it unless --any)" if content == "export" else ""))


def _print_groups(bytes_by_group: dict[str, int], state_keys: list[str]) -> None:
    """Tensor bytes by group (model / optimizer / other) with their shares, then state keys."""
    total = sum(bytes_by_group.values()) or 1
    for group, n in bytes_by_group.items():
        say(f"  {group:<10}{human_bytes(n):>12}  {100 * n / total:5.1f}%")
    say(f"state keys  {', '.join(state_keys) or '-'}")


def _print_tensors(rows: list[tuple]) -> None:
    """(name, dtype, shape, bytes, chunks or None, group) per tensor; CHUNKS only when known."""
    with_chunks = any(r[4] is not None for r in rows)
    columns = ("NAME", "DTYPE", "SHAPE", "BYTES") + (("CHUNKS",) if with_chunks else ()) + ("GROUP",)
    cells = [
        [name, dtype, "x".join(map(str, shape)) or "scalar", human_bytes(nbytes), *([str(chunks)] if with_chunks else []), group]
        for name, dtype, shape, nbytes, chunks, group in rows
    ]
    print_table(columns, cells, right=("BYTES", "CHUNKS"))
