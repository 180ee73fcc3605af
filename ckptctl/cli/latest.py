from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, command, emit_json, err, out
from ckptctl.cli.progress import byte_progress
from ckptctl.errors import UsageError
from ckptctl.ops.verify import LEVELS, latest as find_latest
from ckptctl.storage import open_storage


@command
def latest(
    root: Annotated[str, typer.Argument(help="Checkpoint root: a directory or s3://bucket/prefix.")],
    level: Annotated[str, typer.Option("--level", help="How hard to check: quick, checksums or load.")] = "checksums",
    json: JsonOpt = False,
) -> None:
    """Print the newest committed checkpoint that passes verification: the pre-resume check.

    Newer checkpoints that fail are reported on stderr and skipped. Exit 1 when none passes.

    Example: CKPT=$(ckptctl latest /ckpt) && torchrun train.py --resume "$CKPT"
    """
    if level not in LEVELS:
        raise UsageError(f"--level {level!r} is not one of {', '.join(LEVELS)}", hint="use --level checksums")
    with byte_progress("verify") as progress:
        good, bad = find_latest(open_storage(root), level, progress)  # type: ignore[arg-type]
    for r in bad:
        err.print(f"skipped {r.url}: {r.problems[0]}" + (f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else ""), markup=False, highlight=False)
    if json:
        emit_json({"url": good.url, "step": good.step, "level": level, "skipped": [r.to_dict() for r in bad]})
    else:
        out.print(good.url, markup=False, highlight=False)
