from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, human_bytes, say
from ckptctl.cli.ranks import rank0_speaks
from ckptctl.cli.latest import AnyOpt
from ckptctl.cli.progress import byte_progress
from ckptctl.errors import EXIT_CHECKPOINT, UsageError
from ckptctl.ops.verify_verbs import verify_path, verify_tiers

if TYPE_CHECKING:
    from ckptctl.ops.repoint import PointerCheck
    from ckptctl.ops.verify_verbs import VerifyOutcome
    from ckptctl.ops.verify.report import VerifyReport
    from ckptctl.ops.verify.whole import WholeOutcome


@command
def verify(
    path: Annotated[str, typer.Argument(help="A checkpoint, or a root with --latest/--all.")],
    quick: Annotated[bool, typer.Option("--quick", help="Marker, manifest, headers and file sizes only; no data read.")] = False,
    load: Annotated[bool, typer.Option("--load", help="Also decode every tensor and check its chunks tile it exactly.")] = False,
    latest: Annotated[bool, typer.Option("--latest", help="PATH is a root: verify newest first until one passes; exit 1 if the newest fails.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="PATH is a root: verify every checkpoint with a marker, oldest first (as ls lists them), then a summary line on stderr.")] = False,
    any_: AnyOpt = False,
    tier: Annotated[Optional[list[str]], typer.Option(
        "--tier", metavar="URL",
        help="With --latest or --all (repeatable): PATH and each URL are roots of one job (each node's root of a "
             "node-local tier, the tier it promotes to); judge each step whole across them.")] = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check that a checkpoint is committed, complete and uncorrupted.

    The default level checks the marker, the manifest, every file's size and every checksum
    (file and tensor chunk), reading each byte once. Every problem is reported with its file,
    tensor and byte range. Exit 0 when everything verified, 1 when a problem was found.

    With --latest, exit 1 whenever the newest committed (resumable) checkpoint fails, for every
    layout, even when an older one verifies: the report names the newest and the one `ckptctl
    latest` would resume instead. A stack's own pointer (DeepSpeed's `latest`, Megatron's
    latest_checkpointed_iteration.txt) is checked too: its target is what that stack's default
    resume loads, so a target that does not verify is exit 1, naming the pointer, the target,
    the checkpoint that does verify and the `ckptctl repoint` command that moves it back.
    --latest considers resumable checkpoints only, as `ckptctl latest` does: a newer model-only
    export is skipped and named in a note, unless --any.

    Under torchrun each rank reads its share of every checkpoint's files (balanced by bytes;
    --json gives each rank's files and bytes_read under "ranks"); rank 0 prints the report of
    the whole, and every rank exits with its status. Every rank must be given the same command
    line: ranks that differ (another level, another path) all stop with exit 2 before reading.

    With --tier URL (repeatable), PATH and each URL are roots that together hold a job's
    steps: a node-local tier keeps on each node only that node's shards, so `verify NODE_ROOT`
    checks the node's part and names the rest as elsewhere. --tier judges the step whole: the
    markers on every root that commits it record the same manifest, every file it lists is on
    some root, and every copy found verifies. --latest walks the steps newest first until one
    is whole (exit 1 when the newest is not, naming the files missing from every root or bad
    and the newest step that is whole); --all judges every step. Only ckptctl's own format.
    Example: ckptctl verify /nvme/n0/ckpt --latest --tier /nvme/n1/ckpt --tier s3://b/run
    """
    if quick and load:
        raise UsageError("--quick and --load are exclusive", hint="pick one verification level")
    if latest and all_:
        raise UsageError("--latest and --all are exclusive", hint="pick one")
    if any_ and not latest:
        raise UsageError("--any goes with --latest", hint="`ckptctl verify ROOT --latest --any`")
    level = "quick" if quick else "load" if load else "checksums"
    if tier:
        _whole(path, tier, level, "latest" if latest else "all" if all_ else None, any_, json=json, quiet=quiet)
        return
    with rank0_speaks(json) as speaker:
        with byte_progress("verify", quiet=quiet or not speaker) as progress:
            outcome = verify_path(path, level, which="latest" if latest else "all" if all_ else "one", progress=progress,
                                  any_=any_)
        if speaker:  # under torchrun: rank 0 prints the job's report; every rank exits alike
            _report(outcome, level, json=json, quiet=quiet, all_=all_)
    if not outcome.ok:
        raise typer.Exit(EXIT_CHECKPOINT)


def _report(outcome: "VerifyOutcome", level: str, *, json: bool, quiet: bool, all_: bool) -> None:
    if json:
        emit_json(outcome.to_dict())
    elif not quiet or not outcome.ok or not all(r.ok for r in outcome.reports):  # -q: only on trouble
        for r in (r for r in outcome.reports if not (quiet and r.ok)):
            _print(r)
        if outcome.note:
            say(f"note: {outcome.note}", console=err)
        if outcome.fallback:
            say(outcome.fallback, console=err)
        for p in outcome.pointers:
            if not (quiet and p.ok):
                _print_pointer(p)
        if all_:
            failed = sum(not r.ok for r in outcome.reports)
            read = sum(r.bytes_read for r in outcome.reports)
            unsummed = sum(r.checked == "structure" for r in outcome.reports)
            by = f"{level}; {unsummed} by structure only: no checksums recorded" if unsummed else level
            say(f"{len(outcome.reports)} checkpoints verified: {len(outcome.reports) - failed} ok, {failed} failed; "
                f"{human_bytes(read)} read ({by})", console=err)


def _whole(path: str, tier: list[str], level: str, which: str | None, any_: bool, *, json: bool, quiet: bool) -> None:
    """``verify PATH --latest/--all --tier URL ...``: steps judged whole across the roots."""
    if which is None:
        raise UsageError("--tier goes with --latest or --all", hint=f"`ckptctl verify {path} --latest --tier {tier[0]}`")
    if any_:
        raise UsageError("--any does not go with --tier", hint="--tier judges every committed step of ckptctl's format")
    with rank0_speaks(json) as speaker:  # under torchrun every rank checks it all; rank 0 prints
        with byte_progress("verify", quiet=quiet or not speaker) as progress:
            outcome = verify_tiers([path, *tier], level, which=which, progress=progress)  # type: ignore[arg-type]
        if speaker and json:
            emit_json(outcome.to_dict())
        elif speaker:
            _print_whole(outcome, quiet=quiet)
    if not outcome.ok:
        raise typer.Exit(EXIT_CHECKPOINT)


def _print_whole(outcome: "WholeOutcome", *, quiet: bool) -> None:
    n = len(outcome.roots)
    for s in outcome.steps:
        if s.ok and quiet:
            continue
        if s.ok:
            say(f"ok  step {s.step} whole across {len(s.roots)} of {n} roots: {s.files} files ({s.copies} copies), "
                f"{s.tensors} tensors, {human_bytes(s.bytes_read)} read in {s.seconds:.2f}s ({s.checked})")
        else:
            say(f"FAILED  step {s.step} across {n} roots: {len(s.problems)} problem(s)")
            for p in s.problems:
                say(f"  - {p}" + (f" (hint: {p.hint})" if p.hint else ""))
        for note in s.notes:
            say(f"  note: {note}", console=err)
    if outcome.fallback:
        say(outcome.fallback, console=err)


def _print_pointer(p: "PointerCheck") -> None:
    if p.ok:
        say(f"ok  pointer {p.pointer} ({p.layout}) names {p.target}, which verifies", console=err)
        return
    say(f"FAILED  pointer {p.pointer} ({p.layout}): {p.problem}")
    if p.good is not None:
        say(f"  {p.good} (step {p.good_step}) verifies; move the pointer back to it: {p.repoint_command()}")
    else:
        say("  no older checkpoint of this stack verifies; do not resume with the stack's default")
    say(f"{p.pointer} names {p.target or repr(p.value)}, which the stack would resume and which does not verify",
        console=err)


def _print(r: "VerifyReport") -> None:
    if r.ok:
        # "(checksums)" only where every byte was hashed; a check that read no data says so.
        read = (f"{human_bytes(r.bytes_read)} read in {r.seconds:.2f}s"
                + (f", {human_bytes(r.bytes_read / r.seconds)}/s" if r.seconds else "")
                if r.bytes_read else f"headers and sizes only, no data read, in {r.seconds:.2f}s")
        say(f"ok  {r.url}  {r.label}: {r.files} files, {r.tensors} tensors, {read} ({r.checked})")
        if r.seal_hint:
            say(f"  hint: {r.seal_hint}", console=err)
        if r.ranks:  # under torchrun: how the reading was shared
            say(f"  read by {len(r.ranks)} ranks: " + ", ".join(
                f"rank {s.rank} {s.files} files {human_bytes(s.bytes_read)}" for s in r.ranks), console=err)
        return
    say(f"FAILED  {r.url}: {len(r.problems)} problem(s)")
    for p in r.problems:
        say(f"  - {p}" + (f" (hint: {p.hint})" if p.hint else ""))
    say(f"{r.url} failed verification", console=err)
