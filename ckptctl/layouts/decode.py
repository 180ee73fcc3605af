"""The ``load`` verification level's test-decode of chunk bytes, which needs torch.

It lives apart from ``shard_scan`` so that the default levels (``quick``, ``checksums``) never
import torch: ``ckptctl verify`` and ``ckptctl latest`` run in shell loops and cron jobs, where
importing torch (seconds) would cost more than the check itself. ``shard_scan`` imports this
module only when the level is ``load``.
"""

from __future__ import annotations

import torch

from ckptctl.format import dtypes


def decode_problem(part: memoryview, dtype: str, offset_in_chunk: int) -> str | None:
    """Decode ``part``, bytes of a chunk of ``dtype`` starting ``offset_in_chunk`` bytes into
    the chunk, as that dtype (only whole elements), without holding the tensor whole. Returns
    what is wrong with the values, or None."""
    want = dtypes.torch_dtype(dtype)
    size = torch.empty((), dtype=want).element_size()
    lead = (-offset_in_chunk) % size
    usable = (len(part) - lead) // size * size
    if usable <= 0:
        return None
    t = torch.frombuffer(part[lead : lead + usable], dtype=want)
    if dtype == "bool" and bool((t.view(torch.uint8) > 1).any()):
        return "bool tensor holds bytes other than 0 and 1"
    return None
