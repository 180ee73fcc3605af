"""Paths printed byte for byte where a script reads them, escaped where a person does (issue 29,
item 5).

A root's name may hold a TAB, a carriage return, an escape sequence, a newline, bytes that are
not UTF-8. rich printed a TAB as spaces and dropped a CR, so ``CKPT=$(ckptctl latest ROOT)``
named a directory that does not exist; ESC reached the terminal raw; a newline made
``latest``'s one line two. Now ``latest``, ``restore``, ``cp`` and ``--resume-args`` print the
path exactly (``--resume-args`` quoted for the shell, on one line), ``--json`` round-trips, and
the human tables and diagnostics show control characters escaped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import cli, make_checkpoints
from test_layouts import hf_checkpoint

HOSTILE = "a\tb\rc\x1b[31md\ne f"  # TAB, CR, an escape sequence, a newline


def _shell_args(line: str) -> list[str]:
    """What bash makes of ``--resume-args``'s line: ``eval "set -- $LINE"``, each argument back."""
    out = subprocess.run(["bash", "-c", 'eval "set -- $0"; printf "%s\\0" "$@"', line], capture_output=True, check=True)
    return [os.fsdecode(a) for a in out.stdout.split(b"\0")[:-1]]


def _no_raw_controls(text: str) -> bool:
    return not any(c in text for c in "\t\r\x1b") and text.count("\n") == len(text.splitlines())


def test_latest_cp_restore_print_the_path_exactly_and_resume_args_quote_it(tmp_path) -> None:
    root = str(tmp_path / HOSTILE)
    newest = make_checkpoints(root, [1, 2])[-1]
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout == newest + "\n", repr(r.stdout)
    r = cli("latest", root, "--resume-args")
    assert r.exit_code == 0 and r.stdout.count("\n") == 1 and "\x1b" not in r.stdout, repr(r.stdout)
    assert _shell_args(r.stdout.rstrip("\n")) == [newest]
    r = cli("latest", root, "--json")
    assert json.loads(r.stdout)["url"] == newest and json.loads(r.stdout)["resume"]["argv"] == [newest]

    dst = str(tmp_path / f"copy {HOSTILE}")
    r = cli("cp", newest, dst)
    assert r.exit_code == 0 and r.stdout == os.path.join(dst, os.path.basename(newest)) + "\n", repr(r.stdout)
    assert _no_raw_controls(r.stderr), repr(r.stderr)
    r = cli("restore", root, str(tmp_path / f"restored {HOSTILE}"))
    assert r.exit_code == 0 and r.stdout == os.path.join(str(tmp_path / f"restored {HOSTILE}"),
                                                         os.path.basename(newest)) + "\n", repr(r.stdout)


def test_another_stacks_resume_args_round_trip_through_the_shell(tmp_path) -> None:
    root = str(tmp_path / HOSTILE)
    os.makedirs(root)
    ckpt = hf_checkpoint(root, 100)
    r = cli("latest", root, "--resume-args")
    assert r.exit_code == 0 and r.stdout.count("\n") == 1, repr(r.stdout)
    assert _shell_args(r.stdout.rstrip("\n")) == ["--resume_from_checkpoint", ckpt]


def test_tables_and_reports_show_control_characters_escaped_one_line_per_record(tmp_path) -> None:
    root = str(tmp_path / HOSTILE)
    make_checkpoints(root, [1, 2, 3])
    r = cli("ls", root)
    assert r.exit_code == 0 and _no_raw_controls(r.stdout) and _no_raw_controls(r.stderr), repr(r.stdout)
    assert len(r.stdout.splitlines()) == 1 + 3  # the header, then one line per checkpoint
    assert "a\\tb\\rc\\x1b[31md\\ne f" in r.stdout, r.stdout
    assert [c["url"] for c in json.loads(cli("ls", root, "--json").stdout)["checkpoints"]] == \
        [os.path.join(root, f"step-{s:010d}") for s in (1, 2, 3)]
    for args in (["verify", root, "--all"], ["du", root], ["prune", root, "--keep-last", "1", "--dry-run"]):
        r = cli(*args)
        assert r.exit_code == 0 and _no_raw_controls(r.stdout) and _no_raw_controls(r.stderr), (args, r.stdout, r.stderr)
    r = cli("verify", str(tmp_path / f"missing {HOSTILE}"))
    assert r.exit_code == 2 and _no_raw_controls(r.stderr) and "\\x1b" in r.stderr, repr(r.stderr)


def test_a_name_that_is_not_utf8_is_printed_as_its_bytes(tmp_path) -> None:
    """Through a real process: argv and stdout carry the bytes, not a decoding of them."""
    root = os.path.join(os.fsencode(str(tmp_path)), b"run-\xff\xfe")
    newest = make_checkpoints(os.fsdecode(root), [1])[-1]
    run = [sys.executable, "-m", "ckptctl", "latest", root]
    p = subprocess.run(run, capture_output=True, env={**os.environ, "LC_ALL": "C.UTF-8"})
    assert p.returncode == 0 and p.stdout == os.fsencode(newest) + b"\n", (p.stdout, p.stderr)
    p = subprocess.run([*run, "--resume-args"], capture_output=True, env={**os.environ, "LC_ALL": "C.UTF-8"})
    assert p.returncode == 0 and b"\xff" not in p.stdout, p.stdout  # escaped inside $'...'
    assert _shell_args(os.fsdecode(p.stdout.rstrip(b"\n"))) == [newest]


ODD = "r\\oot \t*?[x\n"  # a backslash, TAB, glob characters and a newline: all legal in a local name


def test_a_root_named_with_a_backslash_and_controls_works_with_every_verb(tmp_path) -> None:
    """A local name may hold any character but NUL: the root's own name is never checked as a
    key inside a checkpoint (a backslash in it made ls and restore refuse the root as
    "absolute or escapes its checkpoint"). Keys inside checkpoints are still checked strictly:
    a sibling no key may name is never listed, so never taken for a checkpoint or deleted."""
    root = str(tmp_path / ODD)
    old, newest = make_checkpoints(root, [1, 2])
    for args in (("verify", newest), ("verify", root, "--latest"), ("verify", root, "--all"), ("ls", root),
                 ("du", root), ("inspect", newest)):
        r = cli(*args)
        assert r.exit_code == 0, (args[0], r.stdout[-1000:], r.stderr[-1000:])
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout == newest + "\n", repr(r.stdout + r.stderr)
    r = cli("latest", root, "--json")
    assert r.exit_code == 0 and r.json()["url"] == newest, repr(r.stdout + r.stderr)

    dst = str(tmp_path / f"copy {ODD}")
    r = cli("cp", newest, dst)
    assert r.exit_code == 0 and r.stdout == os.path.join(dst, os.path.basename(newest)) + "\n", repr(r.stdout + r.stderr)
    restored = str(tmp_path / f"restored {ODD}")
    r = cli("restore", root, restored)
    assert r.exit_code == 0 and r.stdout == os.path.join(restored, os.path.basename(newest)) + "\n", \
        repr(r.stdout + r.stderr)
    r = cli("sync", root, str(tmp_path / f"synced {ODD}"))
    assert r.exit_code == 0, repr(r.stdout + r.stderr)
    for copy in (dst, restored, str(tmp_path / f"synced {ODD}")):
        r = cli("verify", os.path.join(copy, os.path.basename(newest)), "--load")
        assert r.exit_code == 0, repr(r.stdout + r.stderr)

    # A sibling under a name no key may hold, named like a checkpoint: left alone by every verb.
    stray = os.path.join(root, os.path.basename(old) + "\\")
    os.makedirs(stray)
    r = cli("prune", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 0, repr(r.stdout + r.stderr)
    assert sorted(n for n in os.listdir(root) if not n.startswith(".ckptctl-")) == \
        sorted([os.path.basename(newest), os.path.basename(stray)])
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout == newest + "\n", repr(r.stdout + r.stderr)
