"""GPU tensors start at aligned offsets of the host staging buffer; the shard on disk stays packed.

The layout decides where each tensor's bytes go: packed in the file (safetensors entries tile
the data section), at a multiple of ``STAGING_ALIGN`` in the host buffer when the tensor comes
from an accelerator (the copy engine's destination). Here the accelerator tensors are
``meta`` twins of CPU tensors (the layout reads only dtype, shape and device), the snapshot
copies the CPU tensors into the real buffer, and the real writer writes a real shard that
safetensors and our own parser read back.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ckptctl.format.checksum import digest
from ckptctl.format.shard import parse_header
from ckptctl.save.shard_layout import file_pieces, make_layout, view
from ckptctl.save.shard_writer import write_shard
from ckptctl.save.staging import StagingBuffer
from ckptctl.state.placement import SavedTensor
from ckptctl.storage import open_storage


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {  # odd sizes: packed offsets land anywhere
        "a.f32": torch.randn(1001, generator=g),
        "b.bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "c.i64": torch.arange(17),
        "d.u8": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g),
        "e.f16": torch.randn(3, generator=g).half(),
        "f.empty": torch.empty(0, 5),
        "g.scalar": torch.tensor(2.5),
        "h.cpu": torch.arange(13, dtype=torch.int32),  # stays on the host in the layout below
    }


def _saved(tensors: dict[str, torch.Tensor], on_device: bool) -> dict[str, SavedTensor]:
    out = {}
    for n, t in tensors.items():
        data = t.to("meta") if on_device and n != "h.cpu" else t
        out[n] = SavedTensor(data, "model", tuple(t.shape), (0,) * t.dim())
    return out


@pytest.mark.parametrize("align", [512, 4096])
def test_accelerator_slots_start_aligned_in_the_buffer_and_packed_in_the_file(align):
    state = _state()
    layout = make_layout(_saved(state, on_device=True), align=align)
    pos = 0
    for s in layout.slots:  # the file: packed, in order, exactly as before
        assert s.begin == pos
        pos = s.end
    assert layout.nbytes == pos == sum(t.numel() * t.element_size() for t in state.values())
    for s in layout.slots:
        if s.name != "h.cpu":
            assert s.staged % align == 0, (s.name, s.staged)
        assert s.staged % torch.empty(0, dtype=state[s.name].dtype).element_size() == 0
    spans = sorted((s.staged, s.staged + s.end - s.begin) for s in layout.slots if s.end > s.begin)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two slots overlap in the buffer
    assert layout.buffer_nbytes >= max(e for _, e in spans)

    cpu_only = make_layout(_saved(state, on_device=False), align=align)
    assert all(s.host is None for s in cpu_only.slots) and cpu_only.buffer_nbytes == cpu_only.nbytes
    with pytest.raises(ValueError, match="power of two"):
        make_layout(_saved(state, on_device=True), align=768)


def test_a_shard_staged_with_padding_is_written_packed_and_reads_back_bitwise(tmp_path):
    state = _state()
    layout = make_layout(_saved(state, on_device=True), align=4096)
    assert layout.buffer_nbytes > layout.nbytes  # padding exists
    tensors = _saved(state, on_device=False)  # the bytes the copies deliver
    staging = StagingBuffer()
    buf = staging.snapshot(layout, tensors)
    for s in layout.slots:
        assert torch.equal(view(buf, s), state[s.name])
    storage = open_storage(str(tmp_path))
    report = write_shard(storage, "rank-0.safetensors", layout, buf, rank=0, rank_state={})
    staging.release()
    raw = (tmp_path / "rank-0.safetensors").read_bytes()
    assert report.file.size == len(raw)
    header = parse_header(raw, len(raw), "rank-0")  # tiles the data section: no padding on disk
    assert len(raw) - header.data_start == layout.nbytes
    for c in header.chunks:
        data = raw[header.data_start + c.begin : header.data_start + c.end]
        assert c.checksum == digest(data), c.name
    with safe_open(str(tmp_path / "rank-0.safetensors"), framework="pt") as f:
        for n, t in state.items():
            assert torch.equal(f.get_tensor(n), t), n
    meta = json.loads(raw[8 : header.data_start])["__metadata__"]
    assert "ckptctl" in meta


@pytest.mark.parametrize("piece", [1, 7, 512, 4096, 1 << 20])
def test_file_pieces_give_the_packed_bytes_in_file_order(piece):
    state = _state()
    layout = make_layout(_saved(state, on_device=True), align=512)
    buf = torch.full((layout.buffer_nbytes,), 0xEE, dtype=torch.uint8)  # padding: never in the file
    packed = bytearray(layout.nbytes)
    for s in layout.slots:
        b = state[s.name].contiguous().reshape(-1).view(torch.uint8)
        buf[s.staged : s.staged + s.end - s.begin] = b
        packed[s.begin : s.end] = bytes(b.numpy())
    data = memoryview(buf.numpy()).cast("B")
    out, expect = bytearray(), 0
    for pos, p in file_pieces(data, layout, piece):
        assert pos == expect and 0 < len(p) <= piece
        out += bytes(p)  # valid until the next piece: consumed now
        expect += len(p)
    assert bytes(out) == bytes(packed)


def test_large_tensors_go_out_as_views_and_small_ones_gathered_into_few_pieces():
    big = {"big": torch.randn(1 << 18)}  # 1 MiB
    small = {f"s{i:03d}": torch.randn(10 + i) for i in range(200)}  # 200 small tensors, padded apart
    state = {**big, **small}
    layout = make_layout(_saved_all(state), align=512)
    buf = torch.zeros(layout.buffer_nbytes, dtype=torch.uint8)
    for s in layout.slots:
        buf[s.staged : s.staged + s.end - s.begin] = state[s.name].reshape(-1).view(torch.uint8)
    data = memoryview(buf.numpy()).cast("B")
    big_slot = next(s for s in layout.slots if s.name == "big")
    pieces = [(pos, p, isinstance(p.obj, bytearray)) for pos, p in file_pieces(data, layout, 64 << 10)]
    over_big = [g for pos, p, g in pieces if big_slot.begin <= pos < big_slot.end]
    assert over_big and not any(over_big)  # views of the staging buffer: no copy
    assert len(pieces) - len(over_big) <= 3  # 200 small tensors, a few writes


def _saved_all(tensors: dict[str, torch.Tensor]) -> dict[str, SavedTensor]:
    return {n: SavedTensor(t.to("meta"), "model", tuple(t.shape), (0,) * t.dim()) for n, t in tensors.items()}
