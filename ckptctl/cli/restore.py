from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ckptctl.cli.common import MAX_STEP, JsonOpt, QuietOpt, answer, bounded_int, command, emit_json, err, say
from ckptctl.cli.cp import report_copy
from ckptctl.cli.ranks import rank0_speaks
from ckptctl.cli.progress import byte_progress
from ckptctl.ops.verbs import restore_into
from ckptctl.settings import MAX_WORLD_SIZE

if TYPE_CHECKING:
    from ckptctl.ops.transfer.copy import Skipped


@command
def restore(
    src: Annotated[str, typer.Argument(help="Checkpoint root to restore from: s3://bucket/prefix or a directory.")],
    dst: Annotated[str, typer.Argument(help="Root to restore into, usually fast local disk; the checkpoint lands in DST/step-XXXXXXXXXX.")],
    step: Annotated[Optional[int], typer.Option("--step", help="Restore this step; exit 1 if it does not verify (no fallback).")] = None,
    world_size: Annotated[Optional[int], typer.Option("--world-size", help=f"Re-shard the restored copy for a job of this many ranks (as `ckptctl reshard` does) when it was saved by a different number (1 to {MAX_WORLD_SIZE}, 2^20).")] = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Copy the newest committed checkpoint that verifies from SRC into DST, and print its path.

    Every shard is copied in parallel and checked on the fly (file and tensor chunk
    checksums); the copy gets its marker last, only when every byte checked out. A corrupt
    newest checkpoint is reported on stderr and the next newest is restored instead, unless
    --step pins one. Run again after an interruption: shards already in place that verify are
    kept, and a DST that already holds the same checkpoint is left as is. With --world-size
    the copy is staged in a hidden directory of the run's own under DST, re-sharded into the
    step directory and verified there, then the staging copy is removed, also when the restore
    fails (DST needs room for both meanwhile). A killed restore's staging copy is not reused
    by the next run: `ckptctl prune DST` deletes it once idle for its --partial-after.

    The newest checkpoint of any layout is taken: another tool's is the newest complete by its
    stack's own rule, copied as `ckptctl cp` copies it: checked against its seal, or test-loaded
    at DST without one; it lands in DST under its own name, and the path printed is what that
    stack resumes from (the checkpoint; for Megatron-LM, DST with its tracker). Nothing at DST is
    ever replaced: a file already holding exactly its bytes is kept, anything else is refused.
    Lightning's checkpoints are one .ckpt file each, which restore does not copy: a root of them
    (or one such file) is a usage error saying so (exit 2); copy the file itself.

    Under torchrun (DST being each node's own disk) each node gets only the shards its ranks
    will read, plus the manifest and marker: the ranks of a node share its files, and each
    node's leader commits its copy once every rank's files are durable and checked, so a
    node-local tier (Tier(DST, node_local=True)) resumes from it; no node holds a full copy.
    The ranks of one node must be given the same command line (exit 2 otherwise); each node
    may name its own DST.
    A node holds the shards of its own ranks when the job has --world-size ranks (default: the
    saved number), else an equal block per node; with another --world-size than the saved one
    each rank re-shards its own target shards straight from SRC. Rank 0 prints the result.

    Example: CKPT=$(ckptctl restore s3://bucket/run7 /nvme/ckpt) && torchrun train.py --resume "$CKPT"
    """
    bounded_int(step, "--step", minimum=0, maximum=MAX_STEP, what="a step number")
    bounded_int(world_size, "--world-size", minimum=1, maximum=MAX_WORLD_SIZE, what="the number of ranks of the job that will load it")

    def skipped(s: "Skipped") -> None:  # a corrupt checkpoint passed over: trouble, printed under -q too
        say(f"skipping step {s.step}: {s.reason}", console=err)

    with rank0_speaks(json) as speaker:
        with byte_progress("restore", quiet=quiet or not speaker) as progress:
            result = restore_into(src, dst, step, progress, world_size=world_size, on_skip=skipped)
        if not speaker:  # under torchrun: rank 0 speaks for the job
            return
        if not quiet:
            report_copy("restored", result.path, result.copy)
        if json:
            # "url" and "bytes" as in every verb's JSON (ckptctl-json(7)); path kept
            emit_json({**result.to_dict(), "url": result.path, "bytes": result.copy.bytes_copied})
        else:
            answer(result.path)  # what a script captures, byte for byte: printed under -q too
