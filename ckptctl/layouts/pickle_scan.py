"""The structural decode of a pickle that ``torch.load(weights_only=True)`` refuses: its opcode
stream is walked with ``pickletools.genops``, which parses opcodes and executes nothing.

A file or record that names a class torch's weights-only unpickler does not build (the
Trainer's ``training_args.bin`` is a ``TrainingArguments`` or TRL's ``SFTConfig``; torchtitan's
``train_state`` holds ``io.BytesIO`` values) is still not a blind spot. It is *decoded
structurally* when its stream parses opcode by opcode and ends in STOP exactly where its data
ends, names every class by name (never by a copyreg extension code), takes no out-of-band
buffer, and every tensor storage it refers to is there. Nothing is ever built, so a class name
alone fails nothing: the classes are named in the report ("names
trl.trainer.sft_config.SFTConfig; never unpickled"). A broken stream (zeroed, truncated, a
length that runs past the end) is *not decoded*.

Formats (``scan_torch``): a bare pickle of any protocol (0-5); ``torch.save``'s zip archive
(``data.pkl`` walked, every member's CRC-32 checked as it is read, every storage it names a
member); and ``torch.save``'s legacy format: five pickles (magic number, protocol version,
system info, the object, its sorted storage keys), then each storage as its element count and
bytes, which must end exactly at the end of the file (the storages' bytes are skipped, never
read: ``legacy_problem`` is cheap enough for the quick level).
"""

from __future__ import annotations

import _compat_pickle
import io
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from typing import BinaryIO

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization's legacy magic number (the first pickle)
MAX_PICKLE = 256 << 20  # a pickle stream this large is no record a stack writes
MAX_OPS = 50_000_000  # far beyond any real record; a hostile stream cannot spin forever
MAX_NAMED = 3  # classes named one by one in a report; the rest are counted
_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING")
_INTS = ("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG")
_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")
_GETS = ("GET", "BINGET", "LONG_BINGET")
_KEEP = 10  # values remembered back from the top: a storage reference is the last 8
# Plain builtins a pickle names for sets, bytes and objects' default reduction.
_PLAIN = frozenset({"builtins.set", "builtins.frozenset", "builtins.bytearray", "builtins.complex", "builtins.slice",
                    "builtins.object", "copyreg._reconstructor", "copyreg.__newobj__", "_codecs.encode",
                    "collections.OrderedDict", "collections.Counter", "collections.defaultdict"})
# Bytes per element of each legacy storage type (torch.FloatStorage...): its data's size.
_ELEMENT = {"Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
            "Byte": 1, "Bool": 1, "ComplexDouble": 16, "ComplexFloat": 8, "QInt8": 1, "QUInt8": 1, "QInt32": 4,
            "QUInt4x2": 1, "QUInt2x4": 1, "Untyped": 1}


@dataclass(frozen=True)
class Scan:
    """The outcome of a structural decode: ``problem`` None means decoded structurally."""

    problem: str | None
    classes: tuple[str, ...] = ()  # the classes it names beyond torch's own and plain builtins, in order


@dataclass(frozen=True)
class _Class:
    """A class a GLOBAL (or STACK_GLOBAL) pushed: named, never imported."""

    name: str


@dataclass(frozen=True)
class _Ref:
    """A tensor storage a persistent id names: ``('storage', TYPE, KEY, LOCATION, NUMEL, ...)``."""

    key: str
    kind: str  # the storage type's name (torch.FloatStorage)
    numel: int | None


class _Broken(Exception):
    """The stream is not a whole pickle (the message says where and why)."""


class _Capped:
    """A file read from where it is, ``limit`` bytes at the most in all: what ``genops`` reads a
    stream through, so a length a hostile pickle claims (BINBYTES8 of 2^62) never makes a read
    larger than the pickles may be."""

    def __init__(self, f: BinaryIO, limit: int) -> None:
        self.f, self.left = f, limit

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(self.left if n < 0 else min(n, self.left))
        self.left -= len(data)
        return data

    def readline(self) -> bytes:
        data = self.f.readline(self.left)
        self.left -= len(data)
        return data


def torch_allowed() -> frozenset[str]:
    """What torch's weights-only unpickler builds (tensors, storages, dtypes, containers)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        return frozenset(_get_allowed_globals())
    except (ImportError, AttributeError):  # a torch without that table: tensors only
        return frozenset({"torch._utils._rebuild_tensor_v2", "torch.storage.UntypedStorage", "torch.Size"})


def _canonical(module: str, name: str) -> str:
    """``module.name`` as Python 3 spells it (protocols 0-2 write ``__builtin__``, ``copy_reg``)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _walk(stream: BinaryIO, named: list[str], refs: list[_Ref], strings: list[str] | None = None) -> object:
    """Walk one pickle stream from ``stream``'s position through its STOP (the stream is left
    just after it). Appends the classes it names to ``named``, the storages its persistent ids
    name to ``refs`` and, when given, every string it pushes to ``strings``. Returns the value
    last pushed before STOP (a scalar pickle's value). Raises _Broken."""
    recent: list[object] = []  # values of the last pushes, for STACK_GLOBAL and persistent ids
    memo: dict[int, object] = {}
    try:
        for count, (op, arg, pos) in enumerate(pickletools.genops(stream)):
            name = op.name
            if count > MAX_OPS:
                raise _Broken(f"more than {MAX_OPS} opcodes")
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                named.append(_canonical(module, attr))
                recent.append(_Class(named[-1]))
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or not all(isinstance(v, str) for v in recent[-2:]):
                    raise _Broken(f"byte {pos}: STACK_GLOBAL whose class cannot be read from the stream")
                named.append(_canonical(str(recent[-2]), str(recent[-1])))
                recent[-2:] = [_Class(named[-1])]  # it takes its two names off the stack
            elif name in ("EXT1", "EXT2", "EXT4"):
                # copyreg's extension registry names a class by a number: which one cannot be read
                raise _Broken(f"byte {pos}: {name} names a class by extension code, not by name")
            elif name in ("NEXT_BUFFER", "READONLY_BUFFER"):
                raise _Broken(f"byte {pos}: {name}: its data was passed out of band, not stored in the file")
            elif name in _STRINGS:
                text = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
                recent.append(text)
                if strings is not None:
                    strings.append(text)
            elif name in _INTS:
                recent.append(arg)
            elif name in _PUTS or name == "MEMOIZE":
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = recent[-1] if recent else None
                continue  # a memo write does not push
            elif name in ("FRAME", "PROTO"):
                continue  # framing: between any two opcodes, pushes nothing
            elif name in _GETS:
                recent.append(memo.get(int(arg)))
            elif name in ("BINPERSID", "PERSID"):
                refs.append(_storage_ref(recent, pos))
                recent.append(None)
            elif name == "STOP":
                return recent[-1] if recent else None
            else:
                recent.append(None)
            del recent[:-_KEEP]
    except (ValueError, EOFError, UnicodeDecodeError, IndexError, KeyError, TypeError, OverflowError,
            struct.error) as e:
        # genops raises ValueError for an unknown opcode or a stream that ends inside one
        raise _Broken(f"not a whole pickle stream: {_first_line(e)}") from None
    raise _Broken("the pickle stream has no STOP (truncated)")


def _storage_ref(recent: list[object], pos: int) -> _Ref:
    """torch's persistent id: MARK 'storage' GLOBAL(type) KEY LOCATION NUMEL [VIEW] TUPLE."""
    at = [i for i, v in enumerate(recent) if v == "storage"]
    if at and at[-1] + 2 < len(recent):
        kind, key = recent[at[-1] + 1], recent[at[-1] + 2]
        numel = recent[at[-1] + 4] if at[-1] + 4 < len(recent) else None
        if isinstance(kind, _Class) and isinstance(key, str):
            return _Ref(key, kind.name, numel if isinstance(numel, int) and not isinstance(numel, bool) else None)
    raise _Broken(f"byte {pos}: a persistent id that is not a torch storage reference")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def _scan(named: list[str]) -> Scan:
    plain = torch_allowed() | _PLAIN
    return Scan(None, tuple(dict.fromkeys(n for n in named if n not in plain)))  # in the order named


def scan_pickle(data: bytes) -> tuple[Scan, list[_Ref]]:
    """Walk one pickle stream that must end exactly at the end of ``data``. Returns the scan
    and the storages its persistent ids name."""
    named: list[str] = []
    refs: list[_Ref] = []
    stream = io.BytesIO(data)
    try:
        _walk(stream, named, refs)
    except _Broken as e:
        return Scan(str(e)), refs
    if stream.tell() != len(data):
        return Scan(f"{len(data) - stream.tell()} bytes after the pickle's STOP"), refs
    return _scan(named), refs


def scan_torch_bytes(raw: bytes) -> Scan:
    """``scan_torch`` of a ``torch.save`` output held in memory (a DCP record)."""
    return scan_torch(io.BytesIO(raw))


def scan_torch(f: BinaryIO) -> Scan:
    """The structural decode of a ``torch.save`` output (a DCP record, a file): a zip archive,
    the legacy format, or a bare pickle of any protocol."""
    size = f.seek(0, io.SEEK_END)
    f.seek(0)
    head = f.read(4)
    f.seek(0)
    if head == b"PK\x03\x04":
        return _scan_zip(f)
    if not head or chr(head[0]) not in pickletools.code2op:
        return Scan("neither a torch.save zip archive nor a pickle (zeroed or overwritten)")
    if is_legacy_torch(f):
        return _scan_legacy(f, size)
    if size > MAX_PICKLE:
        return Scan(f"a pickle larger than {MAX_PICKLE >> 20} MiB")
    f.seek(0)
    return scan_pickle(f.read(size))[0]


def _scan_zip(f: BinaryIO) -> Scan:
    try:
        with zipfile.ZipFile(f) as z:
            names = z.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                return Scan("the archive has no single <name>/data.pkl")
            prefix = pkl[0][: -len("data.pkl")]
            if z.getinfo(pkl[0]).file_size > MAX_PICKLE:
                return Scan(f"data.pkl is larger than {MAX_PICKLE >> 20} MiB")
            scan, refs = scan_pickle(z.read(pkl[0]))  # ZipFile.read checks the CRC-32
            for ref in sorted(refs, key=lambda r: r.key):
                if f"{prefix}data/{ref.key}" not in names:
                    return Scan(f"the pickle names tensor storage {ref.key!r}, which the archive lacks")
            for name in names:  # every member read once: its CRC-32 checked, in bounded pieces
                with z.open(name) as m:
                    while m.read(8 << 20):
                        pass
            return scan
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError, OSError) as e:
        return Scan(f"not a whole torch.save archive: {_first_line(e)}")


def is_legacy_torch(f: BinaryIO) -> bool:
    """Whether ``f`` is in ``torch.save``'s legacy (pre-zip) format: its first pickle is the
    magic number. Reads a few dozen bytes."""
    f.seek(0)
    first = f.read(64)
    f.seek(0)
    try:
        return _walk(io.BytesIO(first), [], []) == MAGIC_NUMBER
    except _Broken:
        return False


def legacy_problem(f: BinaryIO) -> str | None:
    """What is wrong with the structure of a legacy ``torch.save`` file (its five pickles, each
    storage's size, nothing after the last), or None. Storage bytes are skipped, never read."""
    size = f.seek(0, io.SEEK_END)
    return _scan_legacy(f, size).problem


def _scan_legacy(f: BinaryIO, size: int) -> Scan:
    f.seek(0)
    stream = _Capped(f, MAX_PICKLE)  # the pickles are read; the storages after them only sized
    named: list[str] = []
    refs: list[_Ref] = []
    keys: list[str] = []
    try:
        for part, strings in (("magic number", None), ("protocol version", None), ("system info", None),
                              ("object", None), ("storage keys", keys)):
            _walk(stream, named if part == "object" else [], refs if part == "object" else [], strings)  # type: ignore[arg-type]
    except _Broken as e:
        if not stream.left:
            return Scan(f"a legacy torch.save file whose pickles take more than {MAX_PICKLE >> 20} MiB")
        return Scan(f"a legacy torch.save file, not whole: {e}")
    by_key = {r.key: r for r in refs}
    missing = sorted(set(by_key) - set(keys))
    if missing:
        return Scan(f"the pickle names tensor storage {missing[0]!r}, which the file lacks")
    pos = f.tell()
    for key in keys:
        ref = by_key.get(key)
        element = _ELEMENT.get(ref.kind.rsplit(".", 1)[-1].removesuffix("Storage")) if ref is not None else 1
        if element is None:
            return Scan(f"storage {key!r} of type {ref.kind if ref else '?'}, whose element size is unknown")
        f.seek(pos)
        count = f.read(8)
        if len(count) < 8:
            return Scan(f"storage {key!r} at byte {pos}: the file ends before its size (truncated)")
        numel = struct.unpack("<q", count)[0]
        if numel < 0 or (ref is not None and ref.numel is not None and numel != ref.numel):
            return Scan(f"storage {key!r} at byte {pos} says {numel} elements, its reference {ref.numel if ref else '?'}")
        pos += 8 + numel * element
        if pos > size:
            return Scan(f"storage {key!r} runs to byte {pos}, past the end of the {size}-byte file (truncated)")
    if pos != size:
        return Scan(f"{size - pos} bytes after the last storage of a legacy torch.save file")
    return _scan(named)
