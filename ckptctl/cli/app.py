"""The ``ckptctl`` command: one Typer app, one module per verb.

Commands parse arguments and print; the work is done by library functions in ``ckptctl.ops``
that a Python user can call directly.
"""

from __future__ import annotations

from inspect import cleandoc
from typing import Annotated

import typer

from ckptctl.cli.common import check_environment, set_debug

check_environment()  # before the verbs import ckptctl.settings: a bad CKPTCTL_* value is exit 2

from ckptctl.cli import inspect, interval, latest, ls, prune, verify  # noqa: E402
from ckptctl.cli import cp, restore  # noqa: E402
from ckptctl.cli import reshard  # noqa: E402
from ckptctl.cli import convert  # noqa: E402
from ckptctl.version import __version__  # noqa: E402

app = typer.Typer(
    name="ckptctl",
    help="Inspect, verify, prune and move training checkpoints safely.\n\n"
    "Exit status: 0 success; 1 a checkpoint problem was found or the tool refused for safety; "
    "2 usage error; 3 operational error (storage, permissions, lock held) or an unexpected error. "
    "Set CKPTCTL_DEBUG=1 or pass --debug to see tracebacks.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion and --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"ckptctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _global_options(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version)] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an unexpected error (as CKPTCTL_DEBUG=1 does).")] = False,
) -> None:
    set_debug(debug)  # every invocation sets it, so one --debug run does not leak into the next

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
