"""The location arguments of every verb (a path or s3:// URL), checked before the verb runs.

``command()`` calls ``check_locations`` with the verb's arguments, found by name: every verb
names what it reads ``src``, ``root``, ``ckpt``, ``ckpts`` or ``path`` and what it writes ``dst``.
What cannot name a location at all is a usage error (exit 2) naming the argument, before any
storage is touched; found later, it surfaced as an operational error (exit 3) or a crash:

- empty text, or a NUL byte (``ValueError: embedded null byte`` from the first os call);
- an s3:// bucket name botocore refuses (``Bad_Bucket!``: its parameter validation read as a
  storage error);
- a name longer than the filesystem allows (255 bytes a component, 4095 a path);
- a destination below something that is not a directory (``notes.txt/out``, ``/dev/null/x``:
  "Not a directory" from deep inside a copy), or a destination that is itself an existing file
  where the verb writes a directory (every verb's DST but convert's to a torch or safetensors
  file).

Whether a location exists, and what it holds, stays the verb's question.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from ckptctl.errors import UsageError

READS = ("src", "root", "ckpt", "ckpts", "path")
WRITES = ("dst",)
FILE_DESTINATIONS = {"convert": ("torch", "safetensors")}  # verb -> --to formats whose DST may be a file

NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4095  # bytes in a whole path, less its NUL
# botocore's own rule (it allows the uppercase and underscores other S3-compatible stores use).
_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")


def check_locations(verb: str, arguments: Mapping[str, Any]) -> None:
    """UsageError for the first location argument of ``verb`` that cannot name a location."""
    for name in READS + WRITES:
        value = arguments.get(name)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                _check(name.upper().rstrip("S"), text, writing=name in WRITES,
                       may_be_file=arguments.get("to") in FILE_DESTINATIONS.get(verb, ()))


def _check(shown: str, text: str, *, writing: bool, may_be_file: bool) -> None:
    if not text.strip():
        raise UsageError(f"{shown} is empty", hint="give a directory or s3://BUCKET/PREFIX")
    if "\x00" in text:
        raise UsageError(f"{shown} {_quoted(text)} contains a NUL byte", hint="no path or URL can hold one")
    if text[:5].lower() == "s3://":
        bucket = text[5:].partition("/")[0]
        if bucket and not _BUCKET.fullmatch(bucket):
            raise UsageError(f"{shown} {_quoted(text)}: {bucket!r} is not a bucket name",
                             hint="bucket names are letters, digits, dots, hyphens and underscores (3 to 63 on AWS)")
        return
    if "://" in text and not text.lower().startswith("file://"):
        return  # another scheme: the storage layer names the schemes it supports
    path = text[len("file://"):] if text.lower().startswith("file://") else text
    encoded = os.fsencode(path)
    if len(encoded) > PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise UsageError(f"{shown} {_quoted(text)} is too long a path",
                         hint=f"at most {NAME_MAX} bytes a name and {PATH_MAX} in all")
    if writing:
        _check_destination(shown, text, os.path.abspath(path), may_be_file=may_be_file)


def _check_destination(shown: str, text: str, path: str, *, may_be_file: bool) -> None:
    if os.path.lexists(path) and not os.path.isdir(path) and not may_be_file:
        raise UsageError(f"{shown} {_quoted(text)} is a file, not a directory",
                         hint="give a directory to write into, or a path that does not exist yet")
    above = os.path.dirname(path)
    while not os.path.lexists(above):  # the nearest thing that exists above DST
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise UsageError(f"{shown} {_quoted(text)}: {above} is not a directory",
                         hint="choose a destination below a directory")


def _quoted(text: str, limit: int = 80) -> str:
    """``text`` for an error line, cut short: the line names the value, never repeats a
    pasted megabyte."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
