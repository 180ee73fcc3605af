"""What every verb shares: options defined once, output (data to stdout, diagnostics to
stderr), and running a command so that it behaves like a well-made Unix tool in scripts:

- an expected failure (a CkptError) prints one line and exits with the documented code; under
  ``--json`` it is also a JSON document on stdout: ``{"error": {...}, "exit": N, "schema": 2}``;
- any other exception is a bug or an environment failure: one line, exit 3 (the traceback only
  with ``--debug`` or CKPTCTL_DEBUG=1);
- a closed stdout pipe (``ckptctl ls ROOT | head -1``) stops the command quietly with exit 0,
  as GNU tools stop on SIGPIPE: under ``set -o pipefail`` a healthy root must not read as bad;
- tables are one line per record when stdout is not a terminal, never truncated or wrapped,
  whatever COLUMNS says, so ``grep`` and ``wc -l`` count records;
- location arguments that cannot name a location are usage errors before anything runs
  (``cli.locations``), and numbers are checked against their bounds (``bounded_int``,
  ``parse_size``).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import sys
from decimal import Decimal
from typing import IO, Annotated, Any, Callable, Collection, Sequence, TypeVar

import typer
from rich.console import Console
from typer.exceptions import TyperException
from rich.table import Table

from ckptctl.cli.errors import describe
from ckptctl.cli.json_names import SCHEMA, named, requested_schema
from ckptctl.cli.locations import check_locations
from ckptctl.cli.text import visible
from ckptctl.cli.torchrun import torchrun_command
from ckptctl.errors import EXIT_OPERATIONAL, CkptError, UsageError


class _Console(Console):
    """rich's Console for what a person reads: text is shown with its control characters
    escaped (``cli.text.visible``: a name can neither split a line nor drive the terminal),
    never as markup or emoji; and a closed pipe is left to ``command()``: rich's own handler
    exits 1, which under ``set -o pipefail`` makes a healthy root read as bad. What a script
    captures goes through ``answer`` instead, byte for byte."""

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().print(*(visible(o) if isinstance(o, str) else o for o in objects), **kwargs)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of the output has gone")


out = _Console(soft_wrap=True, markup=False, highlight=False, emoji=False)  # data
err = _Console(stderr=True, soft_wrap=True, markup=False, highlight=False, emoji=False)  # diagnostics, progress

# The ROOT of the verbs that work on a whole root of checkpoints (ls, du, prune, latest).
RootArg = Annotated[str, typer.Argument(help="Checkpoint root: a directory or s3://bucket/prefix.", metavar="ROOT")]
JsonOpt = Annotated[bool, typer.Option(
    "--json",
    help='Print one JSON document on stdout, with "schema": 2 (bumped when a field changes meaning or name; the '
         'fields are in ckptctl-json(7); CKPTCTL_JSON_SCHEMA=1 prints the names of schema 1). A failure prints '
         '{"error": {"message", "hint", "type"}, "exit": N, "schema": 2} instead.',
)]
# -q is for cron, which mails whatever a job prints: on success nothing is printed but the
# answer a script captures (the JSON document; the path latest, restore and cp print), so that
# a mail means trouble. What means trouble (an error, a refusal, a checkpoint skipped or failing,
# a note) still prints on stderr, and the exit status says it.
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q",
    help="Print nothing when the command succeeds (for cron, which mails any output): no progress bar, report "
         "or summary. What a script captures still prints: the --json document, and the path latest, restore "
         "and cp print. Errors, refusals, checkpoints skipped or failing, and notes still print on stderr.")]

F = TypeVar("F", bound=Callable[..., Any])

_debug_option = False  # set by the app's --debug for the current invocation
_emitted_json = False  # whether the running verb already printed its JSON document
_verb = ""  # the running verb's name: which of its JSON names changed (cli.json_names)


def set_debug(on: bool) -> None:
    """Record the global ``--debug`` option for the current invocation."""
    global _debug_option
    _debug_option = on


def debug_enabled() -> bool:
    """``--debug`` was given, or CKPTCTL_DEBUG is set to anything but empty or 0."""
    return _debug_option or os.environ.get("CKPTCTL_DEBUG", "") not in ("", "0")


def check_environment() -> None:
    """Exit 2 with one line when a CKPTCTL_* environment variable is malformed: the settings
    are parsed when first imported, which happens while the app is built, before any verb's
    own error handling could report it."""
    try:
        import ckptctl.settings  # noqa: F401  (imported for its checks)
        requested_schema()
    except CkptError as e:
        text, code = describe(e)
        sys.stderr.write(visible(text) + "\n")
        sys.exit(code)


def command(fn: F) -> F:
    """Wrap a verb: errors, JSON errors, unexpected exceptions and closed pipes as described
    in this module's docstring."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        global _emitted_json, _verb
        _emitted_json, _verb = False, fn.__name__
        as_json = bool(kwargs.get("json"))
        _pass_undecodable_bytes()
        try:
            if as_json:
                requested_schema()  # a bad CKPTCTL_JSON_SCHEMA is a usage error before any work
            check_locations(fn.__name__, kwargs)
            with torchrun_command(fn.__name__, kwargs):  # every rank of a torchrun job agrees first
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, TyperException):
            raise  # typer's own exits and usage errors carry their code already
        except CkptError as e:
            if debug_enabled():
                raise
            text, code = describe(e)
            _fail(text, code, e, as_json)
        except KeyboardInterrupt:
            err.print("interrupted", markup=False)
            raise typer.Exit(130) from None
        except OSError as e:
            if _is_closed_pipe(e):
                _silence_stdout()
                raise typer.Exit(0) from None
            _unexpected(e, as_json)
        except Exception as e:  # reported: one line and exit 3, the traceback under --debug
            _unexpected(e, as_json)

    return run  # type: ignore[return-value]


def _pass_undecodable_bytes() -> None:
    """Print a path's undecodable bytes back as the same bytes, as Unix tools do: argv
    decodes them to surrogates, which a UTF-8 stdout refuses outside the C locale
    (UnicodeEncodeError, exit 3, after the work was done)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "encoding", "").lower().replace("-", "") == "utf8":
            reconfigure(errors="surrogateescape")


def _fail(text: str, code: int, e: BaseException, as_json: bool) -> None:
    """Print an error line on stderr (and the JSON error document), then exit with ``code``."""
    err.print(text, markup=False, highlight=False)
    if as_json and not _emitted_json:
        doc = {
            "error": {"message": str(e), "hint": getattr(e, "hint", None), "type": type(e).__name__},
            "exit": code,
        }
        try:
            schema = requested_schema()
        except UsageError:  # the bad value itself is what is being reported
            schema = SCHEMA
        try:
            emit_json(doc, schema=schema)
        except OSError:
            _silence_stdout()
    raise typer.Exit(code) from None


def _unexpected(e: Exception, as_json: bool) -> None:
    if debug_enabled():
        raise e
    first = (str(e).strip().splitlines() or [""])[0]
    text = (f"internal error: {type(e).__name__}: {first} "
            "(hint: rerun with --debug or CKPTCTL_DEBUG=1 for the traceback, and report it)")
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # stdout itself failed: do not fail again at exit
        _silence_stdout()
    _fail(text, EXIT_OPERATIONAL, e, as_json)


def _is_closed_pipe(e: OSError) -> bool:
    return isinstance(e, BrokenPipeError) or e.errno == errno.EPIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail again
    (Python would print "Exception ignored ... BrokenPipeError" and exit 120)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (in-process test runner): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def emit_json(doc: Any, *, schema: int | None = None) -> None:
    """Print ``doc`` as the verb's one JSON document on stdout; an object gets the
    ``"schema"`` field and the names of that schema (every verb prints an object; the fields
    are in man/ckptctl-json.7)."""
    global _emitted_json
    _emitted_json = True
    if isinstance(doc, dict) and "schema" not in doc:
        schema = requested_schema() if schema is None else schema
        doc = {**named(_verb, dict(doc), schema), "schema": schema}
    sys.stdout.write(json.dumps(doc, indent=2, default=_default) + "\n")
    sys.stdout.flush()


def _default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def say(text: str, *, console: Console | None = None) -> None:
    """One line of data (stdout) or of diagnostics (``console=err``) for a person to read:
    control characters in it are shown escaped."""
    console = console or out
    console.print(text, markup=False, highlight=False, emoji=False)


def answer(text: str) -> None:
    """The one line a script captures (``CKPT=$(ckptctl latest ROOT)``): ``text`` exactly, byte
    for byte, then a newline; never through rich, which would turn a TAB into spaces, drop a
    carriage return or wrap."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, right: Collection[str] = (),
                console: Console | None = None) -> None:
    """A table with a header. On a terminal rich fits it to the width; otherwise each record
    is one line in columns as wide as their widest cell (never cut with "…", never wrapped)."""
    console = console or out
    rows = [[visible(cell) for cell in row] for row in rows]  # a name's TAB or newline never splits a record
    if console.is_terminal:
        table = Table(box=None, pad_edge=False)
        for col in columns:
            table.add_column(col, justify="right" if col in right else "left", overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table, markup=False, highlight=False, emoji=False)
        return
    widths = [max([len(col), *(len(row[i]) for row in rows)]) for i, col in enumerate(columns)]
    stream: IO[str] = console.file
    for row in [list(columns), *rows]:
        cells = [cell.rjust(w) if col in right else cell.ljust(w) for cell, w, col in zip(row, widths, columns)]
        cells[-1] = cells[-1].rstrip()  # no trailing blanks on the last column
        stream.write("  ".join(cells) + "\n")
    stream.flush()


def step_shown(step: int) -> str:
    """A STEP column's cell: "-" for what is no checkpoint's (a temporary at the root, step -1)."""
    return str(step) if step >= 0 else "-"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# --- numbers given on the command line -------------------------------------------------------

MAX_STEP = 2**63 - 1  # a step is a signed 64-bit count wherever it is stored (ckptctl-format(5))


def bounded_int(value: int | None, option: str, *, minimum: int, maximum: int, what: str) -> int | None:
    """``value`` of the whole-number option ``option`` (typer has refused what is not one)
    when it lies in ``minimum..maximum``; UsageError naming the option otherwise. Checked
    before any work, so a typo never reaches a loop or an allocation sized by it."""
    if value is None or minimum <= value <= maximum:
        return value
    bound = f"less than {minimum}" if value < minimum else f"more than {maximum}"
    raise UsageError(f"{option} {shown_int(value)} is {bound}", hint=f"give {what} from {minimum} to {maximum}")


def shown_int(value: int) -> str:
    """``value`` for an error line: whole when short, else its first digits and length (and
    str() of an int beyond 4300 digits raises)."""
    if value.bit_length() > 4000:
        return f"of {value.bit_length()} bits"
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"


# Bytes per unit: decimal (5GB, as Hugging Face writes shard sizes) and binary (500MiB, 2G).
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}
# Digits, an optional fraction and exponent, then a unit: no sign, nan or inf, so that only
# finite positive numbers get as far as arithmetic (1e309 used to overflow int(float(...))).
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d{1,4}))?\s*([a-z]*)")
MAX_SIZE = 2**53  # 8 PiB, far above any file; every size up to it is exact as a float too


def parse_size(text: str, option: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000: a whole number
    of bytes from 1 to ``MAX_SIZE`` (fractions of a byte are dropped); UsageError naming
    ``option`` for anything else (a sign, nan, inf, 1e309, an unknown unit, under one byte)."""
    m = _SIZE.fullmatch(text.strip().lower())
    if m is None or m.group(3) not in _SIZE_UNITS:
        raise UsageError(f"{option} {_quoted(text)} is not a size", hint="use e.g. 5GB, 500MiB or a number of bytes")
    number, exponent, unit = m.groups()
    value = Decimal(number).scaleb(int(exponent or 0)) * _SIZE_UNITS[unit]  # exact: no float rounding
    if not 1 <= value <= MAX_SIZE:
        raise UsageError(f"{option} {_quoted(text)} is {'less than one byte' if value < 1 else 'more than 8 PiB'}",
                         hint="use e.g. 5GB, 500MiB or a number of bytes")
    return int(value)


def _quoted(text: str, limit: int = 40) -> str:
    """``text`` quoted for an error line, cut short: the line names the value, never repeats
    a pasted megabyte."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"
