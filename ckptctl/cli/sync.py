from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, human_bytes, print_table, say
from ckptctl.cli.progress import byte_progress
from ckptctl.errors import InvalidCheckpoint
from ckptctl.ops.transfer.sync import sync_roots


@command
def sync(
    src: Annotated[str, typer.Argument(help="Root to mirror: a directory or s3://bucket/prefix.", metavar="SRC_ROOT")],
    dst: Annotated[str, typer.Argument(help="Root to mirror into (created when missing).", metavar="DST_ROOT")],
    delete: Annotated[bool, typer.Option("--delete", help="Delete from DST_ROOT the committed checkpoints SRC_ROOT no longer has (never DST_ROOT's newest one that verifies).")] = False,
    allow_empty_source: Annotated[bool, typer.Option("--allow-empty-source", help="With --delete, go on even when SRC_ROOT holds no committed checkpoint (refused otherwise: an unmounted volume looks empty).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be copied and deleted, and stop (reads no data, writes nothing).")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Copy every committed checkpoint of SRC_ROOT that DST_ROOT lacks, local to S3 or back.

    Checkpoints are copied in step order, every byte checked against the source's checksums on
    the way and the marker written last, so DST_ROOT never holds a half copy that looks
    committed; nothing at DST_ROOT is ever replaced (a file holding exactly its bytes is kept). One that DST_ROOT already holds is skipped only after checking it: same manifest
    (the size and checksum of every file) and its bytes verify; an unchanged copy is not read
    again (ROOT/.ckptctl-verified.json), a damaged one is copied again. A sync killed at any
    point is resumed by running it again. Partial (uncommitted) checkpoints of SRC_ROOT are not
    copied. Takes DST_ROOT's lock (the one prune and rm take). --delete removes, marker first,
    what SRC_ROOT no longer has, but never DST_ROOT's newest checkpoint that verifies, and
    refuses (exit 1, nothing copied or deleted) when SRC_ROOT holds no committed checkpoint at
    all, as an unmounted volume does, unless --allow-empty-source.

    Other tools' complete checkpoints (Trainer, torchtitan/DCP, Megatron-LM, DeepSpeed,
    Lightning) are mirrored too, as `ckptctl cp` copies them: the file their stack's commit rule
    reads last, then a DeepSpeed `latest` or Megatron tracker (never moved to an older step);
    checked against their seal when sealed (`ckptctl seal SRC_ROOT` first saves reading them
    back), else test-loaded at DST_ROOT. --delete never removes them.

    Exit status: 0 in sync; 1 a checkpoint could not be mirrored (corrupt source, DST_ROOT holds
    a different checkpoint under that name) or --delete refused an empty SRC_ROOT; 2 usage error; 3 lock held or storage error.

    Example (cron, every 15 minutes; -q prints nothing unless something is wrong): ckptctl prune
    -q /nvme/ckpt --keep-last 3 --yes && ckptctl sync -q /nvme/ckpt s3://training/run7 &&
    ckptctl verify -q s3://training/run7 --latest
    """
    with byte_progress("sync", quiet=quiet) as progress:
        result = sync_roots(src, dst, delete=delete, allow_empty_source=allow_empty_source, dry_run=dry_run,
                            progress=progress)
    for note in result.notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    if json:
        emit_json(result.to_dict())
    elif not quiet or result.failed:  # -q: the table only when something was not mirrored
        print_table(("STEP", "ACTION", "SIZE", "DESTINATION", "DETAIL"),
                    [(str(i.step), i.action, human_bytes(i.bytes), i.url, i.detail or "-") for i in result.items],
                    right=("STEP", "SIZE"))
        d = result.to_dict()
        c = d["counts"]
        parts = [f"{c[k]} {k.replace('_', ' ')}" for k in c if c[k]] or ["nothing to do"]
        rate = f", {human_bytes(d['bytes'] / result.seconds)}/s" if result.seconds and d["bytes"] and not dry_run else ""
        say(f"{', '.join(parts)}; {human_bytes(d['bytes'])} {'to copy' if dry_run else 'copied'} "
            f"in {result.seconds:.1f}s{rate}", console=err)
    if result.failed:
        first = result.failed[0]
        raise InvalidCheckpoint(f"{len(result.failed)} checkpoint(s) not mirrored, first {first.name}: {first.detail}",
                                hint="fix or delete the source checkpoint, then run sync again")
