"""What every verb shares: options defined once, output (data to stdout, diagnostics to
stderr), and running a command so that expected failures print one line and exit with the
documented code instead of a traceback."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Annotated, Any, Callable, TypeVar

import typer
from rich.console import Console

from ckptctl.cli.errors import describe
from ckptctl.errors import CkptError

out = Console(soft_wrap=True)  # data
err = Console(stderr=True, soft_wrap=True)  # diagnostics, progress

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
LevelOpt = Annotated[
    str,
    typer.Option("--level", help="Verification level: quick, checksums or load.", case_sensitive=False),
]

F = TypeVar("F", bound=Callable[..., Any])


def debug_enabled() -> bool:
    return os.environ.get("CKPTCTL_DEBUG", "") not in ("", "0")


def command(fn: F) -> F:
    """Wrap a verb: a CkptError becomes one line on stderr and its exit code."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CkptError as e:
            if debug_enabled():
                raise
            text, code = describe(e)
            err.print(text, markup=False, highlight=False)
            raise typer.Exit(code) from None
        except KeyboardInterrupt:
            err.print("interrupted", markup=False)
            raise typer.Exit(130) from None

    return run  # type: ignore[return-value]


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=_default) + "\n")
    sys.stdout.flush()


def _default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
