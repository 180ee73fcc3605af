"""Help text names arguments and values as the man pages do (ROOT, CKPT..., N), never as
typer shows Python types ({root}, <str>, <bool>)."""

from __future__ import annotations

import re

import pytest
import typer.main
from helpers import cli_subprocess

from ckptctl.cli.app import app

VERBS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("verb", VERBS)
def test_help_shows_metavars_not_python_types(verb: str) -> None:
    r = cli_subprocess(verb, "--help", env={"COLUMNS": "200", "TERM": "dumb"})
    assert r.exit_code == 0, r.stderr
    text = r.stdout
    assert not re.search(r"<(str|bool|int|float|list\[[a-z]+\])>", text), text
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage and re.search(r"\b[A-Z_]+(\.\.\.)?\b", usage.split("[OPTIONS]")[-1]), usage


def test_new_verbs_usage_lines() -> None:
    r = cli_subprocess("rm", "--help", env={"COLUMNS": "200"})
    assert "rm [OPTIONS] CKPT..." in r.stdout
    r = cli_subprocess("sync", "--help", env={"COLUMNS": "200"})
    assert "sync [OPTIONS] SRC_ROOT DST_ROOT" in r.stdout
    r = cli_subprocess("prune", "--help", env={"COLUMNS": "200"})
    assert re.search(r"--keep-daily\s+N\s", r.stdout)
