"""``torch.save`` files (.pt, .bin, .pth), read and written without ever running pickle code.

Reading uses only ``torch.load(path, weights_only=True, mmap=True)``: torch's restricted
unpickler builds tensors, containers and plain values and refuses anything else (a pickled
custom class), so nothing from the file is executed; a refusal becomes a one-line
``InvalidCheckpoint`` naming the file. With ``mmap`` the tensors stay in the file until read;
each one's pages are dropped again after it is copied (``madvise(MADV_DONTNEED)`` on the
clean, private mapping), so resident memory stays about one tensor.

Writing streams too: ``torch.save`` runs under ``torch.serialization.skip_data`` on
placeholder tensors whose memory is never touched, which lays out the zip with a correctly sized, empty record per
tensor and costs no memory; then each tensor is read once and written into its record with
``pwrite``, and the records' CRC-32s are patched in, so the file is an ordinary, valid zip that
``torch.load`` reads.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from typing import Any

import torch

from ckptctl.errors import InvalidCheckpoint, StateError, UsageError
from ckptctl.format import dtypes
from ckptctl.interop import torch_zip
from ckptctl.interop.base import Fill, Source, TensorMeta, Written, group_of
from ckptctl.interop.steps import STEP_KEYS, StepClue, as_step
from ckptctl.state.buffers import tensor_bytes as byte_view
from ckptctl.state import tree as statetree
from ckptctl.storage.plain_file import fd_path, open_plain
from ckptctl.storage.local_io import temporary_name

class NotPlainFile(InvalidCheckpoint):
    """Missing, or a symlink, FIFO or device where a ``torch.save`` file belongs: never opened."""


class NeedsPickle(InvalidCheckpoint):
    """A ``torch.save`` file that is intact but holds more than ``weights_only`` builds; never
    unpickled. ``classes`` names the globals it needs (read from its opcodes, not run)."""

    def __init__(self, path: str, e: pickle.UnpicklingError, classes: list[str]) -> None:
        first = str(e).strip().splitlines()
        detail = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        super().__init__(
            f"{path}: refusing to load: it needs pickle beyond plain tensors and containers ({detail.strip()})",
            hint="only weights_only-safe files are read; re-save it as a plain state_dict of tensors, or load it "
            "yourself if you trust its source",
        )
        self.classes = classes


def _unsafe_globals(where: str) -> list[str]:
    """The globals a torch.save file needs beyond what ``weights_only`` allows, read from its
    pickle opcodes without running them; empty when the file is too damaged to say."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(where))
    except (RuntimeError, OSError, ValueError, EOFError, KeyError, IndexError, pickle.UnpicklingError):
        return []


def _check_container(f: Any, path: str) -> None:
    """The zip container checked from its own headers before torch's reader sees it
    (``interop.torch_zip``); a pre-1.6 bare pickle has none."""
    head = f.read(2)
    f.seek(0)
    if head == b"\x80\x02":
        return
    try:
        torch_zip.members(f, os.fstat(f.fileno()).st_size)
    except torch_zip.ZipProblem as e:
        raise InvalidCheckpoint(f"{path}: not a readable torch.save file: {e}",
                                hint="the file is truncated or was altered; do not trust it") from None


class TorchSource(Source):
    kind = "torch"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.url = path
        f = open_plain(path)
        if f is None:  # a FIFO here would block torch's open forever; a link is never followed
            raise NotPlainFile(f"{path}: not a regular file (a symlink, FIFO or device); never opened",
                               hint="the checkpoint layout was altered; treat it as untrusted")
        try:
            with f:
                _check_container(f, path)
                # The descriptor's path: torch maps the very file checked to be regular.
                where = fd_path(f, path)
                try:
                    obj = torch.load(where, map_location="cpu", weights_only=True, mmap=True)
                except pickle.UnpicklingError as e:
                    raise NeedsPickle(path, e, _unsafe_globals(where)) from None
        except (RuntimeError, OSError, EOFError, zipfile.BadZipFile, ValueError, TypeError, KeyError, IndexError,
                OverflowError, RecursionError, NotImplementedError) as e:  # what a damaged zip or pickle raises
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise InvalidCheckpoint(f"{path}: not a readable torch.save file ({detail})") from None
        self._tensors: dict[str, torch.Tensor] = {}
        self._mapped: list[tuple[int, int]] | None = None  # address ranges that map this file
        if not isinstance(obj, dict):
            obj = {"tensor" if isinstance(obj, torch.Tensor) else "value": obj}

        def on_tensor(name: str, t: torch.Tensor) -> None:
            if name in self._tensors:
                if t is self._tensors[name]:
                    return
                # Keys that only differ in type ({1: a, "1": b}) name the same tensor once
                # joined; taking either would silently write the other's values for both.
                raise UsageError(
                    f"{path}: two tensors are both named {name!r} (keys that differ only in type, "
                    "such as 1 and \"1\"); refusing to convert",
                    hint="rename one of the keys so that every tensor has its own name",
                )
            try:
                dt = dtypes.name_of(t.dtype)
            except ValueError:
                self.dropped.append(f"tensor {name!r}: dtype {t.dtype} is not supported")
                return
            self._tensors[name] = t
            self.tensors[name] = TensorMeta(name, dt, tuple(t.shape), group_of(name))

        try:
            self.tree = {str(k): statetree.encode(v, (str(k),), on_tensor) for k, v in obj.items()}
        except StateError as e:  # a value weights_only allows but JSON cannot hold (a set, bytes)
            raise UsageError(f"{path}: {e}", hint=e.hint) from None
        for key in STEP_KEYS:  # Lightning's global_step, Megatron's iteration, a plain step
            step = as_step(obj.get(key))
            if step is not None:
                self.step_clues.append(StepClue(step, f"{key!r} in {os.path.basename(path)}"))
                break

    def read_into(self, name: str, out: torch.Tensor) -> None:
        t = self._tensors[name]
        out.copy_(t)
        if self._mapped is None:
            self._mapped = _file_mappings(self.url)
        _drop_pages(t, self._mapped)

    def close(self) -> None:
        self._tensors.clear()


_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
_PAGE = mmap.PAGESIZE


def _file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (Linux ``/proc/self/maps``; empty
    elsewhere, which turns page dropping off)."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real:
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


def _drop_pages(t: torch.Tensor, mapped: list[tuple[int, int]]) -> None:
    """Release the file pages a mmap-loaded tensor pulled in. The mapping is private and was
    only read, so the pages are clean: dropping them loses nothing (a later access rereads the
    file). Only done where the storage lies inside a mapping of the file itself: on ordinary
    memory, MADV_DONTNEED would zero the data. Best effort: not without madvise."""
    if _libc is None or t.numel() == 0:
        return
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    if not any(lo <= start and end <= hi for lo, hi in mapped):
        return
    lo = (start + _PAGE - 1) // _PAGE * _PAGE  # only pages wholly inside this tensor's storage
    hi = end // _PAGE * _PAGE
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


def _placeholders(metas: dict[str, TensorMeta]) -> dict[str, torch.Tensor]:
    """Tensors that ``torch.save`` can lay out but whose memory is never touched. Plain
    ``torch.empty`` costs address space only (untouched pages are not resident); past half the
    machine's memory, fake tensors avoid even that, at the price of importing torch's fake tensor
    machinery (~70 MiB)."""
    total = sum(m.nbytes for m in metas.values())
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    if ram and total < ram // 2:
        return {n: torch.empty(m.shape, dtype=dtypes.torch_dtype(m.dtype)) for n, m in metas.items()}
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return {n: torch.empty(m.shape, dtype=dtypes.torch_dtype(m.dtype)) for n, m in metas.items()}


def write_torch(path: str, tree: Any, metas: dict[str, TensorMeta], fill: Fill) -> Written:
    """Write ``tree`` (ckptctl's encoded state, tensors by reference) as a torch.save file of
    nested dicts; written under a temporary name and renamed into place."""
    from torch.serialization import skip_data

    holders = _placeholders(metas)
    obj = statetree.decode(tree, lambda n: holders[n])
    order = list(dict.fromkeys(statetree.tensor_refs(tree)))  # pickling order = first appearance
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, temporary_name(os.path.basename(path)))
    done = False
    try:
        with skip_data(materialize_fake_tensors=True):
            torch.save(obj, tmp)
        _fill_records(tmp, [metas[n] for n in order], fill)
        os.rename(tmp, path)
        done = True
    finally:
        if not done and os.path.exists(tmp):  # any failure, interrupts included: no half file left
            os.unlink(tmp)
    dfd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return Written([path], os.path.getsize(path))


def _fill_records(path: str, order: list[TensorMeta], fill: Fill) -> None:
    with zipfile.ZipFile(path) as z:
        records = [i for i in z.infolist() if "/data/" in i.filename and i.filename.rsplit("/", 1)[1].isdigit()]
    records.sort(key=lambda i: int(i.filename.rsplit("/", 1)[1]))
    if [r.file_size for r in records] != [m.nbytes for m in order]:
        raise RuntimeError(f"{path}: torch.save laid out {len(records)} storages that do not match the {len(order)} tensors")
    from ckptctl.state.buffers import TensorBuffer

    buf = TensorBuffer()
    crcs: dict[str, int] = {}
    # Unbuffered: the data goes in with pwrite, and a buffered file object's stale read-ahead
    # would be written back over it.
    with open(path, "r+b", buffering=0) as f:
        for rec, m in zip(records, order):
            f.seek(rec.header_offset)
            local = f.read(30)
            n, extra = struct.unpack("<HH", local[26:30])
            start = rec.header_offset + 30 + n + extra
            t = buf.view(m.dtype, m.shape)
            fill(m, t)
            data = byte_view(t)
            done = 0
            while done < len(data):
                done += os.pwrite(f.fileno(), data[done:], start + done)
            crc = zlib.crc32(data)
            crcs[rec.filename] = crc
            f.seek(rec.header_offset + 14)
            f.write(struct.pack("<I", crc))
            if struct.unpack("<H", local[6:8])[0] & 0x8:  # torch's writer adds a data descriptor: its CRC too
                f.seek(start + len(data))
                at = start + len(data) + (4 if f.read(4) == b"PK\x07\x08" else 0)
                f.seek(at)
                f.write(struct.pack("<I", crc))
        _patch_central_crcs(f, crcs)
        os.fsync(f.fileno())


def _patch_central_crcs(f: Any, crcs: dict[str, int]) -> None:
    """Write each record's CRC-32 into its central directory entry (found by scanning it)."""
    size = f.seek(0, os.SEEK_END)
    tail_len = min(size, 1 << 16)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    eocd = tail.rfind(b"PK\x05\x06")
    cd_offset = struct.unpack("<I", tail[eocd + 16 : eocd + 20])[0]
    loc = tail.rfind(b"PK\x06\x07")  # zip64 locator: the real offset is in the zip64 end record
    if cd_offset == 0xFFFFFFFF and loc >= 0:
        z64 = struct.unpack("<Q", tail[loc + 8 : loc + 16])[0]
        f.seek(z64 + 48)
        cd_offset = struct.unpack("<Q", f.read(8))[0]
    pos = cd_offset
    while True:
        f.seek(pos)
        head = f.read(46)
        if head[:4] != b"PK\x01\x02":
            break
        n, extra, comment = struct.unpack("<HHH", head[28:34])
        name = f.read(n).decode()
        if name in crcs:
            f.seek(pos + 16)
            f.write(struct.pack("<I", crcs[name]))
        pos += 46 + n + extra + comment
