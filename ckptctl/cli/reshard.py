from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, bounded_int, command, emit_json, err, human_bytes, say
from ckptctl.cli.progress import byte_progress
from ckptctl.ops.verbs import reshard_path
from ckptctl.settings import MAX_WORLD_SIZE


@command
def reshard(
    src: Annotated[str, typer.Argument(help="A committed checkpoint, e.g. ROOT/step-0000001000.")],
    dst: Annotated[str, typer.Argument(help="A new checkpoint directory for the result.")],
    world_size: Annotated[int, typer.Option("--world-size", "-w", help=f"Ranks of the job that will load the result: one shard file per rank (1 to {MAX_WORLD_SIZE}, 2^20).", metavar="M")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists (its marker is removed first).")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Rewrite a checkpoint for a job of M ranks, one shard file per rank.

    SRC is never modified, and every one of its checksums is checked as it is read, before
    DST is committed. Large or already sharded tensors are split like torch.chunk, along the
    dimension SRC shards them along (else dim 0); small ones are spread over the ranks to
    balance shard sizes. DST gets its shards, then the manifest, then the marker, and is
    verified before success is reported. Memory stays bounded by the largest tensor plus a
    fixed buffer. Under torchrun each rank writes its share of the target shards.

    Per-rank state (RNG, data loader, extra) goes with its rank: rank r of DST carries SRC's
    rank r copy; ranks SRC's job did not have carry none, and a note on stderr (and the JSON's
    rank_state_from_rank_0, and DST's manifest) names them: a load restores rank 0's copy there.

    Exit 0 success; 1 SRC is not a valid committed checkpoint, or DST exists without
    --overwrite; 2 bad arguments (DST is SRC, M outside 1..1048576); 3 storage error.

    Example: ckptctl reshard /ckpt/step-0000001000 /ckpt-8/step-0000001000 --world-size 8
    """
    bounded_int(world_size, "--world-size", minimum=1, maximum=MAX_WORLD_SIZE, what="the number of ranks of the job that will load it")
    with byte_progress("reshard", quiet=quiet) as progress:
        r = reshard_path(src, dst, world_size, overwrite=overwrite, progress=progress)
    if r is None:
        return  # not rank 0 of a torchrun job: rank 0 speaks for the job
    if json:
        emit_json(r.to_dict())
        return
    if quiet:
        return
    say(f"ok  {r.dst}  step {r.step}: {r.source_world_size} -> {r.world_size} ranks, {r.tensors} tensors "
        f"({r.split_tensors} split), {human_bytes(r.bytes_written)} written in {r.seconds:.2f}s; verified")
    note = r.rank_state_note()
    if note:
        say(f"note: {note}", console=err)
