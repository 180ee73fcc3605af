"""A checkpoint's identity: its directory name, manifest and marker name one step.

Every fault here is made with real files: a checkpoint directory copied under another name,
a manifest re-sealed with another step, a manifest grown after commit, an oversized marker.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ckptctl.errors import InvalidCheckpoint, RefusedForSafety
from ckptctl.format.layout import MANIFEST, MARKER, parse_step_dir, step_dir
from ckptctl.format.manifest import Manifest
from ckptctl.format.marker import Marker
from ckptctl.layouts import catalog, native_commit, native_read
from ckptctl.storage import open_storage
from ckptctl.storage.base import ObjectInfo
from ckptctl.storage.local import LocalStorage
from helpers import ckpt_dir, cli, make_checkpoints


def _reseal(path: str, **changes: object) -> None:
    """Rewrite a checkpoint's manifest with ``changes`` and a marker that commits it, as a
    hand edit (or another tool) would: the marker matches, only the identity is wrong."""
    with open(os.path.join(path, MANIFEST), "rb") as f:
        doc = json.load(f)
    doc.update(changes)
    raw = json.dumps(doc).encode()
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(raw)
    with open(os.path.join(path, MARKER), "wb") as f:
        f.write(Marker.for_manifest(int(doc["step"]), raw).to_json())


def _dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


# --- step directory names ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["step-٤٠", "step-0000000040\n", "step-40\n", "step-", "step--5", "step-+5",
                                  "step-99999999999999999999", "step-9999999999999999999", "xstep-40"])
def test_only_plain_ascii_digits_name_a_step_directory(name):
    assert parse_step_dir(name) is None


def test_step_directory_names_that_do_parse():
    assert parse_step_dir("step-0000000040") == 40 and parse_step_dir("step-40") == 40
    assert parse_step_dir(step_dir(2**63 - 1)) == 2**63 - 1
    with pytest.raises(ValueError):
        step_dir(-5)


def test_non_ascii_and_newline_names_are_not_listed(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [10])
    for name in ("step-٤٠", "step-0000000040\n"):
        shutil.copytree(ckpt_dir(root, 10), os.path.join(root, name))
    rows = cli("ls", root, "--json").json()["checkpoints"]
    assert [(r["step"], r["name"]) for r in rows] == [(10, step_dir(10))]
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(root, 10)


# --- directory, manifest and marker disagree ------------------------------------------------


def test_cp_into_the_directory_of_another_step_is_refused(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [10])
    r = cli("cp", ckpt_dir(root, 10), ckpt_dir(root, 99))
    assert r.exit_code == 1, r.stderr
    assert "step 99" in r.stderr and "step 10" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(os.path.join(ckpt_dir(root, 99), MARKER))
    # the step's own directory, or a root, is fine
    r = cli("cp", ckpt_dir(root, 10), str(tmp_path / "copy"))
    assert r.exit_code == 0 and r.stdout.strip() == os.path.join(str(tmp_path / "copy"), step_dir(10))


def test_a_copy_under_another_steps_name_is_corrupt_everywhere(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [10, 20, 30])
    shutil.copytree(ckpt_dir(root, 10), ckpt_dir(root, 99))  # by hand, around ckptctl

    r = cli("verify", ckpt_dir(root, 99))
    assert r.exit_code == 1 and "manifest says step 10" in r.stdout + r.stderr
    rows = {row["step"]: row for row in cli("ls", root, "--json").json()["checkpoints"]}
    assert rows[99]["status"] == "corrupt" and "must agree" in rows[99]["reason"]
    assert [rows[s]["status"] for s in (10, 20, 30)] == ["committed"] * 3
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(root, 30)
    assert cli("verify", root, "--all").exit_code == 1

    # The anchor is step 30, not the impostor: keep-last 1 keeps 30 and deletes 10 and 20; the
    # broken copy is reported (exit 1) and left for --delete-broken.
    r = cli("prune", root, "--keep-last", "1", "--yes")
    assert r.exit_code == 1, r.stderr
    assert _dirs(root) == [step_dir(30), step_dir(99)]
    assert cli("verify", ckpt_dir(root, 30)).exit_code == 0


@pytest.mark.parametrize("step", [999, -5, 10**30])
def test_a_resealed_manifest_with_another_step_is_corrupt(tmp_path, step):
    root = str(tmp_path)
    make_checkpoints(root, [10, 20])
    _reseal(ckpt_dir(root, 20), step=step)
    with pytest.raises(InvalidCheckpoint, match="step"):
        native_read.read_committed(open_storage(ckpt_dir(root, 20)))
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(root, 10)
    assert cli("verify", ckpt_dir(root, 20)).exit_code == 1


def test_negative_step_is_corrupt_outside_a_step_directory_too(tmp_path):
    make_checkpoints(str(tmp_path / "r"), [3])
    mine = str(tmp_path / "mine")
    shutil.copytree(ckpt_dir(str(tmp_path / "r"), 3), mine)
    assert native_read.read_state(open_storage(mine)).status == "committed"  # any name but a step's
    _reseal(mine, step=-5)
    assert native_read.read_state(open_storage(mine)).status == "corrupt"


def test_marker_step_must_match_the_manifest(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [10, 20])
    path = ckpt_dir(root, 20)
    with open(os.path.join(path, MANIFEST), "rb") as f:
        raw = f.read()
    with open(os.path.join(path, MARKER), "wb") as f:
        f.write(Marker.for_manifest(21, raw).to_json())  # commits the right bytes, wrong step
    state = native_read.read_state(open_storage(path))
    assert state.status == "corrupt" and "marker says step 21" in str(state.error)
    assert cli("latest", root).stdout.strip() == ckpt_dir(root, 10)


# --- the marker is written if absent, never replaced ---------------------------------------


def _manifest_of(path: str) -> Manifest:
    return native_read.read_committed(open_storage(path))[0]


def test_committing_a_step_twice_refuses_and_keeps_the_first_marker(tmp_path):
    root = str(tmp_path)
    (path,) = make_checkpoints(root, [5])
    with open(os.path.join(path, MARKER), "rb") as f:
        first = f.read()
    m = _manifest_of(path)
    again = Manifest.new(5, m.world_size, m.files, m.tensors, m.state, {"bytes": 1.0})
    with pytest.raises(RefusedForSafety, match="another writer committed step 5") as err:
        native_commit.commit(open_storage(path), again)
    assert path in str(err.value)
    with open(os.path.join(path, MARKER), "rb") as f:
        assert f.read() == first
    assert cli("verify", path).exit_code == 0  # the first save is intact


class _LateMarkerDisk(LocalStorage):
    """A disk on which the other writer's marker lands between our look and our write: the
    marker is invisible to ``stat`` (as it was a moment ago), only creation can tell."""

    def stat(self, key: str) -> ObjectInfo | None:
        return None if key == MARKER else super().stat(key)


def test_the_marker_is_created_only_if_absent_even_in_a_race(tmp_path):
    root = str(tmp_path)
    (path,) = make_checkpoints(root, [5])
    with open(os.path.join(path, MARKER), "rb") as f:
        first = f.read()
    m = _manifest_of(path)
    again = Manifest.new(5, m.world_size, m.files, m.tensors, m.state, {"bytes": 1.0})
    with pytest.raises(RefusedForSafety, match="another writer"):
        native_commit.commit(_LateMarkerDisk(path), again)
    with open(os.path.join(path, MARKER), "rb") as f:
        assert f.read() == first


def test_commit_refuses_a_directory_named_for_another_step(tmp_path):
    root = str(tmp_path)
    (path,) = make_checkpoints(root, [5])
    m = _manifest_of(path)
    wrong = open_storage(ckpt_dir(root, 6))
    with pytest.raises(RefusedForSafety, match="step 6"):
        native_commit.commit(wrong, m)
    assert not os.path.exists(ckpt_dir(root, 6))


# --- damaged metadata is corrupt (exit 1), never a storage error (exit 3) --------------------


def test_a_manifest_grown_after_commit_is_corrupt_and_skipped(tmp_path):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    with open(os.path.join(ckpt_dir(root, 2), MANIFEST), "ab") as f:
        f.write(b"\n" * 4096)  # reformatted: still valid JSON, larger than its marker allows
    rows = {r["step"]: r for r in cli("ls", root, "--json").json()["checkpoints"]}
    assert rows[2]["status"] == "corrupt" and rows[1]["status"] == "committed"
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(root, 1), r.stderr
    r = cli("verify", root, "--latest", "--json")
    assert r.exit_code == 1, r.stdout  # the newest fails (issue 30): latest's fallback is named
    assert [c["ok"] for c in r.json()["checkpoints"]] == [False, True]
    r = cli("verify", ckpt_dir(root, 2))
    assert r.exit_code == 1 and "Traceback" not in r.stderr
    r = cli("prune", root, "--keep-last", "1", "--dry-run")
    assert r.exit_code == 1 and "Traceback" not in r.stderr  # the broken newest is reported


@pytest.mark.parametrize("marker", [
    b" " * (2 << 20),  # over 1 MiB
    json.dumps({"format": "ckptctl-commit", "version": 1, "step": 2, "committed": 0.0,
                "manifest": {"size": -1, "checksum": "0", "algorithm": "xxh3-64"}}).encode(),
    json.dumps({"format": "ckptctl-commit", "version": 1, "step": 2, "committed": 0.0,
                "manifest": {"size": 10**30, "checksum": "0", "algorithm": "xxh3-64"}}).encode(),
    b"[" * 5000 + b"]" * 5000,  # nested past the parser's recursion limit
], ids=["huge", "negative-size", "oversized-size", "deep"])
def test_a_garbled_marker_is_corrupt_never_exit_3(tmp_path, marker):
    root = str(tmp_path)
    make_checkpoints(root, [1, 2])
    with open(os.path.join(ckpt_dir(root, 2), MARKER), "wb") as f:
        f.write(marker)
    assert native_read.read_state(open_storage(ckpt_dir(root, 2))).status == "corrupt"
    rows = {r["step"]: r["status"] for r in cli("ls", root, "--json").json()["checkpoints"]}
    assert rows == {1: "committed", 2: "corrupt"}
    r = cli("latest", root)
    assert r.exit_code == 0 and r.stdout.strip() == ckpt_dir(root, 1)
    r = cli("verify", ckpt_dir(root, 2))
    assert r.exit_code == 1 and "Traceback" not in r.stderr


def test_load_latest_falls_back_past_an_impostor(tmp_path):
    from ckptctl import Checkpointer

    import torch

    root = str(tmp_path)
    make_checkpoints(root, [10, 20])
    shutil.copytree(ckpt_dir(root, 10), ckpt_dir(root, 99))
    state = {"model": {f"w{i}": torch.zeros(1000) for i in range(3)}, "extra": {"step": -1}}
    with Checkpointer(root) as ck:
        assert ck.load_latest(state) == 20
    assert state["extra"]["step"] == 20
    assert [e.step for e in catalog.newest_committed(open_storage(root))] == [20, 10]


def test_reshard_and_convert_refuse_the_directory_of_another_step(tmp_path):
    root = str(tmp_path / "root")
    make_checkpoints(root, [10])
    out = str(tmp_path / "out")
    r = cli("reshard", ckpt_dir(root, 10), os.path.join(out, step_dir(99)), "--world-size", "2")
    assert r.exit_code == 1 and "step 99" in r.stderr and "step 10" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(out, step_dir(99), MARKER))
    assert cli("reshard", ckpt_dir(root, 10), os.path.join(out, step_dir(10)), "--world-size", "2").exit_code == 0

    st = str(tmp_path / "model.safetensors")
    assert cli("convert", ckpt_dir(root, 10), st, "--to", "safetensors").exit_code == 0  # records step 10
    r = cli("convert", st, os.path.join(out, step_dir(98)), "--to", "ckptctl")
    assert r.exit_code == 1 and "step 98" in r.stderr and "step 10" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(out, step_dir(98), MARKER))
    r = cli("convert", st, os.path.join(out, "anywhere"), "--to", "ckptctl")
    assert r.exit_code == 0, r.stderr
    # --overwrite does not get around it, and never removes what is there first
    r = cli("convert", st, os.path.join(out, step_dir(10)), "--to", "ckptctl", "--overwrite")
    assert r.exit_code == 0, r.stderr
    r = cli("reshard", os.path.join(out, "anywhere"), os.path.join(out, step_dir(11)), "--world-size", "1")
    assert r.exit_code == 1 and "step 11" in r.stderr
    precious = os.path.join(out, step_dir(12), "precious")
    os.makedirs(os.path.dirname(precious))
    open(precious, "w").close()
    assert cli("convert", st, os.path.dirname(precious), "--to", "ckptctl", "--overwrite").exit_code == 1
    assert cli("reshard", ckpt_dir(root, 10), os.path.dirname(precious), "--world-size", "1", "--overwrite").exit_code == 1
    assert os.path.exists(precious)
