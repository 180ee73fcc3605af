from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, human_bytes, print_table, say
from ckptctl.cli.progress import byte_progress
from ckptctl.cli.prune import interactive
from ckptctl.errors import StorageError, UsageError
from ckptctl.ops.rm import RmResult, remove_checkpoints


@command
def rm(
    ckpts: Annotated[list[str], typer.Argument(help="Checkpoints to delete, of any layout (ROOT/step-XXXXXXXXXX, ROOT/checkpoint-N, ...; local or s3://).", metavar="CKPT...")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (required without a terminal).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be deleted and stop.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Also delete the newest checkpoint of its layout under its root that passes full verification, or what a pointer protects.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Delete the named checkpoints, commit file first.

    Each CKPT is one checkpoint of any layout (a step-N, checkpoint-N or iter_N directory, a
    Lightning .ckpt file...); its parent is its root. The newest resumable checkpoint of its
    layout under the root that passes full verification (the one prune always keeps: found
    newest first, every checksum and file checked at the load level, or unchanged since the
    verification record says so) is refused unless --force, and then nothing at all is deleted;
    so is what a pointer protects (DeepSpeed's latest, Megatron's tracker, a Trainer's best).

    Deleting removes the file the layout's commit rule reads first (ckptctl's marker, DCP's
    .metadata, the Trainer's trainer_state.json), each file only while it is as listed, so an
    interrupted rm leaves a partial checkpoint, never one that looks whole. A symlink is removed
    as a link, its target never touched; a directory no layout claims is never removed. Takes
    the same lock under ROOT as prune and sync; --dry-run takes none and writes nothing.

    Exit status: 0 deleted (or nothing to do); 1 refused for safety or not confirmed; 2 usage
    error (no such checkpoint, not a ckptctl checkpoint, no terminal to confirm on without --yes
    or --dry-run); 3 lock held or storage error.
    """
    if not (dry_run or yes or interactive()):
        raise UsageError(
            "not on a terminal, so there is nobody to confirm the deletions",
            hint="pass --yes to delete, or --dry-run to only print what would be deleted",
        )

    def review(plan: RmResult) -> bool:
        asks = not yes and not dry_run  # a person confirms: they see what, -q or not
        if (not json and not quiet) or asks:
            _print(plan, to_stderr=json)
        if dry_run or yes:
            return True
        n = len(plan.items)
        return typer.confirm(f"Delete {n} checkpoint{'' if n == 1 else 's'}?", default=False, err=True)

    with byte_progress("verify", quiet=quiet) as progress:
        result = remove_checkpoints(ckpts, force=force, dry_run=dry_run, review=review, progress=progress,
                                    command=f"ckptctl rm {' '.join(ckpts)}")
    for note in result.notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    not_done = not dry_run and all(i.result == "planned" for i in result.items)
    if json:
        emit_json({**result.to_dict(), "confirmed": not not_done})
    elif not dry_run and not not_done:
        for i in result.items:
            if quiet and i.result == "deleted":
                continue  # -q: only what was not deleted
            say(f"{i.result:<8} {i.url}" + (f"  ({i.detail})" if i.detail else ""))
    if not_done:
        err.print("not confirmed; nothing was deleted", markup=False)
        raise typer.Exit(1)
    if result.failed:
        first = result.failed[0]
        raise StorageError(f"{len(result.failed)} deletion(s) failed, first {first.url}: {first.detail}",
                           hint="fix the cause (permissions?) and run rm again")


def _print(plan: RmResult, *, to_stderr: bool) -> None:
    console = err if to_stderr else None
    print_table(("STEP", "STATUS", "SIZE", "PATH", "NOTE"),
                [(str(i.step), i.status, human_bytes(i.bytes), i.url,
                  "newest fully verified checkpoint (--force)" if i.anchor else "-") for i in plan.items],
                right=("STEP", "SIZE"), console=console)
    total = sum(i.bytes for i in plan.items)
    verb = "would be deleted" if plan.dry_run else "to delete"
    say(f"{len(plan.items)} checkpoint{'' if len(plan.items) == 1 else 's'} {verb} ({human_bytes(total)})",
        console=err)
