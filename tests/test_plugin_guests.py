"""A plugin is a guest: it cannot speak for ckptctl (issue 29, item 4).

Each hostile plugin here is a real installed distribution, as importlib.metadata reads it from
sys.path (a ``.dist-info`` with its ``entry_points.txt`` and the module beside it), run by real
processes: the ``ckptctl`` command line itself for what happens at import, and for the many
verbs of one case a process that imports the app once and runs them in turn. Before: a plugin
calling ``sys.exit(0)`` at import made every verb exit 0 silently (``prune --yes`` deleted
nothing, cron saw success), ``sys.exit(3)`` made every verb exit 3, a banner printed at import
corrupted ``latest``'s path and ``ls --json``, a ``step_of`` that raised gave ``internal
error`` in 12 of 15 verbs, and a storage plugin whose opener raised gave ``internal error``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import make_checkpoints
from test_layouts import hf_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))


def install(site: str, name: str, source: str, entry_points: str) -> dict[str, str]:
    """Install the module ``name`` (``source``) as a distribution declaring ``entry_points`` (the
    text of its entry_points.txt) into ``site``; returns the environment that puts it on sys.path."""
    info = os.path.join(site, f"{name}-0.1.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(textwrap.dedent(entry_points))
    with open(os.path.join(site, f"{name}.py"), "w") as f:
        f.write(textwrap.dedent(source))
    return {"PYTHONPATH": os.pathsep.join([site, HERE, os.environ.get("PYTHONPATH", "")])}


def ckptctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


# Runs each argument list of argv[1] (JSON) through the real app in this one process, and
# prints [[exit, stdout, stderr], ...] as JSON on the real stdout afterwards.
_DRIVER = r"""
import json, os, sys
from typer.testing import CliRunner
from ckptctl.cli.app import app
out = []
for argv in json.loads(sys.argv[1]):
    r = CliRunner().invoke(app, argv, catch_exceptions=True)
    out.append([r.exit_code, r.stdout, r.stderr + ("" if r.exception is None or isinstance(r.exception, SystemExit)
                                                   else f"UNCAUGHT {type(r.exception).__name__}: {r.exception}")])
os.write(1, json.dumps(out).encode())
"""


def run_verbs(env: dict[str, str], argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    p = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return [tuple(r) for r in json.loads(p.stdout)]  # type: ignore[misc]


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ckptctl: warning:")]


@pytest.mark.parametrize("at_import", ["sys.exit(0)", "sys.exit(3)", "banner"])
def test_a_plugin_that_exits_or_prints_at_import_is_skipped_and_stdout_stays_ckptctls(tmp_path, at_import):
    body = {"sys.exit(0)": "sys.exit(0)", "sys.exit(3)": "sys.exit(3)",
            "banner": "print('*** hostile plugin loaded ***')\nos.write(1, b'raw banner\\n')"}[at_import]
    env = install(str(tmp_path / "site"), "ckptctl_hostile_import", f"import os, sys\n{body}\nclass Layout: pass\n",
                  "[ckptctl.layouts]\nhostile = ckptctl_hostile_import:Layout\n")
    root = str(tmp_path / "root")
    paths = make_checkpoints(root, [1, 2], size=8, tensors=1)
    r = ckptctl(env, "latest", root)
    assert r.returncode == 0 and r.stdout == paths[-1] + "\n", (r.returncode, r.stdout, r.stderr)
    (warned,) = warnings_of(r.stderr)
    assert "'hostile'" in warned and "skipped" in warned and "pip uninstall ckptctl-hostile-import" in warned
    if at_import == "banner":
        assert "hostile plugin loaded" in r.stderr and "raw banner" in r.stderr  # shown, on stderr
        warned = ""  # it imported: only its not being a layout is refused
    else:
        assert "SystemExit" in warned, warned
    r = ckptctl(env, "ls", root, "--json")
    assert r.returncode == 0 and [c["step"] for c in json.loads(r.stdout)["checkpoints"]] == [1, 2]
    r = ckptctl(env, "prune", root, "--keep-last", "1", "--yes")
    assert r.returncode == 0 and not os.path.exists(paths[0]) and os.path.exists(paths[-1]), r.stderr


_RAISING_LAYOUT = """
import sys
from ckptctl_toy_layout import ToyLayout

class Raising(ToyLayout):
    name = "raising"

    def step_of(self, child):
        print("step_of speaking on stdout")
        if child.key.startswith("toy-"):
            return super().step_of(child)
        raise RuntimeError("step_of blew up")

    def check(self, ckpt, level="checksums", **kwargs):
        sys.exit(0)  # what a plugin must never do for ckptctl

    def kind_of_checkpoint(self, ckpt, manifest=None):
        raise ValueError("no idea")
"""


def test_a_plugin_layout_whose_methods_raise_fails_only_its_own_checkpoints(tmp_path):
    from ckptctl_toy_layout import build_checkpoint

    env = install(str(tmp_path / "site"), "ckptctl_raising_layout", _RAISING_LAYOUT,
                  "[ckptctl.layouts]\nraising = ckptctl_raising_layout:Raising\n")
    root = str(tmp_path / "root")
    own = make_checkpoints(root, [1, 2], size=8, tensors=1)
    toy = build_checkpoint(root, 9)  # the plugin's, newer than ckptctl's; its check exits
    hf_root = str(tmp_path / "hf")
    os.makedirs(hf_root)
    hf = hf_checkpoint(hf_root, 100)
    out = str(tmp_path / "out")
    verbs = [
        ["ls", root], ["ls", root, "--json"], ["inspect", own[-1]], ["verify", own[-1]], ["verify", root, "--all"],
        ["verify", root, "--latest"], ["latest", root], ["du", root], ["prune", root, "--keep-last", "1", "--dry-run"],
        ["cp", own[-1], os.path.join(out, "cp")], ["restore", root, os.path.join(out, "restore")],
        ["sync", root, os.path.join(out, "sync"), "--dry-run"], ["seal", hf], ["repoint", root],
        ["interval", "--cost", "30s", "--mtbf", "1d"], ["verify", toy], ["rm", own[0], "--yes"],
    ]
    ran = dict(zip(map(tuple, verbs), run_verbs(env, verbs)))
    for argv, (code, stdout, stderr) in ran.items():
        assert "internal error" not in stderr and "UNCAUGHT" not in stderr, (argv, code, stderr)
        assert "speaking on stdout" not in stdout, (argv, stdout)  # the guest's print went to stderr
    # 1 where the plugin's own checkpoint is what the verb reports on (it cannot be checked,
    # so it counts as broken: prune keeps it and says so; it is the newest, so verify --latest
    # fails); 2: repoint has no pointer here.
    expected = {("verify", toy): 1, ("verify", root, "--all"): 1, ("verify", root, "--latest"): 1,
                ("prune", root, "--keep-last", "1", "--dry-run"): 1,
                ("repoint", root): 2}
    for argv, (code, stdout, stderr) in ran.items():
        assert code == expected.get(argv, 0), (argv, code, stdout, stderr)
    assert ran[("latest", root)][1] == own[-1] + "\n"  # the plugin's newer toy-9 is skipped: it cannot be checked
    assert "'raising'" in ran[("verify", toy)][1] and "SystemExit" in ran[("verify", toy)][1]
    listed = json.loads(ran[("ls", root, "--json")][1])["checkpoints"]
    assert [(c["name"], c["layout"]) for c in listed] == [("step-0000000001", "ckptctl"), ("step-0000000002", "ckptctl"),
                                                          ("toy-9", "raising")]
    assert not os.path.exists(own[0]) and os.path.exists(toy)  # rm of ckptctl's own, after all of that
    # One warning per plugin, however many of its calls failed.
    assert len(warnings_of(ran[("ls", root)][2])) == 1, ran[("ls", root)][2]


_RAISING_STORAGE = """
from ckptctl.storage.local import LocalStorage

def open_broken(url, **kwargs):
    raise ValueError("cannot open " + url)

class Listless(LocalStorage):
    def list(self, prefix=""):
        raise OSError("the backend lost its connection")

    def children(self, prefix=""):
        yield from ()
        raise OSError("the backend lost its connection")  # a generator failing as it is iterated

def open_listless(url, **kwargs):
    print("opening on stdout")
    return Listless(url[len("listless://"):], url=url)
"""


def test_a_storage_plugin_that_raises_is_a_storage_error_naming_it(tmp_path):
    env = install(str(tmp_path / "site"), "ckptctl_raising_storage", _RAISING_STORAGE,
                  "[ckptctl.storage]\nbrokenfs = ckptctl_raising_storage:open_broken\n"
                  "listless = ckptctl_raising_storage:open_listless\n")
    root = str(tmp_path / "root")
    make_checkpoints(root, [1], size=8, tensors=1)
    for args in (["ls", "brokenfs://x/y"], ["ls", f"listless://{root}", "--json"], ["latest", f"listless://{root}"]):
        r = ckptctl(env, *args)
        assert r.returncode == 3 and "internal error" not in r.stderr, (args, r.returncode, r.stderr)
        assert "storage error" in r.stderr and "ckptctl-raising-storage" in r.stderr, r.stderr
        assert "opening on stdout" not in r.stdout
        if "--json" in args:
            assert json.loads(r.stdout)["exit"] == 3
    r = ckptctl(env, "ls", root)  # ckptctl's own backends are untouched
    assert r.returncode == 0 and "step-0000000001" in r.stdout
