from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, RootArg, command, emit_json, err, human_bytes, print_table, say, step_shown
from ckptctl.cli.policy import RetentionOptions, retention_options
from ckptctl.cli.progress import byte_progress
from ckptctl.durations import format_duration, parse_duration
from ckptctl.ops.du import disk_usage
from ckptctl.ops.retention.plan import DEFAULT_PARTIAL_AFTER_S


@command
@retention_options
def du(
    root: RootArg,
    retention: RetentionOptions,
    partial_after: Annotated[str, typer.Option("--partial-after", help="As prune: directories without a marker, and scratch (staging copies, temporaries), count as abandoned once idle for DURATION.", metavar="DURATION")] = format_duration(DEFAULT_PARTIAL_AFTER_S),
    delete_broken: Annotated[bool, typer.Option("--delete-broken", help="As prune: count committed checkpoints that fail verification as freed.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Show the size of each checkpoint under ROOT and the total; with prune's retention
    options, what prune would free.

    Sizes are listed, not read. Given any --keep* option, the plan is made exactly as
    `prune --dry-run` makes it (the newest checkpoint is verified fully, unless the
    verification record shows it unchanged), so "will free" is what prune with the same options
    deletes. Writes nothing.

    Scratch under ROOT, which no checkpoint's size counts, is listed after the checkpoints and
    totalled apart: the hidden staging copies of re-sharding restores (.restore-staging-*,
    STATUS staging) and the temporary files of ckptctl's writes at ROOT (.NAME.tmp-PID-HEX,
    STATUS temporary, STEP "-"), a killed run's or a live one's. Prune deletes each once idle
    for --partial-after; with a policy, "will free" includes them, and the temporaries inside
    the checkpoints it keeps (counted in those checkpoints' sizes).

    Exit status: 0 done; 1 with a policy, no checkpoint verifies (prune would delete nothing);
    2 usage error; 3 storage error.
    """
    policy = retention.policy() if retention.given else None
    with byte_progress("verify", quiet=quiet) as progress:
        report = disk_usage(root, policy, partial_after_s=parse_duration(partial_after, option="--partial-after"),
                            delete_broken=delete_broken, progress=progress)
    if json:
        emit_json(report.to_dict())
    elif not quiet or report.refused:  # -q: the table only when prune would be refused
        with_plan = policy is not None
        print_table(("STEP", "STATUS", "SIZE", "PATH") + (("PRUNE", "REASON") if with_plan else ()),
                    [(step_shown(e.step), e.status, human_bytes(e.bytes), e.url)
                     + ((e.prune or "-", e.reason or "-") if with_plan else ())
                     for e in report.entries + report.scratch],
                    right=("STEP", "SIZE"))
        say(f"total {human_bytes(report.bytes)} in {len(report.entries)} checkpoints")
        if report.scratch:
            staged = sum(e.status == "staging" for e in report.scratch)
            temps = len(report.scratch) - staged
            say(f"plus {human_bytes(report.scratch_bytes)} of scratch ({staged} staging "
                f"cop{'y' if staged == 1 else 'ies'}, {temps} temporar{'y' if temps == 1 else 'ies'}; "
                "prune deletes each once idle for --partial-after)")
        if with_plan:
            if report.refused:
                say(f"prune would free nothing: {report.refused}")
            else:
                n = len(report.freed)
                scratch = (f", and {human_bytes(report.scratch_bytes_freed)} of scratch"
                           if report.scratch_bytes_freed else "")
                say(f"prune ({report.policy}) will free {human_bytes(report.bytes_freed)} "
                    f"({n} checkpoint{'' if n == 1 else 's'}){scratch}")
    for note in report.notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    if report.refused:
        raise typer.Exit(1)
