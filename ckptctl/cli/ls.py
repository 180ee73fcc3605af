from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ckptctl.cli.common import JsonOpt, command, emit_json, human_bytes, out
from ckptctl.durations import format_duration
from ckptctl.ops.listing import list_checkpoints
from ckptctl.storage import open_storage


@command
def ls(
    root: Annotated[str, typer.Argument(help="Checkpoint root: a directory or s3://bucket/prefix.")],
    json: JsonOpt = False,
) -> None:
    """List every checkpoint under ROOT with its step, status, size and age, sorted by step.

    Status is committed (marker matches manifest), partial (no marker yet: being written or
    abandoned), corrupt (marker and manifest disagree) or link (a symlink, never followed).
    """
    rows = list_checkpoints(open_storage(root))
    if json:
        emit_json([r.to_dict() for r in rows])
        return
    table = Table(box=None, pad_edge=False)
    for col in ("STEP", "STATUS", "SIZE", "AGE", "PATH"):
        table.add_column(col, justify="right" if col in ("STEP", "SIZE", "AGE") else "left")
    for r in rows:
        status = r.status if not r.reason else f"{r.status} ({r.reason})"
        table.add_row(str(r.step), status, human_bytes(r.size), format_duration(r.age_s), r.url)
    out.print(table)
