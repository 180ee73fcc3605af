"""The ``ckptctl`` command: one Typer app, one module per verb.

Commands parse arguments and print; the work is done by library functions in ``ckptctl.ops``
that a Python user can call directly.
"""

from __future__ import annotations

import typer

from ckptctl.cli import inspect, interval, latest, ls, prune, verify
from ckptctl.cli import cp, restore
from ckptctl.cli import reshard
from ckptctl.cli import convert

app = typer.Typer(
    name="ckptctl",
    help="Inspect, verify, prune and move training checkpoints safely.\n\n"
    "Exit status: 0 success; 1 a checkpoint problem was found or the tool refused for safety; "
    "2 usage error; 3 operational error (storage, permissions, lock held). "
    "Set CKPTCTL_DEBUG=1 to see tracebacks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

app.command("ls")(ls.ls)
app.command("inspect")(inspect.inspect)
app.command("verify")(verify.verify)
app.command("latest")(latest.latest)
app.command("restore")(restore.restore)
app.command("cp")(cp.cp)
app.command("prune")(prune.prune)
app.command("interval")(interval.interval)
app.command("reshard")(reshard.reshard)
app.command("convert")(convert.convert)


def main() -> None:
    app()
