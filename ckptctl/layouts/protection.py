"""What a root's pointers protect: the entries no deletion may touch, whatever a policy says.

Each layout names its own (``Layout.protected``): DeepSpeed's ``latest`` and Megatron's
tracker name the checkpoint their resume loads, the Trainer's ``best_model_checkpoint`` and
every Lightning ``ModelCheckpoint``'s ``best_model_path`` the checkpoint their rotation keeps.
A pointer that cannot be read safely enough to decide protects every entry it might name,
never none (the layout says so in the reason).

A protected entry may be a symlink (a step directory kept on another volume): the link is
kept, since removing it leaves the pointer naming nothing and the resume broken, and when
the link points at another entry of the same root, that entry is kept too. ``prune`` and
``rm`` both ask here, so the two verbs agree on what is protected.
"""

from __future__ import annotations

import os
from typing import Iterable

from ckptctl.layouts.base import UNKNOWN
from ckptctl.layouts.registry import layout_named
from ckptctl.storage.base import Storage

LINK_KEPT = "a symlink: neither it nor its target is touched"


def protected(root: Storage, entries: Iterable[tuple[str, str, str]]) -> dict[str, str]:
    """The names among ``entries`` ((layout, name, status) of every entry under ``root``, as
    the catalog or prune's plan has them: committed, broken, partial, link...) that must be
    kept, each with why."""
    entries = list(entries)
    out: dict[str, str] = {}
    for name in sorted({layout for layout, _n, _s in entries} - {UNKNOWN}):
        try:
            layout = layout_named(name, root)
        except KeyError:
            continue
        own = [(n, s) for lay, n, s in entries if lay == name]
        for target, why in layout.protected(own).items():
            out.setdefault(target, why)
    links = {n for _l, n, s in entries if s == "link"}
    names = {n for _l, n, _s in entries}
    for link in sorted(links & set(out)):
        out[link] = f"{out[link]}; {LINK_KEPT}"
        target = _link_target(root, link)
        if target is not None and target in names and target not in out:
            out[target] = f"the target of the symlink {link}, which is protected ({out[link]})"
    return out


def _link_target(root: Storage, name: str) -> str | None:
    """The name of the root's entry the symlink ``name`` resolves to, or None when it points
    anywhere else (or the root is not local). Only read, never followed for a write."""
    path = root.local_path()
    if path is None:
        return None
    try:
        base = os.path.realpath(path)
        target = os.path.realpath(os.path.join(path, name))
    except (OSError, ValueError):  # a link loop, a name the platform cannot take
        return None
    return os.path.basename(target) if os.path.dirname(target) == base else None
