from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, say
from ckptctl.cli.progress import byte_progress
from ckptctl.ops.targets import latest_for


@command
def latest(
    root: Annotated[str, typer.Argument(help="Checkpoint root: a directory or s3://bucket/prefix.")],
    level: Annotated[str, typer.Option("--level", help="How hard to check: quick, checksums or load.")] = "checksums",
    format: Annotated[Optional[list[str]], typer.Option(
        "--format", help="Only checkpoints of this layout: ckptctl, dcp, hf-trainer, megatron, deepspeed, lightning (repeatable).",
        metavar="FORMAT")] = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Print the newest committed checkpoint that passes verification: the pre-resume check.

    Newer checkpoints that fail are reported on stderr and skipped. Exit 1 when none passes.
    Other tools' checkpoints (torchtitan/DCP, Hugging Face Trainer, Megatron-LM, DeepSpeed)
    count by their own commit rule and pointer; the path printed is what that stack's resume
    option takes (Megatron: the root, for --load).

    Example: CKPT=$(ckptctl latest /ckpt) && torchrun train.py --resume "$CKPT"
    """
    with byte_progress("verify", quiet=quiet) as progress:
        found = latest_for(root, level, format, progress)
    good, bad = found.report, found.skipped
    for r in bad:
        say(f"skipped {r.url}: {r.problems[0]}" + (f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else ""), console=err)
    if json:
        emit_json({"url": good.url, "step": found.step, "level": level, "format": found.layout,
                   "resume": found.resume.to_dict(), "skipped": [r.to_dict() for r in bad]})
    else:
        say(found.resume.path)
