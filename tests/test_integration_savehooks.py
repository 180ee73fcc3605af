"""``ckptctl.integrations.savehooks``: the files ``torch.save`` and safetensors' ``save_file``
write inside ``recording()`` are hashed once closed, on that thread only, for that block only,
and an entry is given only for a file still exactly as it was hashed (real torch, real
safetensors, real files)."""

from __future__ import annotations

import threading

import pytest
import safetensors.torch
import torch

from ckptctl.format.seal import CHUNK_SIZE
from ckptctl.integrations.savehooks import recording
from ckptctl.layouts.seal_check import hash_object
from ckptctl.storage import open_storage


def _read_back(path) -> tuple[int, str, tuple[str, ...]]:  # type: ignore[no-untyped-def]
    got = hash_object(open_storage(str(path.parent)), path.name, CHUNK_SIZE)
    assert got is not None
    return got.size, got.xxh3, got.chunks


def test_files_saved_inside_the_block_have_the_entries_of_their_bytes_on_disk(tmp_path) -> None:
    state = {"w": torch.randn(64, 64), "b": torch.zeros(0), "h": torch.ones(3, dtype=torch.bfloat16)}
    with recording() as written:
        torch.save(state, tmp_path / "a.pt")  # a PathLike
        safetensors.torch.save_file(state, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    for name in ("a.pt", "m.safetensors"):
        entry = written.entry(str(tmp_path / name), CHUNK_SIZE)
        assert entry is not None and (entry.size, entry.xxh3, entry.chunks) == _read_back(tmp_path / name)
    assert written.entry(str(tmp_path / "a.pt"), 1 << 20) is None  # a seal of other chunks: read it again


def test_a_file_changed_or_replaced_after_its_save_gets_no_entry(tmp_path) -> None:
    with recording() as written:
        torch.save({"w": torch.randn(8)}, tmp_path / "changed.pt")
        torch.save({"w": torch.randn(8)}, tmp_path / "replaced.pt")
        torch.save({"w": torch.randn(8)}, tmp_path / "kept.pt")
    written.wait()
    with open(tmp_path / "changed.pt", "r+b") as f:  # same size, other bytes
        f.seek(100)
        f.write(b"\xff")
    torch.save({"w": torch.randn(8)}, tmp_path / "new.pt")
    (tmp_path / "new.pt").replace(tmp_path / "replaced.pt")
    assert written.entry(str(tmp_path / "changed.pt"), CHUNK_SIZE) is None
    assert written.entry(str(tmp_path / "replaced.pt"), CHUNK_SIZE) is None
    assert written.entry(str(tmp_path / "kept.pt"), CHUNK_SIZE) is not None


def test_only_this_thread_and_this_block_and_the_originals_are_back_even_after_an_error(tmp_path) -> None:
    save, save_file = torch.save, safetensors.torch.save_file
    outside = threading.Thread(target=lambda: torch.save({"w": torch.ones(2)}, tmp_path / "other-thread.pt"))
    with pytest.raises(RuntimeError, match="the save failed"):
        with recording() as written:
            assert torch.save is not save and safetensors.torch.save_file is not save_file
            outside.start()
            outside.join()
            torch.save({"w": torch.ones(2)}, tmp_path / "inside.pt")
            raise RuntimeError("the save failed")
    assert torch.save is save and safetensors.torch.save_file is save_file
    torch.save({"w": torch.ones(2)}, tmp_path / "after.pt")
    assert written.entry(str(tmp_path / "inside.pt"), CHUNK_SIZE) is not None
    assert written.entry(str(tmp_path / "other-thread.pt"), CHUNK_SIZE) is None
    assert written.entry(str(tmp_path / "after.pt"), CHUNK_SIZE) is None
