"""Reading a seal (``format.seal``) and checking a checkpoint's bytes against it, through any
``Storage``: what ``verify`` does for a sealed checkpoint of another tool, what ``cp`` and
``restore`` do on the fly, and what ``prune`` trusts for a sealed anchor.

Each file is read once, in pieces aligned to the seal's chunks, and hashed both as a whole and
per chunk, so a mismatch names the file and the byte range of the chunk that changed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Literal

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format.seal import SEAL, FileDigest, Seal, SealedFile, check_seal_size, is_seal_file, parse_seal
from ckptctl.layouts.checked import Problem
from ckptctl.layouts.safe_load import STRUCTURAL_MARK
from ckptctl.progress import Progress
from ckptctl.settings import VERIFY_PIECE
from ckptctl.storage.base import Storage
from ckptctl.storage.local_io import temporary_of

SealLevel = Literal["quick", "checksums"]
MAX_RANGES = 8  # bad chunks named one by one in a file; the rest are counted
LEFTOVER = "run the interrupted `ckptctl seal` (or `ckptctl cp`) again: it removes the leftover first"
RESEAL = "if the change was intended, delete the seal and run `ckptctl seal` again; otherwise restore this checkpoint from a good copy"


def is_temporary(key: str) -> bool:
    """Whether ``key``'s last part is one of ckptctl's own temporary names (a killed ``seal`` or
    ``cp`` left it: ``ops.seal.leftovers`` removes those before a rerun decides)."""
    return temporary_of(key.rsplit("/", 1)[-1]) is not None


def read_seal(ckpt: Storage) -> Seal | None:
    """The checkpoint's seal, or None when it has none. Raises InvalidCheckpoint for a seal
    that does not parse (a damaged seal is never silently ignored)."""
    info = ckpt.stat(SEAL)
    if info is None:
        return None
    check_seal_size(info.size, ckpt.url_of(SEAL))
    return parse_seal(ckpt.read(SEAL, max_size=64 << 20), ckpt.url_of(SEAL))


@dataclass
class Hashed:
    """One file as read: its size, whole-file digest and chunk digests."""

    size: int
    xxh3: str
    chunks: tuple[str, ...]


def hash_object(st: Storage, key: str, chunk_size: int, *, progress: Progress | None = None,
                sink: Callable[[memoryview | bytes], None] | None = None,
                stop: threading.Event | None = None) -> Hashed | None:
    """Read ``key`` once, hashing the whole and each chunk (when the file is larger than one
    chunk: ``format.seal.FileDigest``); every piece goes to ``sink`` too (a copy's writer).
    Returns None when ``stop`` was set meanwhile."""
    with st.open_reader(key) as r:
        size = r.size
        digest = FileDigest(chunk_size)
        # Read into one buffer reused piece after piece (``Reader.read`` would allocate and copy
        # each piece twice: hashing from the page cache is then mostly memcpy); a sink gets a
        # fresh buffer per piece, since it may keep what it is given.
        reused = bytearray(min(VERIFY_PIECE, size)) if sink is None else None
        offset = 0
        while offset < size:
            if stop is not None and stop.is_set():
                return None
            n = min(VERIFY_PIECE, size - offset)  # FileDigest splits at chunk boundaries itself
            data = memoryview(reused if reused is not None else bytearray(n))[:n]
            r.read_into(offset, data)
            digest.update(data)
            if sink is not None:
                sink(data)
            offset += n
            if progress is not None:
                progress(n)
    got = digest.sealed(key)
    return Hashed(got.size, got.xxh3, got.chunks)


def compare(f: SealedFile, got: Hashed, chunk_size: int) -> list[Problem]:
    """What differs between the sealed file ``f`` and the bytes read (``got``)."""
    if got.size != f.size:
        return [Problem(f"{got.size} bytes, sealed with {f.size}: resized after sealing", file=f.name, hint=RESEAL)]
    if got.xxh3 == f.xxh3 and got.chunks == f.chunks:
        return []
    if not f.chunks:
        return [Problem("XXH3 differs from the seal: the bytes changed after sealing (bit rot or an overwrite)",
                        file=f.name, byte_range=(0, f.size), hint=RESEAL)]
    bad = [(s, e) for (s, e, want), have in zip(f.pieces(chunk_size), got.chunks) if want != have]
    out = [Problem("XXH3 of this range differs from the seal: the bytes changed after sealing",
                   file=f.name, byte_range=r, hint=RESEAL) for r in bad[:MAX_RANGES]]
    if len(bad) > MAX_RANGES:
        out.append(Problem(f"{len(bad) - MAX_RANGES} more changed range(s)", file=f.name, hint=RESEAL))
    return out or [Problem("XXH3 differs from the seal", file=f.name, byte_range=(0, f.size), hint=RESEAL)]


def check_against_seal(ckpt: Storage, seal: Seal, level: SealLevel = "checksums",
                       progress: Progress | None = None) -> tuple[list[Problem], int]:
    """Compare the checkpoint with its seal: every sealed file present with its size, no file
    added (``quick``), and every byte hashed and compared (``checksums``). Returns the problems
    and the bytes read; nothing raises for a checkpoint problem."""
    problems: list[Problem] = []
    now = {i.key: i for i in ckpt.list() if not is_seal_file(i.key)}  # a killed seal's temporary is no file of it
    sealed = seal.by_name()
    for name in sorted(set(now) - set(sealed)):
        if is_temporary(name):
            problems.append(Problem("a temporary file an interrupted ckptctl write left behind; the seal does not "
                                    "cover it", file=name, hint=LEFTOVER))
            continue
        problems.append(Problem("added after sealing: the seal does not cover it", file=name, hint=RESEAL))
    read = 0
    for f in seal.files:
        info = now.get(f.name)
        if info is None:
            problems.append(Problem("removed after sealing", file=f.name, hint=RESEAL))
            continue
        if info.kind != "file":
            problems.append(Problem(f"now a {info.kind}, sealed as a regular file", file=f.name, hint=RESEAL))
            continue
        if info.size != f.size:
            problems.append(Problem(f"{info.size} bytes, sealed with {f.size}: resized after sealing", file=f.name,
                                    hint=RESEAL))
            continue
        if level == "checksums":
            got = hash_object(ckpt, f.name, seal.chunk_size, progress=progress)
            assert got is not None
            read += got.size
            problems.extend(compare(f, got, seal.chunk_size))
    return problems, read


def seal_note(seal: Seal, level: SealLevel) -> str:
    """One phrase for a report: what the seal vouches for."""
    from time import gmtime, strftime

    when = strftime("%Y-%m-%dT%H:%M:%SZ", gmtime(seal.created))
    what = "every byte checked against it" if level == "checksums" else "files and sizes checked against it"
    return f"sealed {when} by ckptctl {seal.tool.get('ckptctl', '?')} ({len(seal.files)} files): {what}"


def seal_problem(ckpt: Storage) -> tuple[Seal | None, Problem | None]:
    """``read_seal`` for a report: a damaged seal is a problem, not an exception."""
    try:
        return read_seal(ckpt), None
    except InvalidCheckpoint as e:
        return None, Problem(str(e), file=SEAL, hint="the seal is damaged; delete it and run `ckptctl seal` again")


def decoded_when_sealed(seal: Seal) -> bool:
    """Whether the seal was made by an honest load level: every file it lists as not
    test-loaded was decoded structurally. An older seal may list files nothing decoded
    ("presence and size only", "not test-loaded"): its checksums then do not stand for load."""
    return all(STRUCTURAL_MARK in entry for entry in seal.not_loaded)
