"""``ls``: every checkpoint under a root with its step, status, size and age.

Status comes from marker and manifest only (cheap): ``committed``, ``partial`` (no marker:
being written, or abandoned), ``corrupt`` (a marker that does not match its manifest), or
``link`` (a symlink, which ckptctl never follows). ``verify`` finds the rest.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from ckptctl.format.checkpoint import list_steps, read_committed, status_of, total_size
from ckptctl.errors import CkptError
from ckptctl.storage.base import Storage


@dataclass(frozen=True)
class Listed:
    step: int
    name: str
    url: str
    status: str
    size: int
    created: float  # manifest time when committed, else newest modification inside
    age_s: float
    reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def list_checkpoints(root: Storage, *, now: float | None = None) -> list[Listed]:
    now = time.time() if now is None else now
    out = []
    for e in list_steps(root):
        if e.kind == "link":
            out.append(Listed(e.step, e.name, root.url_of(e.name), "link", 0, 0.0, 0.0, "symlink, not followed"))
            continue
        ckpt = root.sub(e.name)
        status, reason = status_of(ckpt)
        size, newest = total_size(ckpt)
        created = newest
        if status == "committed":
            try:
                created = read_committed(ckpt)[0].created
            except CkptError as err:  # changed between the two reads
                status, reason = "corrupt", str(err)
        out.append(Listed(e.step, e.name, ckpt.url, status, size, created, max(0.0, now - created), reason))
    return out
