from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, command, emit_json, err, human_bytes, out
from ckptctl.cli.progress import byte_progress
from ckptctl.errors import EXIT_CHECKPOINT, UsageError
from ckptctl.interop.detect import foreign_format
from ckptctl.ops.verify import VerifyReport, verify_checkpoint, verify_root
from ckptctl.storage import open_storage


@command
def verify(
    path: Annotated[str, typer.Argument(help="A checkpoint, or a root with --latest/--all.")],
    quick: Annotated[bool, typer.Option("--quick", help="Marker, manifest, headers and file sizes only; no data read.")] = False,
    load: Annotated[bool, typer.Option("--load", help="Also decode every tensor and check its chunks tile it exactly.")] = False,
    latest: Annotated[bool, typer.Option("--latest", help="PATH is a root: verify newest first until one passes.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="PATH is a root: verify every checkpoint with a marker.")] = False,
    json: JsonOpt = False,
) -> None:
    """Check that a checkpoint is committed, complete and uncorrupted.

    The default level checks the marker, the manifest, every file's size and every checksum
    (file and tensor chunk), reading each byte once. Every problem is reported with its file,
    tensor and byte range. Exit 0 when everything verified, 1 when a problem was found.
    """
    if quick and load:
        raise UsageError("--quick and --load are exclusive", hint="pick one verification level")
    if latest and all_:
        raise UsageError("--latest and --all are exclusive", hint="pick one")
    level = "quick" if quick else "load" if load else "checksums"
    if not (latest or all_) and foreign_format(path) is not None:  # another tool's checkpoint
        # Imported here: reading other tools' formats needs torch, which ckptctl checkpoints
        # do not (seconds of start-up saved in every cron `verify`).
        from ckptctl.ops.foreign import verify_foreign

        with byte_progress("verify") as progress:
            reports = [verify_foreign(path, level, progress)]
        if json:
            emit_json({"ok": reports[0].ok, "level": level, "checkpoints": [r.to_dict() for r in reports]})
        else:
            _print(reports[0])
            err.print(f"note: {reports[0].note}", markup=False, highlight=False)
        if not reports[0].ok:
            raise typer.Exit(EXIT_CHECKPOINT)
        return
    storage = open_storage(path)
    with byte_progress("verify") as progress:
        if latest or all_:
            reports = verify_root(storage, which="latest" if latest else "all", level=level, progress=progress)
        else:
            reports = [verify_checkpoint(storage, level, progress)]
    ok = reports[-1].ok if latest else all(r.ok for r in reports)
    if json:
        emit_json({"ok": ok, "level": level, "checkpoints": [r.to_dict() for r in reports]})
    else:
        for r in reports:
            _print(r)
    if not ok:
        raise typer.Exit(EXIT_CHECKPOINT)


def _print(r: VerifyReport) -> None:
    rate = f", {human_bytes(r.bytes_read / r.seconds)}/s" if r.seconds and r.bytes_read else ""
    if r.ok:
        out.print(f"ok  {r.url}  step {r.step}: {r.files} files, {r.tensors} tensors, "
                  f"{human_bytes(r.bytes_read)} read in {r.seconds:.2f}s{rate} ({r.level})", markup=False, highlight=False)
        return
    out.print(f"FAILED  {r.url}: {len(r.problems)} problem(s)", markup=False, highlight=False)
    for p in r.problems:
        line = f"  - {p}" + (f" (hint: {p.hint})" if p.hint else "")
        out.print(line, markup=False, highlight=False)
    err.print(f"{r.url} failed verification", markup=False, highlight=False)
