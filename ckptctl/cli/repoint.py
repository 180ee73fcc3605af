from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, say
from ckptctl.cli.progress import byte_progress
from ckptctl.ops.verify_verbs import repoint_root


@command
def repoint(
    root: Annotated[str, typer.Argument(help="The root holding DeepSpeed's `latest` or Megatron's tracker.")],
    level: Annotated[str, typer.Option("--level", help="How hard to check: quick, checksums or load.")] = "checksums",
    format: Annotated[Optional[list[str]], typer.Option(
        "--format", "--layout", help="The stack whose pointer to move when the root holds several: megatron or deepspeed.",
        metavar="FORMAT")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be written; write nothing, take no lock.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Move a stack's pointer back from a checkpoint that does not verify.

    DeepSpeed's load_checkpoint(ROOT) loads the tag in ROOT/latest, Megatron's --load ROOT the
    iteration in latest_checkpointed_iteration.txt. When that checkpoint does not verify, the
    pointer is rewritten (temp file, fsync, rename, directory fsync) to the newest older
    checkpoint of the same stack that does; never forward, never to one that did not verify.
    A pointer whose target verifies is left alone. Runs under the root's lock, like prune.
    The rewrite is a compare-and-swap: it replaces the pointer only while it still holds what
    was judged, checked once the new one is durable, and a newer pointer a training job wrote
    in place meanwhile is put back (If-Match on S3); then the exit is 1, naming both values.

    Exit 0: the pointer names a checkpoint that verifies (now, or already: nothing to do; or,
    with --dry-run, after the rewrite shown). 1: it does not, and nothing older verifies, the
    pointer cannot be read, or it changed meanwhile: nothing written. 2: usage (no pointer
    here, several and no --format). 3: the lock is held, or storage failed.

    Example: ckptctl verify /runs/megatron --latest || ckptctl repoint /runs/megatron
    """
    with byte_progress("verify", quiet=quiet) as progress:
        result = repoint_root(root, level, format, dry_run=dry_run, progress=progress)
    for note in result.notes:
        say(f"note: {note}", console=err)
    if json:
        emit_json(result.to_dict())
        return
    if result.new is None:
        say(result.message, console=err)
    elif result.dry_run:
        say(f"would rewrite {result.message}", console=err)
    else:
        say(f"rewrote {result.message}", console=err)
