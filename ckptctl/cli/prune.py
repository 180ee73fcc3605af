from __future__ import annotations

import sys
from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, RootArg, command, emit_json, err, human_bytes, out, print_table, step_shown
from ckptctl.cli.policy import RetentionOptions, retention_options
from ckptctl.cli.progress import byte_progress
from ckptctl.durations import format_duration, parse_duration
from ckptctl.errors import InvalidCheckpoint, StorageError, UsageError
from ckptctl.ops.retention.prune import DEFAULT_PARTIAL_AFTER_S, PrunePlan, PruneOutcome
from ckptctl.ops.verbs import prune_root


def interactive() -> bool:
    """Whether a person can answer a prompt (a function so tests can pretend)."""
    return sys.stdin.isatty()


@command
@retention_options
def prune(
    root: RootArg,
    retention: RetentionOptions,
    partial_after: Annotated[str, typer.Option("--partial-after", help="Delete directories without a marker, the staging copies of killed re-sharding restores and the temporary files of killed ckptctl writes, once nothing in them changed for DURATION; on S3, also abort unfinished uploads inside checkpoint directories idle that long.", metavar="DURATION")] = format_duration(DEFAULT_PARTIAL_AFTER_S),
    delete_broken: Annotated[bool, typer.Option("--delete-broken", help="Also delete committed checkpoints that fail verification.")] = False,
    seal: Annotated[bool, typer.Option("--seal", help="Seal other tools' anchors this run test-loaded (as `ckptctl seal` does), so later runs check their bytes instead of test-loading them.")] = False,
    reverify: Annotated[bool, typer.Option("--reverify", help="Re-read checkpoints even if a recorded verification says they are unchanged.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and stop.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (required without a terminal).")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Delete old checkpoints, never the newest one that passes full verification.

    A checkpoint is kept if any policy keeps it, and each kept one is printed with every reason.
    The calendar rules keep the newest checkpoint of each of the last N UTC hours, days, ISO
    weeks or months that have one (as restic's forget does). Time-based rules (--keep-within
    and the calendar) trust a commit time only if it is not in the future and not before the
    first checkpoint's: a checkpoint saved on a host with a wrong clock is kept and flagged, and
    windows are measured from the newest trustworthy commit time. --keep-best N --metric NAME
    [--mode min|max] keeps the N checkpoints with the best value of a metric the save recorded
    (Checkpointer.save(..., metrics=...)) or a Hugging Face Trainer logged at that step
    (eval_loss, ..., and its best_metric); one without the metric is left to the other rules,
    and if no checkpoint records it (a misspelt name) all are kept.

    --keep-every and --keep read checkpoint numbers as training steps: on a root whose numbers
    count something else (accelerate's checkpoint_N, its save index: `ls` marks them *) they
    are usage errors.

    The newest committed checkpoint that passes
    full verification (every checksum, every tensor decoded) is always kept, and nothing is
    deleted if none does. Checkpoints newer than it that fail are reported, not deleted
    (unless --delete-broken). Directories without a marker are left alone until idle for
    --partial-after. So is the hidden staging copy a re-sharding restore (restore --world-size)
    makes and removes itself: one a killed restore left under ROOT (.restore-staging-*) is
    listed in the plan and deleted once idle for --partial-after. Symlinked step directories are removed (the link only; its target is
    never followed or touched), except one another stack's pointer names (DeepSpeed's latest,
    Megatron's tracker, a best checkpoint): that is kept, as is every pointer target.
    Deleting removes the marker first.

    The hidden temporary file a killed ckptctl write left on a filesystem (.NAME.tmp-PID-HEX,
    a name nothing else makes; at ROOT, STEP -, or inside a committed checkpoint it keeps) is
    listed as temporary and deleted once idle for --partial-after too; a file of any other
    name, and a directory or link under such a name, is left alone.

    A lock under ROOT stops
    two prunes from running at once (--dry-run takes none); it is taken without needing a free
    block, so prune works on a full disk. A full verification is recorded in
    ROOT/.ckptctl-verified.json so an unchanged checkpoint is not re-read next time; --dry-run
    writes nothing anywhere.

    Exit status: 0 done; 1 nothing verifies, not confirmed, or broken checkpoints were left in
    place; 2 usage error, including no terminal to confirm on without --yes or --dry-run; 3 lock
    held or storage error.

    With -q nothing is printed when all went as planned (cron mails only on trouble): the plan
    only when prune refuses or asks, the outcome only when a deletion did not happen.

    Example (cron): ckptctl prune -q /ckpt --keep-last 3 --keep-every 10000 --yes

    Example (the best by a recorded metric): ckptctl prune /ckpt --keep-last 2 --keep-best 3 --metric val_loss --dry-run
    """
    policy = retention.policy()
    partial_after_s = parse_duration(partial_after, option="--partial-after")
    if not (dry_run or yes or interactive()):
        raise UsageError(
            "not on a terminal, so there is nobody to confirm the deletions",
            hint="pass --yes to delete as planned, or --dry-run to only print the plan",
        )

    def review(plan: PrunePlan) -> bool:
        final = plan.refused is not None or dry_run  # nothing more will happen after this
        asks = not (yes or dry_run) and bool(plan.deletions) and plan.refused is None  # a person confirms
        if not json and (not quiet or asks or plan.refused is not None):  # -q: the plan only on trouble
            _print_plan(plan)
        elif final:
            emit_json({"dry_run": dry_run, "plan": _plan_doc(plan), "outcome": None})
        elif not yes:
            _print_plan(plan, to_stderr=True)  # stdout is for the JSON; the person reads stderr
        for note in plan.notes:
            err.print(f"note: {note}", markup=False, highlight=False)
        if final:
            return False
        if yes or not plan.deletions:
            return True
        n = len(plan.deletions)
        return typer.confirm(f"Delete {n} entr{'y' if n == 1 else 'ies'}?", default=False, err=True)

    with byte_progress("verify", quiet=quiet) as progress:
        plan, outcome = prune_root(
            root, policy, partial_after_s=partial_after_s, delete_broken=delete_broken, seal=seal,
            reverify=reverify, dry_run=dry_run, review=review, progress=progress,
            command=f"ckptctl prune {root}",
        )
    if dry_run:
        _exit_for_broken(plan)
        return
    if outcome is None:
        if json:
            emit_json({"dry_run": False, "plan": _plan_doc(plan), "outcome": None})
        err.print("not confirmed; nothing was deleted", markup=False)
        raise typer.Exit(1)
    if json:
        emit_json({"dry_run": False, "plan": _plan_doc(plan), "outcome": outcome.to_dict()})
    elif not quiet or outcome.failed or outcome.skipped:  # -q: only when a deletion did not happen
        _print_outcome(outcome)
    for note in outcome.notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    if outcome.failed:
        first = outcome.failed[0]
        raise StorageError(f"{len(outcome.failed)} deletion(s) failed, first {first.name}: {first.detail}",
                           hint="fix the cause (permissions?) and run prune again")
    _exit_for_broken(plan)


def _plan_doc(plan: PrunePlan) -> dict:
    """The plan as JSON, each item's size also as "bytes" (the name every verb uses)."""
    doc = plan.to_dict()
    doc["items"] = [{**item, "bytes": item.get("size", 0)} for item in doc["items"]]
    return doc


def _exit_for_broken(plan: PrunePlan) -> None:
    """Broken checkpoints left in place are a problem found: exit 1, so cron reports it."""
    broken = plan.broken_left
    if broken:
        raise InvalidCheckpoint(
            f"{len(broken)} broken checkpoint(s) left in place: {', '.join(i.name for i in broken)}",
            hint="inspect them with `ckptctl verify`; --delete-broken removes them",
        )


def _print_plan(plan: PrunePlan, *, to_stderr: bool = False) -> None:
    console = err if to_stderr else out
    if plan.anchor is not None:
        v = plan.anchor.verification or {}
        how = "recorded verification, unchanged" if v.get("cached") else f"{human_bytes(v.get('bytes_read', 0))} read"
        console.print(f"anchor: {plan.anchor.url} ({plan.anchor.label}, full verification: {how})", markup=False, highlight=False)
        if v.get("seal_hint"):  # no checksum recorded: structure and a test-load vouch for it
            err.print(f"  hint: its format records no checksums: {v['seal_hint']}; or pass --seal",
                      markup=False, highlight=False)
    print_table(("STEP", "ACTION", "SIZE", "NAME", "REASON"),
                [(step_shown(i.step), i.action, human_bytes(i.size), i.name, i.reason) for i in plan.items],
                right=("STEP", "SIZE"), console=console)
    if plan.refused:
        console.print(plan.refused, markup=False, highlight=False)
    else:
        total = sum(i.size for i in plan.deletions)
        console.print(f"{len(plan.deletions)} to delete ({human_bytes(total)}), policy: {plan.policy.describe()}", markup=False, highlight=False)


def _print_outcome(outcome: PruneOutcome) -> None:
    for i in outcome.items:
        if i.planned != "delete":
            continue
        line = f"{i.result:<8} {i.name}" + (f"  ({i.detail})" if i.detail else "")
        out.print(line, markup=False, highlight=False)
    out.print(f"deleted {len(outcome.deleted)}, skipped {len(outcome.skipped)}, failed {len(outcome.failed)}", markup=False, highlight=False)
