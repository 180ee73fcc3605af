"""Foreign formats stay inside the checkpoint and never hang the tool (issue 11 §3, §5, §8).

Every record path a foreign reader takes from a file (DCP ``.metadata`` storage records, a
Hugging Face index's ``weight_map``) must be one plain file name inside the checkpoint
directory; sizes in DCP metadata must be in range; a FIFO planted as ``.metadata`` is refused
without blocking; ``convert`` refuses aliasing keys and lists what it drops.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import struct
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from ckptctl import Checkpointer
from helpers import cli

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block blocks."""

    def expired(*_: Any) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def dcp_checkpoint(path: str, value: float) -> str:
    os.makedirs(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.full((4, 2), value)}, "step": 3}, checkpoint_id=path, no_dist=True)
    return path


def rewrite_metadata(path: str, change: Any) -> None:
    """Load .metadata (our own test file: plain pickle is fine here), change it, write it back."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    md = change(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def with_record_path(rel: str) -> Any:
    def change(md: Any) -> Any:
        return dataclasses.replace(md, storage_data={
            k: dataclasses.replace(v, relative_path=rel) for k, v in md.storage_data.items()})
    return change


@pytest.mark.parametrize("rel", ["../other_run/__0_0.distcp", "ABS", "sub/__0_0.distcp", ".hidden"])
def test_dcp_records_outside_the_checkpoint_are_refused(tmp_path: Any, rel: str) -> None:
    run = dcp_checkpoint(str(tmp_path / "run"), 1.0)
    other = dcp_checkpoint(str(tmp_path / "other_run"), 2.0)
    if rel == "ABS":
        rel = os.path.join(other, "__0_0.distcp")
    if rel.startswith("sub/"):
        os.makedirs(os.path.join(run, "sub"))
        os.link(os.path.join(run, "__0_0.distcp"), os.path.join(run, rel))
    if rel == ".hidden":
        os.link(os.path.join(run, "__0_0.distcp"), os.path.join(run, rel))
    rewrite_metadata(run, with_record_path(rel))
    r = cli("verify", run)
    assert r.exit_code == 1 and "not a plain file name" in r.stderr + r.stdout, r.stderr + r.stdout
    out = str(tmp_path / "out")
    r = cli("convert", run, out, "--to", "safetensors")
    assert r.exit_code == 1 and "not a plain file name" in r.stderr, r.stderr
    assert not os.path.exists(out) or not os.listdir(out)  # no tensor of another run was copied


@pytest.mark.parametrize("what", ["size 2**70", "negative record offset", "record past the end", "chunk outside",
                                  "negative chunk offset"])
def test_dcp_sizes_out_of_range_are_refused(tmp_path: Any, what: str) -> None:
    run = dcp_checkpoint(str(tmp_path / "run"), 1.0)

    def change(md: Any) -> Any:
        t = md.state_dict_metadata["model.w"]
        if what == "size 2**70":
            t = dataclasses.replace(t, size=(2**70, 2))
        elif what in ("chunk outside", "negative chunk offset"):
            c = t.chunks[0]
            offs = (3, 0) if what == "chunk outside" else (-1, 0)
            t = dataclasses.replace(t, chunks=[dataclasses.replace(c, offsets=offs)])
        storage = dict(md.storage_data)
        if what in ("negative record offset", "record past the end"):
            k = next(iter(storage))
            storage[k] = dataclasses.replace(storage[k], offset=-8 if what.startswith("negative") else 1 << 40)
        return dataclasses.replace(md, state_dict_metadata={**md.state_dict_metadata, "model.w": t}, storage_data=storage)

    rewrite_metadata(run, change)
    r = cli("verify", run)
    assert r.exit_code == 1 and "Traceback" not in r.stderr, r.stderr + r.stdout
    r = cli("convert", run, str(tmp_path / "out"), "--to", "safetensors")
    assert r.exit_code == 1 and ".metadata" in r.stderr, r.stderr


def test_dcp_metadata_fifo_never_blocks(tmp_path: Any) -> None:
    run = dcp_checkpoint(str(tmp_path / "run"), 1.0)
    os.unlink(os.path.join(run, ".metadata"))
    os.mkfifo(os.path.join(run, ".metadata"))
    with deadline(60):
        for args in (["verify", run], ["inspect", run], ["convert", run, str(tmp_path / "out"), "--to", "safetensors"]):
            r = cli(*args)
            assert r.exit_code == 1 and "not a regular file" in r.stderr + r.stdout, (args, r.stderr, r.stdout)


def test_dcp_distcp_fifo_never_blocks(tmp_path: Any) -> None:
    run = dcp_checkpoint(str(tmp_path / "run"), 1.0)
    os.unlink(os.path.join(run, "__0_0.distcp"))
    os.mkfifo(os.path.join(run, "__0_0.distcp"))
    with deadline(60):
        r = cli("verify", run)
        assert r.exit_code == 1 and "not a regular file" in r.stderr + r.stdout, r.stderr + r.stdout


def safetensors_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)


@pytest.mark.parametrize("name", ["../other/model.safetensors", "/etc/passwd", "sub/model.safetensors", "", 7])
def test_hf_index_names_outside_the_directory_are_refused(tmp_path: Any, name: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    safetensors_file(str(run / "model-00001-of-00002.safetensors"), {"a": torch.ones(2)})
    (run / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": name}}))
    r = cli("verify", str(run))
    assert r.exit_code == 1 and "'b'" in r.stderr + r.stdout, r.stderr + r.stdout
    r = cli("convert", str(run), str(tmp_path / "out"), "--to", "ckptctl")
    assert r.exit_code == 1 and "'b'" in r.stderr, r.stderr


def test_torch_file_with_aliasing_keys_is_refused_naming_the_key(tmp_path: Any) -> None:
    src = str(tmp_path / "s.pt")
    torch.save({"s": {1: torch.zeros(2), "1": torch.ones(2)}}, src)
    r = cli("convert", src, str(tmp_path / "out.safetensors"), "--to", "safetensors")
    assert r.exit_code != 0 and "'s/1'" in r.stderr, r.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_renamed_tensor_in_a_safetensors_source_is_listed_as_dropped(tmp_path: Any) -> None:
    root = str(tmp_path / "root")
    with Checkpointer(root) as ckpt:
        path = ckpt.save(1, {"model": {"w0": torch.ones(2), "w1": torch.zeros(3)}, "extra": {"lr": 0.1}}).wait()
    st = str(tmp_path / "m.safetensors")
    assert cli("convert", path, st, "--to", "safetensors").exit_code == 0
    raw = bytearray(open(st, "rb").read())
    (n,) = struct.unpack("<Q", raw[:8])
    header = bytes(raw[8 : 8 + n])
    assert b'"model/w0":{' in header
    raw[8 : 8 + n] = header.replace(b'"model/w0":{', b'"model/x0":{')  # same length: offsets unchanged
    open(st, "wb").write(bytes(raw))
    r = cli("convert", st, str(tmp_path / "back"), "--to", "ckptctl", "--json")
    assert r.exit_code == 0, r.stderr
    report = r.json()
    assert any("'model/w0'" in d and "'model/x0'" in d for d in report["dropped"]), report["dropped"]
    r = cli("inspect", str(tmp_path / "back"), "--tensors", "--json")
    names = {t["name"] for t in r.json()["tensors"]}
    assert "model/x0" in names and "model/w1" in names  # every tensor kept, under its own name
