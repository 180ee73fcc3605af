"""The seal: ``.ckptctl-seal.json``, the checksums ckptctl adds to another tool's checkpoint.

Checkpoints written by the Hugging Face Trainer, torchtitan/DCP, DeepSpeed, Megatron-LM or
Lightning record no checksums of their own (bar a CRC-32 per ``torch.save`` record), so a
flipped bit that still decodes goes unnoticed. ``ckptctl seal`` test-loads such a checkpoint
once and writes this sidecar next to its files (never changing them): per file its size and
XXH3-64 and, for files larger than ``chunk_size``, the XXH3-64 of each ``chunk_size`` piece so
that bit rot is located to a byte range. ``verify`` then checks every byte against it.

``created`` is when the seal was written; ``committed`` the checkpoint's own commit time at
sealing (the newest modification among its files then), which every age and calendar rule
uses instead of the seal's own mtime: sealing never makes a checkpoint younger, and a copy
that carries the seal keeps its age. Seals written before the field existed lack it; their
checkpoints' age falls back to the newest modification inside, the seal file's included.

This module is pure: bytes in, a ``Seal`` or ``InvalidCheckpoint`` out (``format.parse``).

    {"kind": "ckptctl-seal", "version": 1, "layout": "hf-trainer", "name": "checkpoint-1500",
     "step": 1500, "created": 1764570000.0, "committed": 1764000000.0, "tool": {"ckptctl": "0.1.0", ...},
     "algorithm": "xxh3-64", "chunk_size": 67108864, "test_loaded": "load",
     "not_loaded": ["training_args.bin: decoded structurally, not test-loaded (...)"],
     "files": [{"name": "model.safetensors", "size": 123, "xxh3": "...", "chunks": []}, ...]}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from ckptctl.format.checksum import ALGORITHM, Hasher
from ckptctl.format.parse import INT64_MAX, MAX_TIME, Obj, check_version, invalid, load_json

SEAL = ".ckptctl-seal.json"
KIND = "ckptctl-seal"
VERSION = 1
CHUNK_SIZE = 64 << 20  # per-chunk digests locate bit rot to 64 MiB; 8 bytes of digest each
MAX_SEAL_BYTES = 64 << 20
MAX_FILES = 1 << 20
# The temporary a local writer fills before it renames or links it to SEAL (``.NAME.tmp-PID-HEX``,
# ``storage.local_io``): a ``seal`` killed before it removed it leaves it beside the seal.
_SEAL_TEMPORARY = re.compile(re.escape(f".{SEAL}") + r"\.tmp-[0-9]+-[0-9a-f]+\Z", re.ASCII)
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class SealedFile:
    """One file of a sealed checkpoint: its size, whole-file digest and piece digests (empty
    when the file is one piece)."""

    name: str  # relative to the checkpoint directory, "/"-separated
    size: int
    xxh3: str
    chunks: tuple[str, ...] = ()

    def pieces(self, chunk_size: int) -> Iterator[tuple[int, int, str | None]]:
        """(start, end, expected digest or None) of each checked piece of the file."""
        if not self.chunks:
            yield 0, self.size, None
            return
        for i, d in enumerate(self.chunks):
            yield i * chunk_size, min(self.size, (i + 1) * chunk_size), d


@dataclass(frozen=True)
class Seal:
    """A parsed ``.ckptctl-seal.json``."""

    layout: str
    name: str
    step: int | None
    created: float
    tool: dict[str, str]
    files: tuple[SealedFile, ...]
    chunk_size: int = CHUNK_SIZE
    test_loaded: str = "load"
    not_loaded: tuple[str, ...] = ()
    algorithm: str = ALGORITHM
    committed: float | None = None  # the checkpoint's commit time at sealing (None: an older seal)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def by_name(self) -> dict[str, SealedFile]:
        return {f.name: f for f in self.files}


def is_seal_file(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint) is its seal or a temporary a killed ``seal``
    left of it: ckptctl's sidecar, never one of the checkpoint's own files, and never read as
    its seal (a killed seal must not make an intact checkpoint fail verify)."""
    return key == SEAL or _SEAL_TEMPORARY.match(key) is not None


def check_seal_size(size: int, where: str) -> None:
    """Raise InvalidCheckpoint (a corrupt checkpoint, not a storage error) for a seal of more
    than ``MAX_SEAL_BYTES``, before anything reads it (a sparse 100 GB file costs no disk)."""
    if size > MAX_SEAL_BYTES:
        raise invalid(where, f"{size} bytes, more than the {MAX_SEAL_BYTES} a seal may have",
                      hint="the seal is damaged; delete it and run `ckptctl seal` again")


def chunk_count(size: int, chunk_size: int) -> int:
    """How many piece digests a file of ``size`` bytes records (0: the whole-file one only)."""
    return 0 if size <= chunk_size else -(-size // chunk_size)


class FileDigest:
    """A file's seal entry computed from its bytes as they stream past, in order, once: what
    ``ckptctl seal`` reads back from storage, or what an integration's writer hands to storage
    (``ckptctl.integrations``), so that no byte is read twice to be sealed. ``update`` takes
    pieces of any size; they are split at ``chunk_size`` boundaries here. The first chunk's
    digest is the whole-file hash's state at its end, so a file of one chunk (most files) is
    hashed once, and a larger one hashed twice from its second chunk on only."""

    def __init__(self, chunk_size: int = CHUNK_SIZE) -> None:
        self.chunk_size = chunk_size
        self.size = 0
        self._whole = Hasher()
        self._piece = Hasher()  # the current chunk's, from the second chunk on
        self._chunks: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            room = self.chunk_size - self.size % self.chunk_size
            part, view = view[:room], view[room:]
            self._whole.update(part)
            if self.size >= self.chunk_size:
                self._piece.update(part)
            self.size += part.nbytes
            if self.size % self.chunk_size == 0:
                self._chunks.append((self._whole if self.size == self.chunk_size else self._piece).hexdigest())
                self._piece = Hasher()

    def sealed(self, name: str) -> SealedFile:
        """The entry for ``name``: piece digests only when the file is larger than one chunk."""
        chunks = tuple(self._chunks) if chunk_count(self.size, self.chunk_size) else ()
        if chunks and self.size % self.chunk_size:
            chunks += (self._piece.hexdigest(),)
        return SealedFile(name, self.size, self._whole.hexdigest(), chunks)


def sealed_name(name: Any) -> bool:
    """A relative file path a seal may name: no absolute path, no ``..``, no empty part, no
    backslash or NUL, printable, and never the seal itself."""
    if not isinstance(name, str) or not 0 < len(name) <= 4096 or name == SEAL:
        return False
    if name.startswith("/") or "\\" in name or "\x00" in name or not name.isprintable():
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def encode_seal(seal: Seal) -> bytes:
    """The sidecar's bytes (stable key order, one file per line for diffs)."""
    doc = {
        "kind": KIND, "version": VERSION, "layout": seal.layout, "name": seal.name, "step": seal.step,
        "created": seal.created, **({} if seal.committed is None else {"committed": seal.committed}),
        "tool": dict(seal.tool), "algorithm": seal.algorithm,
        "chunk_size": seal.chunk_size, "test_loaded": seal.test_loaded, "not_loaded": list(seal.not_loaded),
        "files": [{"name": f.name, "size": f.size, "xxh3": f.xxh3, "chunks": list(f.chunks)} for f in seal.files],
    }
    return (json.dumps(doc, indent=1, sort_keys=False) + "\n").encode("utf-8")


def _digest(v: Any, err: Any) -> str:
    if not isinstance(v, str) or len(v) != 16 or not set(v) <= _HEX:
        raise err("is not a 16-digit lower-case hex XXH3-64 digest")
    return v


def parse_seal(raw: bytes, where: str) -> Seal:
    """Parse a seal. Raises InvalidCheckpoint naming ``where`` for anything malformed: bad JSON,
    a newer version, a file named twice or outside the checkpoint, digests that do not match
    the file's size."""
    doc = load_json(raw, where, "seal", max_bytes=MAX_SEAL_BYTES, max_depth=8)
    o = Obj(doc, where, "seal")
    if o.str("kind", max_len=64) != KIND:
        raise invalid(where, f"not a ckptctl seal (kind {o.doc.get('kind')!r})")
    check_version(o.doc, where, "seal", supported=VERSION)
    algorithm = o.str("algorithm", max_len=32)
    if algorithm != ALGORITHM:
        raise invalid(where, f"seal uses checksum algorithm {algorithm!r}; this ckptctl knows {ALGORITHM}",
                      hint="upgrade ckptctl to read it")
    chunk_size = o.int("chunk_size", lo=1 << 20, hi=1 << 40)
    tool = o.dict("tool", max_len=32)
    files: list[SealedFile] = []
    seen: set[str] = set()
    for i, raw_f in enumerate(o.list("files", max_len=MAX_FILES)):
        f = Obj(raw_f, where, f"seal: files[{i}]")
        name = f.str("name", max_len=4096)
        if not sealed_name(name):
            raise f.bad("name", f"{name[:80]!r} is not a plain relative path inside the checkpoint")
        if name in seen:
            raise f.bad("name", f"{name!r} is named twice")
        seen.add(name)
        size = f.int("size", lo=0, hi=INT64_MAX)
        whole = _digest(f.doc.get("xxh3"), lambda why: f.bad("xxh3", why))
        chunks = f.list("chunks", max_len=1 << 24, default=[])
        want = chunk_count(size, chunk_size)
        if len(chunks) != want:
            raise f.bad("chunks", f"has {len(chunks)} digests; a file of {size} bytes in pieces of {chunk_size} needs {want}")
        digests = tuple(_digest(c, lambda why, j=j: f.bad(f"chunks[{j}]", why)) for j, c in enumerate(chunks))
        files.append(SealedFile(name, size, whole, digests))
    not_loaded = o.list("not_loaded", max_len=1 << 16, default=[])
    if not all(isinstance(s, str) and len(s) <= 4096 for s in not_loaded):
        raise o.bad("not_loaded", "holds something other than short strings")
    step = o.int("step", lo=0, hi=INT64_MAX, default=None)
    created = o.float("created", lo=0.0, hi=MAX_TIME)
    committed = o.float("committed", lo=0.0, hi=MAX_TIME, default=None)
    if committed is not None and committed > created:
        raise o.bad("committed", "is later than the seal's own time: a checkpoint is committed before it is sealed")
    return Seal(
        layout=o.str("layout", max_len=64), name=o.str("name", max_len=4096), step=step,
        created=created, committed=committed, tool={str(k): str(v)[:200] for k, v in tool.items()},
        files=tuple(files), chunk_size=chunk_size, test_loaded=o.str("test_loaded", max_len=32, default="load"),
        not_loaded=tuple(not_loaded), algorithm=algorithm,
    )
