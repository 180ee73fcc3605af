"""The ``ckptctl`` command: one Typer app, one module per verb.

Commands parse arguments and print; the work is done by library functions in ``ckptctl.ops``
that a Python user can call directly.
"""

from __future__ import annotations

from inspect import cleandoc

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



def _reflowed(doc: str | None) -> str:
    """The docstring with each paragraph on one line. Typer keeps a help text's line breaks,
    so prose wrapped at 96 columns in the source broke raggedly in an 80-column terminal;
    rich wraps one-line paragraphs to the terminal's width."""
    paragraphs = cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


for name, fn in [
    ("ls", ls.ls),
    ("inspect", inspect.inspect),
    ("verify", verify.verify),
    ("latest", latest.latest),
    ("restore", restore.restore),
    ("cp", cp.cp),
    ("prune", prune.prune),
    ("interval", interval.interval),
    ("reshard", reshard.reshard),
    ("convert", convert.convert),
]:
    app.command(name, help=_reflowed(fn.__doc__))(fn)


def main() -> None:
    app()
