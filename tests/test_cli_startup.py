"""Commands used in shell loops and cron jobs start without importing torch.

Importing torch takes seconds, more than ``ls``, ``latest``, ``interval`` or a ``verify`` of a
small checkpoint themselves. Each command here runs in a fresh interpreter (the test process
has torch loaded already) and reports whether torch ended up in ``sys.modules``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import make_checkpoints

MARK = "ckptctl-test: torch imported:"

# Runs the real Typer app in a fresh interpreter with argv, then says whether torch was imported.
_RUN = f"""
import sys
from ckptctl.cli.app import app
code = 0
try:
    app(sys.argv[1:], prog_name="ckptctl")
except SystemExit as e:
    code = e.code or 0
print("{MARK}", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def run_fresh(*args: str) -> tuple[int, bool, str]:
    """(exit code, whether torch was imported, stdout) of ``ckptctl ARGS`` in a new process."""
    env = {k: v for k, v in os.environ.items() if k != "CKPTCTL_DEBUG"}
    p = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(MARK)]
    assert lines, f"ckptctl {' '.join(args)} did not finish: {p.stderr[-2000:]}"
    return p.returncode, lines[-1].split()[-1] == "True", p.stdout


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    r = tmp_path_factory.mktemp("startup")
    make_checkpoints(str(r), [100, 200, 300])
    return str(r)


def _cases(root: str, tmp: str) -> list[list[str]]:
    ckpt = os.path.join(root, "step-0000000300")
    return [
        ["--help"],
        ["ls", root],
        ["ls", root, "--json"],
        ["latest", root],
        ["latest", root, "--level", "quick"],
        ["interval", "--cost", "30s", "--mtbf", "1d"],
        ["interval", root, "--mtbf", "1d"],
        ["verify", ckpt],
        ["verify", ckpt, "--quick"],
        ["verify", root, "--all", "--json"],
        ["inspect", ckpt, "--tensors"],
        ["cp", ckpt, os.path.join(tmp, "cp")],
        ["restore", root, os.path.join(tmp, "restored")],
        # Help of the verbs that do need torch when they run: the help itself does not.
        ["reshard", "--help"],
        ["convert", "--help"],
    ]


def test_shell_and_cron_commands_do_not_import_torch(root, tmp_path):
    for args in _cases(root, str(tmp_path)):
        code, torch_imported, out = run_fresh(*args)
        assert code == 0, f"ckptctl {' '.join(args)} exited {code}"
        assert out.strip(), f"ckptctl {' '.join(args)} printed nothing"
        assert not torch_imported, f"ckptctl {' '.join(args)} imported torch"


def test_prune_with_a_recorded_verification_does_not_import_torch(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [100, 200, 300])
    # The first (real) prune decodes every tensor of its anchor (the load level, which uses
    # torch) and records the verification (a --dry-run records nothing); the cron runs after
    # it, with nothing new saved, read only manifests and the record.
    code, _, _ = run_fresh("prune", root, "--keep-last", "3", "--yes")
    assert code == 0
    code, torch_imported, out = run_fresh("prune", root, "--keep-last", "2", "--dry-run")
    assert code == 0 and "step-0000000100" in out
    assert not torch_imported
    code, torch_imported, out = run_fresh("prune", root, "--keep-last", "2", "--yes")
    assert code == 0 and "deleted 1" in out
    assert not torch_imported


def test_load_level_still_decodes_with_torch(root):
    # The check that needs tensors still runs them: torch is imported on demand, not dropped.
    code, torch_imported, out = run_fresh("verify", os.path.join(root, "step-0000000300"), "--load")
    assert code == 0 and "(load)" in out
    assert torch_imported


def test_python_api_names_still_import():
    code = ("import sys, ckptctl\n"
            "assert 'torch' not in sys.modules\n"
            "from ckptctl import Checkpointer, SaveHandle, __version__\n"
            "from ckptctl.checkpointer import Checkpointer as C\n"
            "assert Checkpointer is C and 'torch' in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
