"""The per-rank numbers a multi-rank save exchanges for issue 14: placement columns (summed
over ranks into the manifest's placement hints) and replica digests."""

from __future__ import annotations

import torch

from ckptctl.save.replicas import combined, replica_digests, tensor_digest
from ckptctl.save.shard_layout import make_layout, placement_columns, placement_hints
from ckptctl.state.placement import LOCAL, RANK0, REPLICATED, SavedTensor


def _shard0(rank: int, world: int, rows: int = 10, cols: int = 3) -> SavedTensor:
    block = -(-rows // world)
    lo, hi = min(rank * block, rows), min((rank + 1) * block, rows)
    return SavedTensor(torch.zeros(hi - lo, cols), "model", (rows, cols), (lo, 0), LOCAL)


def test_regular_shard0_chunks_prove_the_split_and_whole_ones_name_their_owner():
    world = 4  # 10 rows: blocks of 3, 3, 3, 1
    cols = [placement_columns(_shard0(r, world), r, world) for r in range(world)]
    assert cols == [(1, 0)] * world
    assert placement_hints((10, 3), 4, sum(c[0] for c in cols), 0, world) == (None, (0, 3))
    whole = SavedTensor(torch.zeros(5), "model", (5,), (0,), REPLICATED)
    assert placement_columns(whole, 2, world) == (0, 3)
    assert placement_hints((5,), 1, 0, 3, world) == (2, None)


def test_irregular_chunks_get_no_hint():
    # 10 rows split 4/6 on 2 ranks is not torch.chunk's 5/5: no split may be claimed.
    t = SavedTensor(torch.zeros(6, 3), "model", (10, 3), (4, 0), LOCAL)
    assert placement_columns(t, 1, 2) == (0, 0)
    assert placement_hints((10, 3), 2, 1, 0, 2) == (None, None)
    # A column split (tensor parallel) is never dim 0's block either.
    col = SavedTensor(torch.zeros(10, 2), "model", (10, 4), (0, 2), LOCAL)
    assert placement_columns(col, 1, 2) == (0, 0)


def test_layout_coverage_carries_the_placement_columns():
    tensors = {"w": _shard0(1, 2), "b": SavedTensor(torch.zeros(3), "model", (3,), (0,), REPLICATED)}
    layout = make_layout(tensors, rank=1, world_size=2)
    by_name = dict(zip((m.name for m in layout.table), layout.coverage))
    assert by_name["w"] == (1, 15, 1, 0)
    assert by_name["b"] in ((0, 0, 0, 0), (1, 3, 0, 2))  # written here or by rank 0


def test_replica_digests_by_mode():
    a = {"model/w": SavedTensor(torch.arange(6.0), "model", (6,), (0,), REPLICATED),
         "extra/t": SavedTensor(torch.ones(2), "other", (2,), (0,), REPLICATED),
         "extra/r0": SavedTensor(torch.ones(2), "other", (2,), (0,), RANK0)}
    layout = make_layout(a, rank=0, world_size=2)
    names = [m.name for m in layout.table]
    default = dict(zip(names, replica_digests(layout, a, None)))
    assert default["model/w"] == tensor_digest(torch.arange(6.0)) != 0
    assert default["extra/t"] == 0 and default["extra/r0"] == 0  # other keys: only with True
    assert dict(zip(names, replica_digests(layout, a, True)))["extra/t"] != 0
    assert replica_digests(layout, a, False) == [0, 0, 0] and combined([0, 0, 0]) == ""
    b = dict(a, **{"model/w": SavedTensor(torch.arange(6.0) + 1, "model", (6,), (0,), REPLICATED)})
    assert combined(replica_digests(layout, a, None)) != combined(replica_digests(layout, b, None))
    # Strided copies hash as their values in row-major order.
    m = torch.arange(12.0).reshape(3, 4)
    assert tensor_digest(m.t()) == tensor_digest(m.t().contiguous())
