from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, answer, command, emit_json, err, human_bytes
from ckptctl.cli.progress import byte_progress
from ckptctl.cli.ranks import rank0_speaks
from ckptctl.ops.verbs import copy_to

if TYPE_CHECKING:
    from ckptctl.ops.transfer.copy import CopyResult


@command
def cp(
    src: Annotated[str, typer.Argument(help="One committed checkpoint: a step directory, local or s3://, or another tool's checkpoint directory (checkpoint-N, step-N, iter_N, global_stepN).")],
    dst: Annotated[str, typer.Argument(help="A step directory to create, or a root to create it under.")],
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Copy one committed checkpoint, in either direction between a filesystem and S3.

    Every byte is checked against the checkpoint's checksums on the way; the marker is written
    last, so an interrupted or failed copy never looks committed. When DST's last component is
    not a step directory (step-XXXXXXXXXX), DST is a root and the copy goes below it. A DST
    that already holds the same checkpoint is left as is; a different one is refused.
    Nothing at DST is ever replaced: a file already there holding exactly the bytes it should
    (an interrupted copy run again) is kept, anything else under its name is refused for
    safety (exit 1), and of two copies racing into one step at most one commits.
    Prints the copy's path or URL.

    Another tool's checkpoint (checkpoint-N, step-N, iter_N, global_stepN) is copied file by
    file: checked on the fly against its seal when it has one (`ckptctl seal`; the seal goes
    along), otherwise test-loaded at the destination (on object storage each file is read back
    for that: sealing first saves it). The file its stack's commit rule reads is written last,
    and a DeepSpeed `latest` or Megatron tracker at the destination root after it, only when
    none is there or it names an older step. A checkpoint that is one file (Lightning's
    *.ckpt) is copied whole into DST, then its zip records' CRC-32s are checked there.

    Under torchrun (DST shared by the ranks: object storage or a shared filesystem) each rank
    copies and checks its share of the files, balanced by bytes; rank 0 writes the manifest
    before them (it commits nothing alone), the commit files and marker once every rank's
    files are durable and checked, and prints the result. Every rank exits with the same status; a failing rank fails the job and commits
    nothing. Every rank must be given the same command line: ranks that differ (another DST,
    another SRC) all stop with exit 2 before anything is written.
    """
    with rank0_speaks(json) as speaker:
        with byte_progress("cp", quiet=quiet or not speaker) as progress:
            outcome = copy_to(src, dst, progress)
        if not speaker:
            return
        if not quiet:
            report_copy("copied", outcome.path, outcome.result)
        if json:
            # "url" and "bytes" as in every verb's JSON (ckptctl-json(7)); dst, bytes_copied kept
            emit_json({**outcome.result.to_dict(), "url": outcome.path, "bytes": outcome.result.bytes_copied})
        else:
            answer(outcome.path)  # what a script captures, byte for byte: printed under -q too


def report_copy(verb: str, where: str, result: "CopyResult") -> None:
    """One line on stderr saying what a copy did (shared with ``restore``)."""
    if result.status == "already present":
        err.print(f"{where} already holds step {result.step}; left as is", markup=False, highlight=False)
        return
    rate = f", {human_bytes(result.bytes_copied / result.seconds)}/s" if result.seconds and result.bytes_copied else ""
    err.print(f"{verb} step {result.step}: {result.files} files, {human_bytes(result.bytes_copied)} copied and verified "
              f"in {result.seconds:.2f}s{rate}", markup=False, highlight=False)
    for share in result.ranks:  # under torchrun: what each rank (cp) or node (restore) copied
        who = f"rank {share['rank']}" if "rank" in share else f"{share['node']} (ranks {', '.join(map(str, share['ranks']))})"
        err.print(f"  {who}: {share['files']} files, {human_bytes(share['bytes'])}", markup=False, highlight=False)
    if result.note:  # another tool's checkpoint: how it was checked, and its pointer
        err.print(f"note: {result.note}", markup=False, highlight=False)
