"""The group a verb joins under torchrun waits for the others as long as one rank's share of
the work may take (issue 31): hours for a ``cp`` of terabytes by rank 0, not gloo's 30-minute
default, after which the waiting ranks failed as if a rank had left. Two real processes joined
from torchrun's environment; each reads its group's timeout back from gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

from tier_node_workers import free_port

PROBE = """
import torch, torch.distributed as dist
from ckptctl.ops.torchrun import torchrun_group
with torchrun_group() as rank:
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    print(rank, backend.options._timeout.total_seconds(), flush=True)
"""


def test_a_verbs_group_outwaits_one_ranks_long_share() -> None:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                                   "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for r, out in enumerate(outs):
        rank, seconds = out.split()
        assert int(rank) == r and float(seconds) >= timedelta(hours=12).total_seconds(), out
