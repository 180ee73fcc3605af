"""The registries of layouts and storage backends: plugins by entry point (``ckptctl.layouts``,
``ckptctl.storage``), what they may not do, and that a broken one never stops a verb.

The toy plugin (``tests/plugins/ckptctl-toy-layout``, installed by scripts/setup.sh) is the real
installed distribution; broken ones are real entry points too, whose targets do not import or
give the wrong thing. What every registered layout must do is tests/test_layout_conformance.py.
"""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint

import pytest

from ckptctl.errors import UsageError
from ckptctl.layouts import catalog
from ckptctl.layouts.registry import GROUP as LAYOUT_GROUP
from ckptctl.layouts.registry import registered
from ckptctl.storage import GROUP as STORAGE_GROUP
from ckptctl.storage import open_storage, registered_openers, schemes
from helpers import cli, cli_subprocess, make_checkpoints
from test_layout_conformance import fixture_of

try:
    from ckptctl_toy_layout import ToyLayout
except ImportError:  # the plugin is not installed: test_layout_conformance says so, naming the fix
    ToyLayout = None  # type: ignore[assignment,misc]

if ToyLayout is not None:
    class HfNamed(ToyLayout):  # type: ignore[misc,valid-type]
        name = "hf"  # an alias of the Trainer's layout: --format hf must keep meaning the Trainer


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ckptctl: warning:")]


@pytest.mark.parametrize(("target", "why"), [
    ("ckptctl_no_such_module:Layout", "ModuleNotFoundError"),
    ("os:getcwd", "of the layout protocol (ckptctl.layouts.base.Layout)"),
    ("ckptctl.layouts.dcp:DcpLayout", "'dcp', which another layout already has"),
    ("test_plugin_registry:HfNamed", "'hf', which ckptctl already uses for the format 'hf-trainer'"),
])
def test_a_plugin_layout_that_cannot_be_used_is_skipped_with_one_warning(target: str, why: str, capsys) -> None:
    found = [EntryPoint("bad", target, LAYOUT_GROUP), EntryPoint("toy", "ckptctl_toy_layout:ToyLayout", LAYOUT_GROUP)]
    layouts = registered(catalog.BUILTIN, found)
    assert [layout.name for layout in layouts] == [*(layout.name for layout in catalog.BUILTIN), "toy"]
    (line,) = _warnings(capsys.readouterr().err)
    assert "'bad'" in line and target in line and why in line and "skipped" in line and "to fix:" in line


def test_a_broken_plugin_installed_never_stops_a_verb(tmp_path) -> None:
    # A real installed distribution, as importlib.metadata reads it from sys.path, whose
    # entry points name a module that does not exist.
    site = tmp_path / "site"
    info = site / "ckptctl_broken_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ckptctl-broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ckptctl.layouts]\nbroken = ckptctl_no_such_module:Layout\n\n"
                                           "[ckptctl.storage]\nbadfs = ckptctl_no_such_module:open\n")
    root = str(tmp_path / "root")
    make_checkpoints(root, [1], size=8, tensors=1)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    listed = cli_subprocess("ls", root, "--json", env=env)
    assert listed.exit_code == 0, listed.stderr
    assert [e["step"] for e in listed.json()["checkpoints"]] == [1]  # stdout is the JSON alone
    (line,) = _warnings(listed.stderr)
    assert "'broken'" in line and "pip uninstall ckptctl-broken-plugin" in line
    bad_scheme = cli_subprocess("ls", "badfs://x/y", env=env)
    assert bad_scheme.exit_code == 2 and "unsupported storage scheme 'badfs'" in bad_scheme.stderr
    # Each broken entry point warned about once: the layout, and the backend looked up for badfs.
    warned = _warnings(bad_scheme.stderr)
    assert len(warned) == 2 and "'broken'" in warned[0] and "'badfs'" in warned[1], warned


def test_a_plugin_layout_name_is_accepted_by_format(tmp_path) -> None:
    fix = fixture_of("toy")
    root = str(tmp_path)
    fix.build(root, 5)
    make_checkpoints(root, [9], size=8, tensors=1)  # newer, but not a toy checkpoint
    latest = cli("latest", root, "--format", "TOY", "--json")
    assert latest.exit_code == 0 and latest.json()["step"] == 5 and latest.json()["layout"] == "toy", latest.stdout
    unknown = cli("latest", root, "--format", "nope")
    assert unknown.exit_code == 2 and "toy" in unknown.stderr  # the known names include the plugin's


def test_storage_backends_by_scheme_built_in_and_by_entry_point(tmp_path, capsys) -> None:
    fix = fixture_of("toy")
    fix.build(str(tmp_path), 3)
    assert "toyfs" in schemes() and schemes()[:2] == ("file", "s3")
    listed = cli("ls", f"toyfs://{tmp_path}", "--json")
    assert listed.exit_code == 0 and [e["url"] for e in listed.json()["checkpoints"]] == [f"toyfs://{tmp_path}/toy-3"]
    with pytest.raises(UsageError, match="unsupported storage scheme 'gs'.*") as info:
        open_storage("gs://bucket/x")
    assert "toyfs://" in (info.value.hint or "")
    openers = registered_openers([EntryPoint("s3", "ckptctl_toy_layout:open_toyfs", STORAGE_GROUP),
                                  EntryPoint("Bad Scheme", "ckptctl_toy_layout:open_toyfs", STORAGE_GROUP),
                                  EntryPoint("memfs", "ckptctl_no_such_module:open", STORAGE_GROUP),
                                  EntryPoint("toyfs2", "ckptctl_toy_layout:open_toyfs", STORAGE_GROUP)])
    assert list(openers) == ["toyfs2"]  # a built-in scheme is never taken over
    warned = _warnings(capsys.readouterr().err)
    assert len(warned) == 3 and "'s3', which another backend already has" in warned[0]


def test_the_layout_in_docs_extending_is_a_plugin_that_gets_the_verbs(tmp_path, monkeypatch) -> None:
    """The forty-odd lines of docs/extending.md, as a module a distribution would ship:
    registered by entry point (every member of the protocol, nothing subclassed), listed,
    verified at every level, copied and deleted, by the same functions the verbs call (the toy plugin, installed,
    goes through every verb: tests/test_layout_conformance.py)."""
    import json
    import os
    import re
    import sys

    from ckptctl.layouts.catalog import list_checkpoints
    from ckptctl.layouts.removal import entry_snapshot, remove_entry
    from ckptctl.ops.transfer.engine import copy_in_layout
    from ckptctl.ops.verify.engine import verify_entry
    from ckptctl.storage import open_storage

    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "extending.md")).read()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "class MyTrainerLayout" in block]
    assert len(code.splitlines()) <= 50, "the example plugin stays about forty lines"
    (tmp_path / "mytrainer_ckptctl.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    layouts = registered(catalog.BUILTIN, [EntryPoint("mytrainer", "mytrainer_ckptctl:MyTrainerLayout", LAYOUT_GROUP)])
    assert layouts[-1].name == "mytrainer" and type(layouts[-1]).__mro__[1:] == (object,)
    root = tmp_path / "run"
    for step in (1, 2, 3):
        (root / f"ckpt_{step}").mkdir(parents=True)
        (root / f"ckpt_{step}" / "weights.bin").write_bytes(os.urandom(64))
        if step < 3:  # the third save is killed before DONE
            (root / f"ckpt_{step}" / "DONE").write_text(json.dumps({"step": step}))
    st = open_storage(str(root))
    entries = list_checkpoints(st, layouts=[layouts[-1]])
    assert [(e.name, e.status) for e in entries] == [("ckpt_1", "committed"), ("ckpt_2", "committed"),
                                                     ("ckpt_3", "partial")]
    for level in ("quick", "checksums", "load"):
        assert verify_entry(entries[1], level).ok  # type: ignore[arg-type]
    (root / "ckpt_2" / "DONE").write_text(json.dumps({"step": 7}))
    assert not verify_entry(entries[1], "quick").ok
    # Copied as cp, restore and sync copy: data first, the commit file last (ops.transfer.engine).
    copied = copy_in_layout(layouts[-1], entries[0].storage, open_storage(str(tmp_path / "mirror")))
    assert copied.status == "copied" and (tmp_path / "mirror" / "ckpt_1" / "DONE").read_bytes() == \
        (root / "ckpt_1" / "DONE").read_bytes()
    assert [(e.name, e.status) for e in list_checkpoints(open_storage(str(tmp_path / "mirror")),
                                                         layouts=[layouts[-1]])] == [("ckpt_1", "committed")]
    # Deleted as prune and rm delete: its commit file first, each file only while as listed.
    assert layouts[-1].removal_order(["weights.bin", "DONE"]) == ["DONE", "weights.bin"]
    assert remove_entry(st, "ckpt_1", entry_snapshot(st, "ckpt_1"), layouts[-1].removal_order) is None
    assert sorted(os.listdir(root)) == ["ckpt_2", "ckpt_3"]
    sys.modules.pop("mytrainer_ckptctl", None)
