from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, human_bytes, say
from ckptctl.cli.ranks import rank0_speaks
from ckptctl.cli.latest import AnyOpt
from ckptctl.cli.progress import byte_progress
from ckptctl.errors import EXIT_CHECKPOINT, UsageError
from ckptctl.ops.verbs import verify_path

if TYPE_CHECKING:
    from ckptctl.ops.repoint import PointerCheck
    from ckptctl.ops.verbs import VerifyOutcome
    from ckptctl.ops.verify.report import VerifyReport


@command
def verify(
    path: Annotated[str, typer.Argument(help="A checkpoint, or a root with --latest/--all.")],
    quick: Annotated[bool, typer.Option("--quick", help="Marker, manifest, headers and file sizes only; no data read.")] = False,
    load: Annotated[bool, typer.Option("--load", help="Also decode every tensor and check its chunks tile it exactly.")] = False,
    latest: Annotated[bool, typer.Option("--latest", help="PATH is a root: verify newest first until one passes; exit 1 if the newest fails.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="PATH is a root: verify every checkpoint with a marker, oldest first (as ls lists them), then a summary line on stderr.")] = False,
    any_: AnyOpt = False,
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
    """
    if quick and load:
        raise UsageError("--quick and --load are exclusive", hint="pick one verification level")
    if latest and all_:
        raise UsageError("--latest and --all are exclusive", hint="pick one")
    if any_ and not latest:
        raise UsageError("--any goes with --latest", hint="`ckptctl verify ROOT --latest --any`")
    level = "quick" if quick else "load" if load else "checksums"
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
