"""Names as they reach a script or a person: exact where a script reads them, escaped where a
person does.

A path may hold any byte but NUL and ``/``: a TAB, a carriage return, a newline, an escape
sequence, bytes that are not UTF-8 (argv hands those to Python as lone surrogates, which the
streams write back as the same bytes). What a script captures (``latest``'s path, ``restore``'s
and ``cp``'s, ``--resume-args``) is written byte for byte, never through rich, which prints a
TAB as spaces, drops a carriage return and would let an escape sequence reach the terminal;
``--resume-args`` quotes for the shell and stays one line. What a person reads (tables,
reports, diagnostics) shows control characters and undecodable bytes as escapes (``\\t``,
``\\x1b``), so a name can neither split a line nor drive the terminal.
"""

from __future__ import annotations

import re
import shlex
from typing import Iterable

# C0 controls, DEL, C1 controls, and undecodable bytes (surrogateescape's U+DC80-U+DCFF).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\udc80-\udcff]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(ch: str) -> str:
    """One unsafe character as the escapes of its bytes (UTF-8; an undecodable byte as itself),
    which ``$'...'`` turns back into exactly those bytes."""
    return _NAMED.get(ch) or "".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))


def visible(text: str) -> str:
    """``text`` for a person: control characters and undecodable bytes as escapes, one line."""
    return _UNSAFE.sub(lambda m: _escape(m.group()), text)


def shell_quote(arg: str) -> str:
    """``arg`` quoted for a POSIX shell (``shlex.quote``); one with a control character or an
    undecodable byte as ``$'...'`` (bash, zsh, ksh), which keeps it on one line and keeps the
    bytes away from the terminal."""
    if not _UNSAFE.search(arg):
        return shlex.quote(arg)
    body = arg.replace("\\", "\\\\").replace("'", "\\'")
    return "$'" + _UNSAFE.sub(lambda m: _escape(m.group()), body) + "'"


def shell_join(argv: Iterable[str]) -> str:
    """``argv`` as one shell-quoted line (``shlex.join``, with ``shell_quote``)."""
    return " ".join(shell_quote(a) for a in argv)
