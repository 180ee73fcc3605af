"""Save ids: which attempt at a step wrote which file.

Every save attempt has an id of 16 hex digits (``format.layout``): it is recorded in the
manifest, and a shard or manifest whose canonical name another attempt already took is
published under a name carrying it (``rank-00000-of-00004.<id>.safetensors``). Ids of two
attempts never repeat, so neither can take the other's names.

With one process each save draws a fresh random id. With several ranks every rank must use the
same id for one save without a message per save: rank 0 draws a random nonce once, when the
coordinator is created, and every rank derives each save's id from that nonce, the step and
the number of saves this ``Checkpointer`` has started (which every rank counts alike, since
every rank calls ``save`` for every step).
"""

from __future__ import annotations

import hashlib
import secrets

from ckptctl.format.layout import SAVE_ID_HEX, new_save_id

NONCE_BYTES = 16


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


class SaveIds:
    """The ids of one ``Checkpointer``'s saves. ``nonce``: the one every rank shares (see the
    module docstring); None with one process, where every id is drawn at random."""

    def __init__(self, nonce: bytes | None) -> None:
        self._nonce = nonce
        self._count = 0

    def next(self, step: int) -> str:
        self._count += 1
        if self._nonce is None:
            return new_save_id()
        h = hashlib.blake2b(self._nonce, digest_size=SAVE_ID_HEX // 2, person=b"ckptctl-save-id")
        h.update(f"{step}:{self._count}".encode())
        return h.hexdigest()
