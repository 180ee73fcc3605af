from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, RootArg, answer, command, emit_json, err, say
from ckptctl.cli.text import shell_join, shell_quote
from ckptctl.cli.progress import byte_progress
from ckptctl.errors import EXIT_CHECKPOINT
from ckptctl.ops.verify_verbs import latest_for

# Shared with `verify --latest`: the same choice, the same words.
AnyOpt = Annotated[bool, typer.Option(
    "--any", help="Count model-only exports too (a checkpoint without the optimizer state its stack resumes from: "
                  "torchtitan's last step, save_only_model, save_weights_only); by default they are skipped, "
                  "each named on stderr.")]


@command
def latest(
    root: RootArg,
    level: Annotated[str, typer.Option("--level", help="How hard to check: quick, checksums or load.")] = "checksums",
    format: Annotated[Optional[list[str]], typer.Option(
        "--format", "--layout", help="Only checkpoints of this layout (repeatable): a name from ckptctl-layouts(7), such as "
                                     "ckptctl, dcp, hf-trainer, megatron, deepspeed, lightning, accelerate.",
        metavar="FORMAT")] = None,
    resume_args: Annotated[bool, typer.Option(
        "--resume-args", help="Print the stack's resume arguments for exactly this checkpoint, shell-quoted on one "
                              "line (e.g. --load ROOT --ckpt-step 25), instead of a path; an argument with a control "
                              "character is quoted as $'...' (bash, zsh, ksh).")] = False,
    any_: AnyOpt = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Print the newest committed checkpoint that passes verification: the pre-resume check.

    Newer checkpoints that fail are reported on stderr and skipped. Exit 1 when none passes.
    ROOT one level off (one checkpoint, or a folder whose subdirectory holds the checkpoints) is
    exit 2, naming the root to give, as for verify --latest/--all, prune and du.

    Only resumable checkpoints count: a model-only export (no optimizer state: torchtitan's
    model-only last step, the Trainer's save_only_model, Lightning's save_weights_only, a
    ckptctl save without an optimizer) is skipped and named on stderr, unless --any.

    Other tools' checkpoints (torchtitan/DCP, Hugging Face Trainer, Megatron-LM, DeepSpeed,
    Lightning) count by their own commit rule and pointer. The path printed is one that the
    stack's default resume loads as exactly this checkpoint (Megatron, DeepSpeed: the root,
    whose pointer names it); when the root's pointer names another checkpoint (one that did
    not verify), no path does: nothing is printed and the exit is 1; use --resume-args, or
    `ckptctl repoint ROOT` to move the pointer back.

    --resume-args prints arguments instead: the path (ckptctl), --checkpoint.load_step N
    (torchtitan), --resume_from_checkpoint PATH (Trainer), --ckpt_path PATH (Lightning),
    --load ROOT --ckpt-step N (Megatron), --load_dir ROOT --tag TAG (DeepSpeed: for
    engine.load_checkpoint(ROOT, tag=TAG)).

    Example: CKPT=$(ckptctl latest /ckpt) && torchrun train.py --resume "$CKPT"
    """
    with byte_progress("verify", quiet=quiet) as progress:
        found = latest_for(root, level, format, progress, any_=any_)
    good, bad = found.report, found.skipped
    for e in found.exports:
        say(str(e), console=err)
    for r in bad:
        say(f"skipped {r.url}: {r.problems[0]}" + (f" (+{len(r.problems) - 1} more)" if len(r.problems) > 1 else ""), console=err)
    resume = found.resume
    if good.seal_hint and not quiet:  # what vouched for it: structure only, no checksums recorded
        say(f"note: {good.url} was checked for structure only (its format records no checksums); "
            f"hint: {good.seal_hint}", console=err)
    if json:
        emit_json({"url": good.url, "step": found.step, "numbered_by": good.numbered_by, "level": level, "checked": good.checked, "layout": found.layout,
                   "resume": resume.to_dict(), "skipped": [r.to_dict() for r in bad], **found.kind.to_dict(),
                   "skipped_exports": [e.to_dict() for e in found.exports]})
    elif resume_args:
        answer(shell_join(resume.argv))
    elif resume.exact:
        answer(resume.path)
    else:
        # The root resumes what its pointer names, not the checkpoint that verified: printing
        # it would hand a launcher the broken one.
        say(f"{good.url} ({good.label}) is the newest that verifies, but {resume.pointer}: "
            f"resuming {resume.path} would load that one, not this", console=err)
        say(f"use `ckptctl latest {shell_quote(root)} --resume-args` ({shell_join(resume.argv)}), "
            f"or move the pointer back with `ckptctl repoint {shell_quote(root)}`", console=err)
        raise typer.Exit(EXIT_CHECKPOINT)
