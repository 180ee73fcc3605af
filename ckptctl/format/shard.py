"""Shard files: safetensors files whose header also carries ckptctl's chunk index.

A shard is an ordinary safetensors file (``safetensors.safe_open`` reads it). Each entry is one
*chunk*: the region of a global tensor that this shard holds. The safetensors header's
``__metadata__`` has one extra key, ``ckptctl``, a JSON object::

    {"version": 1, "rank": 3,
     "chunks": {"model/fc.weight": {"offsets": [512, 0], "checksum": "9f2c..."}},
     "rank_state": {...}}

``offsets`` place the chunk inside its global tensor (the chunk's shape is the safetensors
entry's shape); ``checksum`` is the XXH3-64 of the chunk's bytes, so ``verify`` names the
corrupt tensor. Keeping the chunk index here, not in the manifest, keeps the manifest's size
linear in ranks + tensors instead of ranks x tensors.

Parsing is defensive: the header is untrusted input. Its length is bounded, every offset is
checked against the file size, and entries must tile the data section exactly. With the
``ckptctl`` key present every part of the index is required (rank, and offsets and a checksum
of exactly 16 lowercase hex digits for every entry); without it the file parses as another
tool's safetensors (``ShardHeader.indexed`` False), which as a ckptctl shard is corrupt
(``format.shard_identity``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes, parse
from ckptctl.format.checksum import DIGEST_CHARS, is_digest

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger claim is an attack or garbage
# The first read of a header. ckptctl's own hold each rank's RNG states (about 20 KiB) and a
# line per chunk (a shard of a few hundred tensors: under 100 KiB). On object storage a GET of
# 256 KiB costs about the round trip a GET of 8 bytes costs (a few ms more at 100 MB/s).
HEADER_GUESS = 256 << 10
METADATA_KEY = "ckptctl"
SHARD_VERSION = 1  # the chunk index's format version; a higher one is refused
_ALIGN = 8


@dataclass(frozen=True)
class Chunk:
    """One tensor region stored in a shard."""

    name: str  # the global tensor's name
    dtype: str  # manifest dtype name
    shape: tuple[int, ...]  # the chunk's own shape
    offsets: tuple[int, ...]  # where the chunk starts in the global tensor
    begin: int  # byte offset in the shard's data section
    end: int
    checksum: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardHeader:
    """A parsed shard header. ``data_start`` is the file offset of the data section."""

    chunks: list[Chunk]
    data_start: int
    rank: int | None
    rank_state: dict[str, Any] = field(default_factory=dict)
    header_bytes: bytes = b""
    # Whether the header carries ckptctl's chunk index. A ckptctl shard always does; a shard
    # without it is corrupt (``format.shard_identity``), only other tools' safetensors lack it.
    indexed: bool = False

    @property
    def data_size(self) -> int:
        return max((c.end for c in self.chunks), default=0)


def build_header(
    chunks: Sequence[Chunk], *, rank: int, rank_state: dict[str, Any] | None = None
) -> bytes:
    """The bytes that precede the data section: 8-byte little-endian length, then JSON padded
    with spaces so the data section starts 8-byte aligned (as safetensors itself does)."""
    meta = {
        "version": SHARD_VERSION,
        "rank": rank,
        "chunks": {c.name: {"offsets": list(c.offsets), "checksum": c.checksum} for c in chunks},
        "rank_state": rank_state or {},
    }
    header: dict[str, Any] = {"__metadata__": {METADATA_KEY: json.dumps(meta, separators=(",", ":"))}}
    for c in chunks:
        header[c.name] = {
            "dtype": dtypes.code_of(c.dtype),
            "shape": list(c.shape),
            "data_offsets": [c.begin, c.end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def parse_header(prefix: bytes, file_size: int, where: str) -> ShardHeader:
    """Parse a header from the first bytes of a shard. ``prefix`` must hold at least the 8-byte
    length and the JSON it announces (see ``header_length``). ``where`` names the file."""
    n = header_length(prefix[:8], file_size, where)
    raw = prefix[8 : 8 + n]
    if len(raw) != n:
        raise InvalidCheckpoint(f"{where}: header truncated ({len(raw)} of {n} bytes)")
    header = parse.load_json(raw, where, "safetensors header", max_bytes=MAX_HEADER_BYTES)
    parse.Obj(header, where, "safetensors header")  # an object, or InvalidCheckpoint
    meta_raw = header.pop("__metadata__", None) or {}
    ours: dict[str, Any] = {}
    indexed = isinstance(meta_raw, dict) and METADATA_KEY in meta_raw
    if indexed:
        text = meta_raw[METADATA_KEY]
        if not isinstance(text, str):
            raise parse.invalid(where, "ckptctl chunk index in the header is not a string")
        # NaN/Infinity may appear in rank_state (saved per-rank values); typed fields are checked.
        ours = parse.load_json(text, where, "ckptctl chunk index", max_bytes=MAX_HEADER_BYTES, allow_nonfinite=True)
        meta = parse.Obj(ours, where, "ckptctl chunk index")
        parse.check_version(ours, where, "shard header", supported=SHARD_VERSION)
        # With the index present, every part of it is required: a chunk without offsets or a
        # checksum would be placed at the origin or read unchecked.
        meta.dict("chunks")
        meta.dict("rank_state", default=None)
        meta.int("rank", hi=parse.INT64_MAX)
        extra = sorted(set(ours["chunks"]) - set(header))
        if extra:
            raise parse.invalid(where, f"ckptctl chunk index lists {parse.show(extra[0])}, which the file does not hold")
    index = ours.get("chunks") or {}
    data_start = 8 + n
    data_size = file_size - data_start
    chunks = [_parse_entry(name, entry, index.get(name), data_size, where, indexed) for name, entry in header.items()]
    chunks.sort(key=lambda c: (c.begin, c.end))
    _check_tiling(chunks, data_size, where)
    rank = ours.get("rank")
    rank_state = ours.get("rank_state") or {}
    return ShardHeader(
        chunks=chunks,
        data_start=data_start,
        rank=rank if isinstance(rank, int) else None,
        rank_state=rank_state if isinstance(rank_state, dict) else {},
        header_bytes=bytes(prefix[:data_start]),
        indexed=indexed,
    )


def read_header_with(read: Callable[[int, int], bytes], file_size: int, where: str, *,
                     guess: bool = False) -> ShardHeader:
    """Parse a shard's header through ``read(offset, length)``, a ranged read of the file the
    caller has open (this module does no I/O of its own): its length, then the header. With
    ``guess`` (object storage, where each read is a request in series:
    ``Reader.reads_are_requests``) the first read takes up
    to ``HEADER_GUESS`` bytes, which hold most headers whole, so one request usually does;
    without it (a local file) nothing past the header is read, so a check of a checkpoint's
    headers reads only headers (tests/test_sim_scale.py and the node restores count it)."""
    first = read(0, min(HEADER_GUESS if guess else 8, file_size))
    n = header_length(first[:8], file_size, where)
    whole = 8 + min(n, MAX_HEADER_BYTES)
    return parse_header(first[:whole] if whole <= len(first) else read(0, whole), file_size, where)


def header_length(first8: bytes, file_size: int, where: str) -> int:
    """The JSON length announced by a shard's first 8 bytes, bounds-checked."""
    if len(first8) < 8 or file_size < 8:
        raise InvalidCheckpoint(f"{where}: too short to be a safetensors file ({file_size} bytes)")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_BYTES or n > file_size - 8:
        raise InvalidCheckpoint(
            f"{where}: header claims {n} bytes but the file has {file_size}",
            hint="the shard is truncated or its header is corrupt",
        )
    return n


def _parse_entry(name: str, entry: Any, index: Any, data_size: int, where: str, indexed: bool) -> Chunk:
    if not isinstance(entry, dict):
        raise InvalidCheckpoint(f"{where}: tensor {name!r}: header entry is not an object")
    code, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    dtype = dtypes.name_from_code(code) if isinstance(code, str) else None
    if dtype is None:
        raise InvalidCheckpoint(f"{where}: tensor {name!r}: unknown dtype {parse.show(code)}")
    if not isinstance(shape, list):
        raise InvalidCheckpoint(f"{where}: tensor {name!r}: bad shape {parse.show(shape)}")
    parse.shape(shape, dtypes.itemsize(dtype), lambda why: parse.invalid(where, f"tensor {name!r}: shape {why}"))
    if not (
        isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        and 0 <= offs[0] <= offs[1] <= data_size
    ):
        raise InvalidCheckpoint(
            f"{where}: tensor {name!r}: data_offsets {parse.show(offs)} fall outside the "
            f"{data_size}-byte data section",
            hint="the shard is truncated or its header is corrupt",
        )
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtypes.itemsize(dtype) != offs[1] - offs[0]:
        raise InvalidCheckpoint(
            f"{where}: tensor {name!r}: shape {shape} of {dtype} needs "
            f"{numel * dtypes.itemsize(dtype)} bytes, header gives {offs[1] - offs[0]}"
        )
    offsets: tuple[int, ...] = tuple(0 for _ in shape)
    checksum = None
    if indexed and not isinstance(index, dict):
        raise InvalidCheckpoint(
            f"{where}: tensor {name!r} has no entry in the ckptctl chunk index",
            hint="the header is corrupt or was crafted; do not trust this shard",
        )
    if isinstance(index, dict):
        o = index.get("offsets")
        if isinstance(o, list) and len(o) == len(shape) and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= parse.INT64_MAX for x in o
        ):
            offsets = tuple(o)
        else:
            raise InvalidCheckpoint(f"{where}: tensor {name!r}: bad chunk offsets {parse.show(o)}")
        checksum = index.get("checksum")
        if not is_digest(checksum):
            raise InvalidCheckpoint(
                f"{where}: tensor {name!r}: chunk checksum {parse.show(checksum)} is not a "
                f"{DIGEST_CHARS}-digit lowercase hex digest",
                hint="the header is corrupt or was crafted; do not trust this shard",
            )
    return Chunk(name, dtype, tuple(shape), offsets, offs[0], offs[1], checksum)


def _check_tiling(chunks: list[Chunk], data_size: int, where: str) -> None:
    """Entries must cover the data section exactly: overlaps would let two tensors alias the
    same bytes, gaps or a tail would hide unchecked bytes."""
    pos = 0
    for c in chunks:
        if c.begin != pos:
            what = "overlaps the previous tensor" if c.begin < pos else f"leaves a gap at byte {pos}"
            raise InvalidCheckpoint(
                f"{where}: tensor {c.name!r} at bytes {c.begin}-{c.end} {what}",
                hint="the header is corrupt or was crafted; do not trust this shard",
            )
        pos = c.end
    if pos != data_size:
        raise InvalidCheckpoint(
            f"{where}: data section has {data_size} bytes but its tensors cover {pos}",
            hint="the shard is truncated or has trailing garbage",
        )
