from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, command, emit_json, err, human_bytes, out
from ckptctl.cli.progress import byte_progress
from ckptctl.format.checkpoint import read_committed
from ckptctl.ops.transfer import CopyResult, checkpoint_dir_for, copy_checkpoint
from ckptctl.storage import open_storage


@command
def cp(
    src: Annotated[str, typer.Argument(help="One committed checkpoint: a step directory, local or s3://.")],
    dst: Annotated[str, typer.Argument(help="A step directory to create, or a root to create it under.")],
    json: JsonOpt = False,
) -> None:
    """Copy one committed checkpoint, in either direction between a filesystem and S3.

    Every byte is checked against the checkpoint's checksums on the way; the marker is written
    last, so an interrupted or failed copy never looks committed. When DST's last component is
    not a step directory (step-XXXXXXXXXX), DST is a root and the copy goes below it. A DST
    that already holds the same checkpoint is left as is; a different one is refused.
    Prints the copy's path or URL.
    """
    source = open_storage(src)
    manifest, _ = read_committed(source)
    target = checkpoint_dir_for(open_storage(dst), manifest.step)
    with byte_progress("cp") as progress:
        result = copy_checkpoint(source, target, progress)
    report_copy("copied", target.url, result)
    if json:
        emit_json(result.to_dict())
    else:
        out.print(target.local_path() or target.url, markup=False, highlight=False)


def report_copy(verb: str, where: str, result: CopyResult) -> None:
    """One line on stderr saying what a copy did (shared with ``restore``)."""
    if result.status == "already present":
        err.print(f"{where} already holds step {result.step}; left as is", markup=False, highlight=False)
        return
    rate = f", {human_bytes(result.bytes_copied / result.seconds)}/s" if result.seconds and result.bytes_copied else ""
    err.print(f"{verb} step {result.step}: {result.files} files, {human_bytes(result.bytes_copied)} copied and verified "
              f"in {result.seconds:.2f}s{rate}", markup=False, highlight=False)
