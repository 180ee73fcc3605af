"""``layouts.classify``: the one answer to "what is at this path?" (issue 19), on a local
filesystem and on S3 (moto server), for every answer it gives and the hostile cases: a
symlink, an empty directory, a file named like a checkpoint, a root holding ckptctl's and
other stacks' checkpoints together. Checkpoints are written by the real writers (ckptctl's
Checkpointer, DCP, the Trainer's file set as tests/test_layouts.py builds it).

Also the behaviour the classifier made consistent: a DCP directory named alone is the DCP
layout's checkpoint and is verified by that layout's check, exactly as under a root (before,
named alone it went to the file-format reader, a different engine with other checks).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil

import torch

from ckptctl.layouts.catalog import list_checkpoints
from ckptctl.layouts.classify import MISSING, NO_FORMAT_DIR, NO_FORMAT_FILE, classify
from helpers import cli, make_checkpoints
from test_layouts import dcp_step, hf_checkpoint
from test_s3_layouts import Bucket


def _lightning_like(path: str) -> None:
    torch.save({"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{}], "global_step": 5}, path)


# --- local ------------------------------------------------------------------------------------


def test_a_root_and_its_checkpoints_of_every_kind(tmp_path):
    root = str(tmp_path / "root")
    native = make_checkpoints(root, [1, 2], size=64, tensors=2)
    dcp = dcp_step(root, 10)
    hf = hf_checkpoint(root, 20)
    found = classify(root)
    assert found.what == "root" and found.entries == 4 and found.description is None
    assert sorted({e.layout for e in list_checkpoints(found.storage)}) == ["ckptctl", "dcp", "hf-trainer"]
    one = classify(native[0])
    assert one.what == "checkpoint" and one.in_layout.name == "ckptctl" and one.by_name and one.step == 1
    assert one.description == "a ckptctl checkpoint" and one.storage.url == native[0]
    d = classify(dcp)
    assert (d.what, d.in_layout.name, d.step, d.by_name) == ("checkpoint", "dcp", 10, True)
    h = classify(hf)
    assert (h.in_layout.name, h.step, h.file_format()) == ("hf-trainer", 20, "safetensors")


def test_checkpoints_named_alone_are_their_layouts_by_their_files(tmp_path):
    root = str(tmp_path / "root")
    native = make_checkpoints(root, [3], size=64, tensors=2)[0]
    copied = str(tmp_path / "my-copy")
    shutil.copytree(native, copied)
    found = classify(copied)
    assert found.what == "checkpoint" and found.in_layout.name == "ckptctl" and not found.by_name and found.step is None
    export = str(tmp_path / "export")
    shutil.copytree(dcp_step(root, 10), export)
    d = classify(export)
    assert (d.what, d.in_layout.name, d.by_name, d.step) == ("checkpoint", "dcp", False, None)
    assert d.description == "a dcp checkpoint" and d.file_format() == "dcp"
    os.unlink(os.path.join(export, ".metadata"))  # a save killed before DCP's last rename: still DCP's
    assert classify(export).in_layout.name == "dcp"


def test_single_files_of_known_formats(tmp_path):
    from safetensors.torch import save_file

    st, pt = str(tmp_path / "w.safetensors"), str(tmp_path / "w.pt")
    save_file({"w": torch.ones(2)}, st)
    torch.save({"w": torch.ones(2)}, pt)
    assert (classify(st).what, classify(st).format) == ("file", "safetensors")
    assert (classify(pt).what, classify(pt).format) == ("file", "torch")
    assert classify(pt).description is None  # a single file: no layout's checkpoint
    hf_export = str(tmp_path / "hf")
    os.makedirs(hf_export)
    save_file({"w": torch.ones(2)}, os.path.join(hf_export, "model.safetensors"))
    found = classify(hf_export)
    assert (found.what, found.format, found.description) == ("file", "safetensors", "a safetensors checkpoint")


def test_nothing_and_why(tmp_path):
    gone = classify(str(tmp_path / "nope"))
    assert gone.what == "nothing" and gone.missing and gone.reason == MISSING
    (tmp_path / "notes.txt").write_text("hello")
    f = classify(str(tmp_path / "notes.txt"))
    assert (f.what, f.missing, f.reason) == ("nothing", False, NO_FORMAT_FILE)
    (tmp_path / "empty").mkdir()
    e = classify(str(tmp_path / "empty"))
    assert (e.what, e.reason) == ("nothing", NO_FORMAT_DIR)
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "a.json").write_text("{}")
    assert classify(str(tmp_path / "misc")).reason == NO_FORMAT_DIR
    r = cli("verify", str(tmp_path / "misc"))
    assert r.exit_code == 1 and f"not a checkpoint: {tmp_path / 'misc'} ({NO_FORMAT_DIR})" in r.stderr, r.stderr


def test_hostile_symlinks_are_never_checkpoints_by_name(tmp_path):
    root = str(tmp_path / "root")
    target = make_checkpoints(root, [4], size=64, tensors=2)[0]
    # A link named like a step directory: never that step by its name (the catalog never
    # follows one either); its target's files still say what the user pointed at.
    link = str(tmp_path / "elsewhere" / "step-0000000009")
    os.makedirs(os.path.dirname(link))
    os.symlink(target, link)
    found = classify(link)
    assert found.what == "checkpoint" and not found.by_name and found.step is None
    # A link to a directory of nothing: nothing, even under a checkpoint's name.
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    os.symlink(str(tmp_path / "junk"), str(tmp_path / "elsewhere" / "step-0000000010"))
    assert classify(str(tmp_path / "elsewhere" / "step-0000000010")).what == "nothing"
    # A dangling link: there, but nothing behind it.
    os.symlink(str(tmp_path / "gone"), str(tmp_path / "dangling"))
    assert classify(str(tmp_path / "dangling")).what == "nothing"
    assert cli("verify", str(tmp_path / "dangling")).exit_code == 1


def test_hostile_empty_and_checkpoint_like_names(tmp_path):
    root = tmp_path / "root"
    (root / "step-0000000005").mkdir(parents=True)  # a save that made its directory and died
    found = classify(str(root / "step-0000000005"))
    assert found.what == "checkpoint" and found.empty and found.description == "an empty ckptctl checkpoint directory"
    r = cli("verify", str(root / "step-0000000005"))
    assert r.exit_code == 1 and "COMMITTED" in r.stderr + r.stdout
    # A regular file under a step directory's name: no layout takes a file there.
    (tmp_path / "step-0000000006").write_text("not a directory")
    assert classify(str(tmp_path / "step-0000000006")).reason == NO_FORMAT_FILE
    # A file named like a Lightning checkpoint holding garbage: Lightning's, as the catalog lists
    # it (partial by its rule), and verify says so, never "not a checkpoint" nor a crash.
    bad = tmp_path / "epoch=0-step=7.ckpt"
    bad.write_bytes(b"\0" * 100)
    f = classify(str(bad))
    assert (f.what, f.in_layout.name, f.step, f.description) == ("checkpoint", "lightning", 7, "a lightning checkpoint file")
    r = cli("verify", str(bad))
    assert r.exit_code == 1 and "torch.save archive" in r.stdout + r.stderr
    good = tmp_path / "epoch=0-step=8.ckpt"
    _lightning_like(str(good))
    assert classify(str(good)).in_layout.name == "lightning"
    # A directory named like a safetensors file holds nothing of one.
    (tmp_path / "x.safetensors").mkdir()
    assert classify(str(tmp_path / "x.safetensors")).reason == NO_FORMAT_DIR


# --- a DCP directory: one engine, named alone or under a root ----------------------------------


def _verify(path: str) -> dict:
    r = cli("verify", path, "--json")
    doc = r.json()
    doc["exit"] = r.exit_code
    return doc


def _same_view(doc: dict) -> tuple:
    (c,) = doc["checkpoints"]
    return doc["exit"], doc["ok"], c["note"], sorted((p["message"], p.get("file")) for p in c["problems"])


def test_a_dcp_directory_named_alone_is_verified_as_under_a_root(tmp_path):
    root = str(tmp_path / "checkpoint")
    under = dcp_step(root, 10)
    alone = str(tmp_path / "exported")
    shutil.copytree(under, alone)
    a, b = _verify(under), _verify(alone)
    assert a["exit"] == 0 and _same_view(a) == _same_view(b)
    assert b["checkpoints"][0]["note"].startswith("dcp checkpoint")  # the layout's report, not the file reader's
    # A chunk lost from .metadata (a gap in the tensor): the layout's check finds it both ways.
    for path in (under, alone):
        meta = os.path.join(path, ".metadata")
        with open(meta, "rb") as f:
            md = pickle.load(f)  # our own test file
        t = md.state_dict_metadata["model.w"]
        c = t.chunks[0]
        t = dataclasses.replace(t, chunks=[dataclasses.replace(c, sizes=torch.Size([32]))])
        md = dataclasses.replace(md, state_dict_metadata={**md.state_dict_metadata, "model.w": t})
        with open(meta, "wb") as f:
            pickle.dump(md, f)
    a, b = _verify(under), _verify(alone)
    assert a["exit"] == 1 and _same_view(a) == _same_view(b)
    assert "chunks cover 32 of 64 elements" in json.dumps(a["checkpoints"][0]["problems"])
    # verify ROOT --all judges it the same way too.
    r = cli("verify", root, "--all", "--json")
    assert r.exit_code == 1 and "chunks cover 32 of 64" in r.stdout


def test_other_verbs_on_a_dcp_directory_named_alone(tmp_path):
    alone = str(tmp_path / "exported")
    shutil.copytree(dcp_step(str(tmp_path / "checkpoint"), 10), alone)
    doc = cli("inspect", alone, "--json").json()
    # The DCP layout tells resumable from export named alone too (train_state is saved).
    assert doc["format"] == "dcp" and doc["content"] == "resumable", doc
    for verb, args in (("reshard", ["-w", "2"]), ("cp", [])):
        r = cli(verb, alone, str(tmp_path / f"out-{verb}"), *args)
        assert r.exit_code == 1 and f"is a dcp checkpoint; {verb} takes ckptctl checkpoints only" in r.stderr, r.stderr
        assert not os.path.exists(tmp_path / f"out-{verb}")
    r = cli("ls", alone)
    assert r.exit_code == 2 and "is a dcp checkpoint, not a root of checkpoints" in r.stderr, r.stderr


# --- S3 -----------------------------------------------------------------------------------------


def test_every_answer_on_s3(tmp_path, s3_url, s3_server):
    from safetensors.torch import save_file

    bucket = Bucket(s3_server, s3_url)
    make_checkpoints(s3_url, [1, 2], size=64, tensors=2)  # ckptctl's own, written there
    local = str(tmp_path / "local")
    dcp_step(local, 10)
    hf_checkpoint(local, 20)
    bucket.upload(local)
    found = classify(s3_url)
    assert found.what == "root" and found.entries == 4
    assert sorted({e.layout for e in list_checkpoints(found.storage)}) == ["ckptctl", "dcp", "hf-trainer"]
    one = classify(f"{s3_url}/step-0000000001")
    assert one.what == "checkpoint" and one.in_layout.name == "ckptctl" and one.step == 1 and one.local is None
    d = classify(f"{s3_url}/step-10")
    assert (d.in_layout.name, d.step, d.by_name) == ("dcp", 10, True)
    h = classify(f"{s3_url}/checkpoint-20")
    assert (h.in_layout.name, h.step) == ("hf-trainer", 20)
    # A DCP directory named alone on S3: the DCP layout's, verified through Storage.
    other = Bucket(s3_server, f"{s3_url}-alone")
    for rel in sorted(bucket.names()):
        if rel.startswith("step-10/"):
            other.put("exported/" + rel.split("/", 1)[1], bucket.get(rel) or b"")
    alone = f"{s3_url}-alone/exported"
    a = classify(alone)
    assert (a.what, a.in_layout.name, a.by_name, a.step) == ("checkpoint", "dcp", False, None)
    r = cli("verify", alone, "--json")
    assert r.exit_code == 0 and r.json()["checkpoints"][0]["note"].startswith("dcp checkpoint"), r.stdout + r.stderr
    # inspect reads other tools' tensors through local readers: said so (before, "no COMMITTED marker").
    r = cli("inspect", f"{s3_url}/checkpoint-20")
    assert r.exit_code == 2 and "on object storage; inspect reads it from a local path only" in r.stderr, r.stderr
    # Files of known formats: told by name; their readers take local paths, and say so.
    save_file({"w": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    bucket.put("files/w.safetensors", (tmp_path / "w.safetensors").read_bytes())
    bucket.put("files/notes.txt", b"hello")
    f = classify(f"{s3_url}/files/w.safetensors")
    assert (f.what, f.format) == ("file", "safetensors")
    r = cli("verify", f"{s3_url}/files/w.safetensors")
    assert r.exit_code == 2 and "on object storage" in r.stderr, r.stderr
    n = classify(f"{s3_url}/files/notes.txt")
    assert (n.what, n.missing, n.reason) == ("nothing", False, NO_FORMAT_FILE)
    g = classify(f"{s3_url}/nothing-here")
    assert g.what == "nothing" and g.missing
    assert cli("verify", f"{s3_url}/nothing-here").exit_code == 2
    assert (classify(f"{s3_url}/files").what, classify(f"{s3_url}/files").format) == ("file", "safetensors")
    bucket.put("misc/notes.txt", b"hello")
    assert classify(f"{s3_url}/misc").reason == NO_FORMAT_DIR
    r = cli("inspect", f"{s3_url}/misc")
    assert r.exit_code == 1 and "not a checkpoint" in r.stderr, r.stderr
