from __future__ import annotations

import contextlib
import os
from typing import Annotated, Iterator

import typer

from ckptctl.cli.common import JsonOpt, command, emit_json, human_bytes, out
from ckptctl.cli.progress import byte_progress
from ckptctl.storage import open_storage


@command
def reshard(
    src: Annotated[str, typer.Argument(help="A committed checkpoint, e.g. ROOT/step-0000001000.")],
    dst: Annotated[str, typer.Argument(help="A new checkpoint directory for the result.")],
    world_size: Annotated[int, typer.Option("--world-size", "-w", help="Ranks of the job that will load the result: one shard file per rank.", metavar="M")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists (its marker is removed first).")] = False,
    json: JsonOpt = False,
) -> None:
    """Rewrite a checkpoint for a job of M ranks, one shard file per rank.

    SRC is never modified, and every one of its checksums is checked as it is read, before
    DST is committed. Large or already sharded tensors are split like torch.chunk, along the
    dimension SRC shards them along (else dim 0); small ones are spread over the ranks to
    balance shard sizes. DST gets its shards, then the manifest, then the marker, and is
    verified before success is reported. Memory stays bounded by the largest tensor plus a
    fixed buffer. Under torchrun each rank writes its share of the target shards.

    Exit 0 success; 1 SRC is not a valid committed checkpoint, or DST exists without
    --overwrite; 2 bad arguments (DST is SRC); 3 storage error.

    Example: ckptctl reshard /ckpt/step-0000001000 /ckpt-8/step-0000001000 --world-size 8
    """
    # Imported here, not at the top: they import torch, and every `ckptctl` command loads this
    # module to build the CLI; `ls`, `latest` and the rest must start without torch.
    from ckptctl.interop.base import return_freed_memory
    from ckptctl.ops.reshard import reshard as run_reshard

    return_freed_memory()  # memory stays one tensor, not a heap of freed ones
    with _torchrun_group() as rank, byte_progress("reshard") as progress:
        r = run_reshard(open_storage(src), open_storage(dst), world_size, overwrite=overwrite, progress=progress)
    if rank != 0:
        return  # rank 0 speaks for the job
    if json:
        emit_json(r.to_dict())
        return
    out.print(f"ok  {r.dst}  step {r.step}: {r.source_world_size} -> {r.world_size} ranks, {r.tensors} tensors "
              f"({r.split_tensors} split), {human_bytes(r.bytes_written)} written in {r.seconds:.2f}s; verified",
              markup=False, highlight=False)


@contextlib.contextmanager
def _torchrun_group() -> Iterator[int]:
    """Under torchrun (WORLD_SIZE > 1), join a gloo group so that the ranks split the target
    shards; yields this process's rank (0 when run plainly)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield 0
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.get_rank()
        return
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()
