"""The container of a ``torch.save`` file, checked against itself before anything reads it.

A ``torch.save`` file is a zip archive (torch's own writer, ``caffe2/serialize``: stored
members, each followed by a data descriptor, a central directory, zip64 records past 4 GiB).
Python's ``zipfile`` trusts what it is told: an unknown compression method raises
NotImplementedError, the encrypted flag RuntimeError, a name flagged UTF-8 that is not
UnicodeDecodeError, and bytes appended or inserted anywhere are never noticed. So the archive is
walked here first, and every one of those is a one-line problem naming what is wrong:

- the end of central directory record is the file's last bytes (nothing trails it), and its
  zip64 record and locator, when present, sit where they say; all of them name one disk (a
  flipped byte there is damage: ``end_records``, a commit rule's cheap test, tells it from a
  write cut short, which has no end record at all);
- the central directory begins where the last member ends and ends where the end records begin;
- members are laid out back to back from byte 0: each local header sits where the directory
  says, agrees with it (name, method, flags), and its data and data descriptor end exactly where
  the next member begins;
- every member is stored or deflated, not encrypted, and named in UTF-8, once.

Then ``crc_problem`` reads each member's data through the checked table, CRC-32 against the
directory, inflating a deflated one with its output bounded by the size the directory
declares. Nothing here imports torch or unpickles anything.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable

EOCD = b"PK\x05\x06"
ZIP64_EOCD = b"PK\x06\x06"
ZIP64_LOCATOR = b"PK\x06\x07"
CENTRAL = b"PK\x01\x02"
LOCAL = b"PK\x03\x04"
DESCRIPTOR = b"PK\x07\x08"
STORED, DEFLATED = 0, 8
FLAG_ENCRYPTED, FLAG_DESCRIPTOR, FLAG_STRONG = 0x1, 0x8, 0x40
MAX_MEMBERS = 1 << 22  # a record per tensor storage; far above any real state
MAX_DIRECTORY = 1 << 30
PIECE = 8 << 20
_U32, _U16 = 0xFFFFFFFF, 0xFFFF


class ZipProblem(ValueError):
    """What is wrong with the archive, in one line (the caller names the file)."""


class Unended(ZipProblem):
    """No end record closes the file: its write was cut short (the directory is written last),
    or bytes were appended after it."""


@dataclass(frozen=True)
class Member:
    name: str
    method: int
    crc: int
    compressed: int
    size: int
    header: int  # offset of the local header
    data: int  # offset of the first data byte
    end: int  # offset just past the member (its data descriptor included)


def members(f: BinaryIO, file_size: int) -> list[Member]:
    """The archive's members, in file order, once its layout has been checked as this
    module's docstring says. Raises ZipProblem."""
    read = _reader(f, file_size)
    cd_offset, cd_size, count, cd_end = _end_records(read, file_size)
    if count > MAX_MEMBERS or cd_size > MAX_DIRECTORY:
        raise ZipProblem(f"its directory claims {count} members in {cd_size} bytes, beyond any torch.save file")
    if cd_offset + cd_size != cd_end:
        raise ZipProblem(f"its central directory ({cd_size} bytes at {cd_offset}) does not end where the end "
                         f"records begin (byte {cd_end})")
    table = read(cd_offset, cd_size)
    out: list[Member] = []
    seen: set[str] = set()
    pos = 0
    for i in range(count):
        m, pos = _central_entry(table, pos, i, file_size)
        if m.name in seen:
            raise ZipProblem(f"member {m.name!r} is named twice")
        seen.add(m.name)
        out.append(m)
    if pos != cd_size:
        raise ZipProblem(f"its central directory holds {cd_size - pos} bytes beyond its {count} entries")
    out.sort(key=lambda m: m.header)
    at = 0
    placed: list[Member] = []
    for m in out:
        if m.header != at:
            what = "overlaps the previous one" if m.header < at else f"leaves {m.header - at} unaccounted bytes before it"
            raise ZipProblem(f"member {m.name!r} at byte {m.header} {what}")
        placed.append(_local(read, m, file_size))
        at = placed[-1].end
    if at != cd_offset:
        raise ZipProblem(f"its members end at byte {at}, but the central directory begins at {cd_offset}")
    return placed


def crc_problem(f: BinaryIO, member: Member, progress: Callable[[int], None] | None = None) -> str | None:
    """Read one checked member's data and compare its CRC-32 (and, inflated, its size) with the
    central directory; the problem, or None."""
    crc = 0
    produced = 0
    inflate = zlib.decompressobj(-15) if member.method == DEFLATED else None
    f.seek(member.data)
    left = member.compressed
    try:
        while left:
            piece = f.read(min(PIECE, left))
            if not piece:
                return f"record {member.name} ends early: the file shrank while it was read"
            left -= len(piece)
            if progress is not None:
                progress(len(piece))
            chunks = [piece] if inflate is None else _inflate(inflate, piece, member.size - produced)
            for c in chunks:
                produced += len(c)
                crc = zlib.crc32(c, crc)
        if inflate is not None:
            tail = inflate.flush()
            produced += len(tail)
            crc = zlib.crc32(tail, crc)
            if not inflate.eof:
                return f"record {member.name}: its deflated data does not end where the directory says"
    except zlib.error as e:
        return f"record {member.name}: its deflated data is corrupt ({e})"
    except _TooLong:
        return f"record {member.name} inflates past the {member.size} bytes its directory entry declares"
    if produced != member.size:
        return f"record {member.name} holds {produced} bytes, its directory entry says {member.size}"
    if crc != member.crc:
        return f"record {member.name} fails its CRC-32 check (the bytes changed after it was written)"
    return None


class _TooLong(Exception):
    pass


def _inflate(d: "zlib._Decompress", piece: bytes, room: int) -> list[bytes]:
    """Inflate ``piece``, never producing more than ``room`` + 1 bytes (a bomb stops here)."""
    out = []
    data = piece
    while data:
        chunk = d.decompress(data, max(1, min(room + 1, PIECE)))
        room -= len(chunk)
        if room < 0:
            raise _TooLong
        out.append(chunk)
        data = d.unconsumed_tail
    return out


def end_records(f: BinaryIO, file_size: int) -> None:
    """Check the archive's end records alone (the cheap test of a file written whole: they are
    written last). Raises Unended when none closes the file, ZipProblem when they are wrong."""
    _end_records(_reader(f, file_size), file_size)


def _reader(f: BinaryIO, file_size: int) -> Callable[[int, int], bytes]:
    def read(offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > file_size:
            raise ZipProblem(f"a record at byte {offset} ({n} bytes) lies past the end of the {file_size}-byte file")
        f.seek(offset)
        data = f.read(n)
        if len(data) != n:
            raise ZipProblem(f"the file ends at byte {offset + len(data)}, before the record at {offset} does")
        return data

    return read


def _end_records(read: Callable[[int, int], bytes], size: int) -> tuple[int, int, int, int]:
    """(directory offset, directory size, member count, where the end records begin). The end
    record must close the file: its comment, if any, reaches exactly the last byte."""
    if size < 22:
        raise Unended(f"{size} bytes: too short for a zip archive (truncated)")
    tail_len = min(size, 22 + _U16)
    tail = read(size - tail_len, tail_len)
    at = tail.rfind(EOCD)
    while at >= 0:
        if at + 22 <= tail_len and at + 22 + struct.unpack_from("<H", tail, at + 20)[0] == tail_len:
            break
        at = tail.rfind(EOCD, 0, at)
    if at < 0:
        if tail[-22:-18] == EOCD or tail[-42:-38] == ZIP64_LOCATOR:
            # The end records are where a whole file has them, but do not close it: a flipped
            # byte (the signature, the comment's length), not a write cut short.
            raise ZipProblem("its end of central directory record is damaged")
        raise Unended("no end of central directory record at its end (truncated, or bytes appended after it)")
    eocd = size - tail_len + at
    disk, cd_disk, n_disk, n_total, cd_size, cd_offset = struct.unpack_from("<HHHHII", tail, at + 4)
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise ZipProblem("it claims to span several disks")
    # zip64: a locator just before the end record names the zip64 end record (torch writes
    # both always; other writers only past 4 GiB or 65535 members).
    if eocd < 20 or read(eocd - 20, 4) != ZIP64_LOCATOR:
        if _U16 == n_total or _U32 in (cd_size, cd_offset):
            raise ZipProblem("its end record defers to zip64 records that are not there")
        return cd_offset, cd_size, n_total, eocd
    z64_disk, z64, disks = struct.unpack_from("<IQI", read(eocd - 20 + 4, 16))
    if z64_disk != 0 or disks != 1:
        raise ZipProblem("its zip64 locator claims several disks")
    if z64 + 56 > eocd - 20:
        raise ZipProblem(f"its zip64 locator points at byte {z64}, past the records that follow")
    rec = read(z64, 56)
    if rec[:4] != ZIP64_EOCD:
        raise ZipProblem(f"no zip64 end record at byte {z64}, where its locator points")
    rec_size = struct.unpack_from("<Q", rec, 4)[0]
    if z64 + 12 + rec_size != eocd - 20:
        raise ZipProblem("its zip64 end record does not end where the locator begins")
    disk64, cd_disk64, n_disk64, n_total64, cd_size64, cd_offset64 = struct.unpack_from("<IIQQQQ", rec, 16)
    if disk64 != 0 or cd_disk64 != 0 or n_disk64 != n_total64:
        raise ZipProblem("it claims to span several disks")
    for short, wide, full in ((n_total, n_total64, _U16), (cd_size, cd_size64, _U32), (cd_offset, cd_offset64, _U32)):
        if short != full and short != wide:
            raise ZipProblem("its end record and its zip64 end record disagree")
    return cd_offset64, cd_size64, n_total64, z64


def _central_entry(table: bytes, pos: int, i: int, file_size: int) -> tuple[Member, int]:
    if pos + 46 > len(table) or table[pos:pos + 4] != CENTRAL:
        raise ZipProblem(f"directory entry {i} is not where the previous one ends")
    (flags, method, _t, _d, crc, csize, usize, n, m, k, disk, _ia, _ea, offset) = struct.unpack_from(
        "<HHHHIIIHHHHHII", table, pos + 8)
    end = pos + 46 + n + m + k
    if end > len(table):
        raise ZipProblem(f"directory entry {i} runs past the end of the directory")
    raw_name = table[pos + 46:pos + 46 + n]
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise ZipProblem(f"member name {raw_name[:60]!r} is not UTF-8 (torch names its records in plain text)") from None
    if not name.isprintable():
        raise ZipProblem(f"member name {name[:60]!r} holds control characters")
    if flags & (FLAG_ENCRYPTED | FLAG_STRONG):
        raise ZipProblem(f"member {name!r} is encrypted (torch.save never encrypts; ckptctl cannot check it)")
    if method not in (STORED, DEFLATED):
        raise ZipProblem(f"member {name!r} uses compression method {method}, which ckptctl cannot check "
                         "(torch.save stores its records)")
    if disk not in (0, _U16):
        raise ZipProblem(f"member {name!r} claims to be on another disk")
    usize, csize, offset = _zip64_sizes(table[pos + 46 + n:pos + 46 + n + m], usize, csize, offset, name)
    if method == STORED and csize != usize:
        raise ZipProblem(f"stored member {name!r} has {csize} bytes on disk but declares {usize}")
    if offset + 30 + csize > file_size:
        raise ZipProblem(f"member {name!r} ({csize} bytes at {offset}) lies past the end of the {file_size}-byte file")
    return Member(name, method, crc, csize, usize, offset, 0, 0), end


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int, name: str) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extra field, for those the entry marks 0xFFFFFFFF."""
    want = [v == _U32 for v in (usize, csize, offset)]
    if not any(want):
        return usize, csize, offset
    p = 0
    while p + 4 <= len(extra):
        tag, ln = struct.unpack_from("<HH", extra, p)
        body = extra[p + 4:p + 4 + ln]
        if tag == 0x0001:
            vals = [usize, csize, offset]
            q = 0
            for j in range(3):
                if want[j]:
                    if q + 8 > len(body):
                        raise ZipProblem(f"member {name!r}: its zip64 field is too short")
                    vals[j] = struct.unpack_from("<Q", body, q)[0]
                    q += 8
            return vals[0], vals[1], vals[2]
        p += 4 + ln
    raise ZipProblem(f"member {name!r} defers its sizes to a zip64 field that is not there")


def _local(read: Callable[[int, int], bytes], m: Member, file_size: int) -> Member:
    """``m`` with its data offset and end, from its local header, checked against the directory."""
    head = read(m.header, 30)
    if head[:4] != LOCAL:
        raise ZipProblem(f"member {m.name!r}: no local header at byte {m.header}, where the directory says")
    flags, method = struct.unpack_from("<HH", head, 6)
    n, extra = struct.unpack_from("<HH", head, 26)
    if read(m.header + 30, n) != m.name.encode("utf-8"):
        raise ZipProblem(f"member {m.name!r}: its local header names another member")
    if method != m.method or (flags & FLAG_ENCRYPTED):
        raise ZipProblem(f"member {m.name!r}: its local header disagrees with the directory (method or flags)")
    data = m.header + 30 + n + extra
    end = data + m.compressed
    if end > file_size:
        raise ZipProblem(f"member {m.name!r}: its data runs past the end of the {file_size}-byte file")
    if flags & FLAG_DESCRIPTOR:
        end += _descriptor_length(read, m, end, file_size)
    return Member(m.name, m.method, m.crc, m.compressed, m.size, m.header, data, end)


def _descriptor_length(read: Callable[[int, int], bytes], m: Member, at: int, file_size: int) -> int:
    """The length of the data descriptor after member ``m``'s data (signature optional, 32- or
    64-bit sizes), which must repeat the directory's sizes. Its CRC is not compared: the data
    is checked against the directory's (``crc_problem``), and writers that fill a record after
    laying it out (``torch_io.write_torch`` did, until it patched descriptors too) may leave it stale."""
    for length, signed, wide in ((16, True, False), (24, True, True), (12, False, False), (20, False, True)):
        if at + length > file_size:
            continue
        raw = read(at, length)
        body = raw[4:] if signed else raw
        if signed and raw[:4] != DESCRIPTOR:
            continue
        _crc, csize, usize = struct.unpack_from("<IQQ" if wide else "<III", body)
        if (csize, usize) == (m.compressed, m.size):
            return length
    raise ZipProblem(f"member {m.name!r}: no data descriptor matching its directory entry after its data")
