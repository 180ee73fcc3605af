"""Each rank's own copy of its small non-model state (data loader position, scheduler, RNG
generators held in state), kept as JSON in the rank's shard header.

Such state may differ between ranks, while the checkpoint's shared copy of it (in the
manifest) is rank 0's. Loading as rank ``r`` prefers rank ``r``'s own copy.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes
from ckptctl.state import tree

log = logging.getLogger("ckptctl")

# The key of a rank's own copy of its state inside the shard header's ``rank_state``.
RANK_STATE_KEY = "state"

# Per-rank copies of small state live in the shard header as JSON; a header is bounded (see
# format.shard.MAX_HEADER_BYTES), so the tensors kept per rank are bounded too.
MAX_PER_RANK_TENSOR_BYTES = 4 << 20


def per_rank_state(values: dict[str, Any]) -> dict[str, Any]:
    """JSON for one rank's own copy of ``values``: the encoded tree, and its tensors inline
    (base64, with dtype and shape) since they are small: loader positions, generator states.

    A key whose tensors are large (over ``MAX_PER_RANK_TENSOR_BYTES``) or sharded (DTensors)
    gets no per-rank copy: it is listed under ``"shared"`` and every rank loads the copy in
    the manifest (rank 0's), with a warning at save time for the large ones."""
    doc: dict[str, Any] = {}
    inline: dict[str, Any] = {}
    shared: list[str] = []
    for key, value in values.items():
        tensors: dict[str, torch.Tensor] = {}
        encoded = tree.encode(value, (key,), tensors.__setitem__)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if total > MAX_PER_RANK_TENSOR_BYTES or any(isinstance(t, DTensor) for t in tensors.values()):
            shared.append(key)
            if total > MAX_PER_RANK_TENSOR_BYTES and key not in _warned_shared:
                _warned_shared.add(key)
                log.warning(
                    "state key %r holds %d bytes of tensors, too much to keep per rank: it is saved once, "
                    "from rank 0, and every rank restores rank 0's copy", key, total,
                )
            continue
        doc[key] = encoded
        inline.update({n: _inline(t) for n, t in tensors.items()})
    return {"tree": doc, "tensors": inline, "shared": shared}


_warned_shared: set[str] = set()


def per_rank_values(doc: Any, where: str = "per-rank state") -> dict[str, Any]:
    """Inverse of ``per_rank_state``: the values keyed by state key. Anything malformed is
    ``InvalidCheckpoint`` naming ``where`` (the file and rank it came from): these bytes are
    the checkpoint's, so an older checkpoint may do."""
    def tensor(name: str) -> torch.Tensor:
        try:
            d = doc["tensors"][name]
            raw = bytearray(base64.b64decode(d["b64"], validate=True))
            dtype = dtypes.torch_dtype(d["dtype"])
            # frombuffer shares ``raw``, which nothing else holds; reshape checks the size.
            return torch.frombuffer(raw, dtype=dtype).reshape(d["shape"]) if raw else torch.empty(d["shape"], dtype=dtype)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:  # RuntimeError: torch's shape check
            raise InvalidCheckpoint(f"{where}: tensor {name!r} is garbled ({type(e).__name__}: {e})",
                                    hint="resume from an older checkpoint") from None

    values = doc.get("tree", {}) if isinstance(doc, dict) else None
    if not isinstance(values, dict) or not isinstance(doc.get("tensors", {}), dict):
        raise InvalidCheckpoint(f"{where}: not a per-rank state document", hint="resume from an older checkpoint")
    tree.check(values, where)
    return {k: tree.decode(v, tensor) for k, v in values.items()}


def _inline(t: torch.Tensor) -> dict[str, Any]:
    c = t.detach().cpu().contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return {"dtype": dtypes.name_of(c.dtype), "shape": list(c.shape), "b64": base64.b64encode(raw).decode()}

