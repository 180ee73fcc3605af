"""Reading through the links of a Hugging Face hub cache snapshot.

``huggingface_hub`` stores each file once, under ``<repo cache>/blobs/<hash>``, and makes the
revision's tree out of relative links: ``<repo cache>/snapshots/<revision>/model.safetensors ->
../../blobs/<hash>`` (``huggingface_hub/file_download.py``, ``_create_symlink``). The repo cache
(``models--org--name``) is the directory that holds both ``snapshots/`` and ``blobs/``.

ckptctl never follows a link inside a checkpoint (``storage.local``): a planted link could read
another job's files. A snapshot is nothing but links, so the safetensors reader makes one
exception, and only this one: a link in a snapshot directory is followed when its target,
fully resolved, stays inside the repo cache. A link that leaves it (``/etc/passwd``, another
cache) is refused with ``InvalidCheckpoint`` naming the link; a link anywhere else is refused
as before.
"""

from __future__ import annotations

import os

from ckptctl.errors import InvalidCheckpoint

SNAPSHOTS = "snapshots"
BLOBS = "blobs"


def cache_root(directory: str) -> str | None:
    """The repo cache holding ``directory`` (a snapshot or a folder inside one), or None when
    ``directory`` is not inside a hub cache snapshot."""
    p = os.path.realpath(directory)
    while True:
        parent = os.path.dirname(p)
        if parent == p:
            return None
        if os.path.basename(p) == SNAPSHOTS and os.path.isdir(os.path.join(parent, BLOBS)):
            return parent
        p = parent


def resolve_link(directory: str, name: str) -> tuple[str, str]:
    """Where the link ``name`` in ``directory`` leads, as (directory, file name) to open without
    following links. Raises InvalidCheckpoint naming the link when ``directory`` is not in a hub
    cache snapshot or the target leaves the repo cache."""
    link = os.path.join(directory, name)
    root = cache_root(directory)
    if root is None:
        raise InvalidCheckpoint(f"{link} is a symlink; ckptctl follows links only inside a Hugging Face hub cache "
                                "snapshot (snapshots/ next to blobs/)",
                                hint="replace the link with the real file, or point at the checkpoint's real directory")
    real = os.path.realpath(link)
    if os.path.commonpath([real, root]) != root or real == root:
        raise InvalidCheckpoint(f"{link} is a symlink to {real}, outside the hub cache {root}; refusing to follow it",
                                hint="the snapshot was altered; re-download it (huggingface-cli download) and treat "
                                "this copy as untrusted")
    if not os.path.isfile(real):
        raise InvalidCheckpoint(f"{link} is a symlink to {real}, which is {'missing' if not os.path.lexists(real) else 'not a regular file'}",
                                hint="the download is incomplete; re-download the snapshot")
    return os.path.dirname(real), os.path.basename(real)
