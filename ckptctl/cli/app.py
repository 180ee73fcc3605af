"""The ``ckptctl`` command: one Typer app, one module per verb.

Commands parse arguments and print; the work is done by library functions in ``ckptctl.ops``
that a Python user can call directly.
"""

from __future__ import annotations

from inspect import cleandoc
from typing import Annotated

import typer
import typer.core

from ckptctl.cli.common import check_environment, set_debug

check_environment()  # before the verbs import ckptctl.settings: a bad CKPTCTL_* value is exit 2

from ckptctl.cli import inspect, interval, latest, ls, prune, verify  # noqa: E402
from ckptctl.cli import cp, restore  # noqa: E402
from ckptctl.cli import reshard  # noqa: E402
from ckptctl.cli import convert  # noqa: E402
from ckptctl.cli import du, rm, sync  # noqa: E402
from ckptctl.cli import seal  # noqa: E402
from ckptctl.cli import repoint  # noqa: E402
from ckptctl.version import __version__  # noqa: E402

class _Group(typer.core.TyperGroup):
    """The app: ``--show-completion SHELL`` and ``--install-completion SHELL`` use the shell
    named. typer's options are flags that ask shellingham for the parent process's shell and
    left the name as a stray argument, so ``ckptctl --show-completion bash`` failed with
    "Shell sh not supported" under /bin/sh (a Dockerfile RUN, cron, CI steps) and printed
    bash's script for ``--show-completion zsh`` under bash. Without a name they still detect."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        if len(args) >= 2 and args[0] in _COMPLETION_OPTIONS and args[1] in _SHELLS:
            option = next(p for p in self.params if args[0] in getattr(p, "opts", ()))
            assert option.callback is not None
            option.callback(ctx, option, args[1])  # prints or installs, then exits
        return super().parse_args(ctx, args)  # type: ignore[arg-type]


_COMPLETION_OPTIONS = ("--show-completion", "--install-completion")
_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")  # typer's completion scripts

app = typer.Typer(
    name="ckptctl",
    cls=_Group,
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

class _Command(typer.core.TyperCommand):
    """A verb whose help names its arguments and values as the man pages do (``ROOT``,
    ``CKPT...``, ``N``), not as typer shows Python types (``{root}``, ``<str>``, ``<bool>``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        for param in self.params:
            _plain(param)

    def get_help_option(self, ctx: typer.Context) -> object:  # type: ignore[override]
        option = super().get_help_option(ctx)  # type: ignore[arg-type]
        if option is not None:
            _plain(option)
        return option


def _plain(param: object) -> None:
    # typer's own parameter classes: it bundles its own copy of click.
    if isinstance(param, typer.core.TyperArgument):
        name = param.metavar or (param.name or "").upper() + ("..." if param.nargs != 1 else "")
        shown = name if param.required else f"[{name}]"
        param.get_usage_pieces = lambda ctx: [shown]  # type: ignore[method-assign]
        param.display_type_rich = lambda ctx: None  # type: ignore[attr-defined]
        param.metavar = name
    elif isinstance(param, typer.core.TyperOption) and param.is_flag:
        param.display_type_rich = lambda ctx: None  # type: ignore[attr-defined]
    elif isinstance(param, typer.core.TyperOption) and param.metavar is None:
        metavar = (param.name or "value").upper()
        param.display_type_rich = lambda ctx: metavar  # type: ignore[attr-defined]


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
    ("rm", rm.rm),
    ("du", du.du),
    ("sync", sync.sync),
    ("seal", seal.seal),
    ("repoint", repoint.repoint),
    ("interval", interval.interval),
    ("reshard", reshard.reshard),
    ("convert", convert.convert),
]:
    app.command(name, help=_reflowed(fn.__doc__), cls=_Command)(fn)


def main() -> None:
    app()
