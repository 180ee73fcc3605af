"""Test-loading other tools' files without ever running their pickle code.

Every ``torch.save`` file is loaded with ``torch.load(weights_only=True)``: torch's own
restricted unpickler, which builds tensors, containers and plain values only. A layout may
widen it with an explicit allow-list of harmless classes its stack really stores (numpy's RNG
state in Hugging Face ``rng_state.pth``, ``argparse.Namespace`` in Megatron's ``args``), given
to ``torch.serialization.safe_globals`` for that one load. A file that needs anything else is
*not* unpickled: its opcode stream is decoded structurally (``pickle_scan``: parsed, never run),
which counts for the load level when the stream is whole, whatever classes it names (they are
named in the report); otherwise the file is "not decoded", and the load level fails when the
stack reads that file on resume. A ``--trust-pickle`` is deliberately not offered.

``torch.save`` files are zip archives with a CRC-32 per record, so their bytes can be checked
without unpickling anything (``zip_crc``): that is the checksum level for those stacks.
torch is imported only when a file is actually loaded.
"""

from __future__ import annotations

import math
import pickle
import zipfile
from typing import Any, BinaryIO, Callable, Literal, Sequence, TypeVar

from ckptctl.errors import InvalidCheckpoint
from ckptctl.format import dtypes, parse
from ckptctl.interop import torch_zip
from ckptctl.layouts import pickle_scan
from ckptctl.storage.base import Storage
from ckptctl.storage.stored_file import StoredFile, local_copy, open_file, regular_size  # noqa: F401 (regular_size: the layouts call it through here)

# ``open_file`` (storage.stored_file) is how every layout opens another tool's file, on every
# backend: a key under the checkpoint's ``Storage`` ("" for a checkpoint that is one file).

T = TypeVar("T")
Allowed = Sequence[Any]  # classes/functions, or (object, "module.name") pairs for old names

CHUNK = 8 << 20
STRUCTURAL_MARK = "decoded structurally"  # how a seal's not_loaded entry says its file was decoded
NOT_PLAIN = "not a regular file (a symlink, FIFO or device); never opened"
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit
JSON_DEPTH = 64  # far deeper than any stack's sidecar (trainer_state.json nests 3 levels)
# Documents a stack writes with Python's json, which logs a NaN loss as ``NaN``: read as written.
LOGS_NON_FINITE = frozenset({"trainer_state.json"})


def read_pointer(store: Storage, key: str, limit: int) -> str | None:
    """The first ``limit`` bytes of a small pointer file at a root (DeepSpeed's ``latest``,
    Megatron's tracker), decoded and stripped; None when there is no plain file there."""
    f = open_file(store, key)
    if f is None:
        return None
    with f:
        return f.read(limit).decode("utf-8", "replace").strip()


def opened(check: Callable[..., T], missing: T) -> Callable[..., T]:
    """``check`` (a function of an open file, then other arguments) as a function of
    ``(store, key, ...)``: the file is opened for it and closed after; ``missing`` when there
    is no plain file under ``key``. A caller checking one file several ways opens it once and
    calls the ``*_of`` functions directly (each ``open_file`` is a request on object storage)."""
    def by_key(store: Storage, key: str, *args: Any) -> T:
        f = open_file(store, key)
        if f is None:
            return missing
        with f:
            return check(f, *args)
    by_key.__doc__ = f"``{check.__name__}`` of the file ``key`` under ``store``."
    return by_key


def zip_structure_of(f: StoredFile) -> str | None:
    """The cheap check of a ``torch.save`` file: an archive's directory and every member's
    place, method, flags and name, from headers only (``interop.torch_zip``); a pre-1.6 file
    (the legacy format, no zip) by its pickles and each storage's size, its tensor bytes
    skipped (``pickle_scan.legacy_problem``). Returns the problem or None."""
    if is_legacy(f):
        problem = pickle_scan.legacy_problem(f)
        return None if problem is None else f"not a whole legacy torch.save file: {problem}"
    try:
        torch_zip.members(f, f.size)
    except torch_zip.ZipProblem as e:
        return f"not a complete torch.save archive: {e}"
    return None


def archive_end_of(f: StoredFile) -> tuple[Literal["partial", "corrupt"], str] | None:
    """Whether the ``torch.save`` archive ``f`` was written whole, by its end records alone (the
    writer's last bytes; a commit rule's cheap test): None when they close it, ("partial", why)
    when none does (a write cut short), ("corrupt", why) when they are there but wrong."""
    try:
        torch_zip.end_records(f, f.size)
    except torch_zip.Unended as e:
        return "partial", str(e)
    except torch_zip.ZipProblem as e:
        return "corrupt", f"not a whole torch.save archive: {e}"
    return None


def zip_crc_of(f: StoredFile) -> tuple[str | None, int]:
    """Check every record of a ``torch.save`` zip archive against its CRC-32, through the
    checked member table. Returns (problem or None, bytes read). Nothing is unpickled."""
    read = 0
    try:
        found = torch_zip.members(f, f.size)
    except torch_zip.ZipProblem as e:
        return f"not a complete torch.save archive: {e}", 0
    for m in found:
        problem = torch_zip.crc_problem(f, m)
        read += m.compressed
        if problem is not None:
            return problem, read
    return None, read


def is_legacy(f: BinaryIO) -> bool:
    """``torch.save(_use_new_zipfile_serialization=False)`` (pre-1.6): pickles, no zip."""
    return pickle_scan.is_legacy_torch(f)


def torch_file_of(f: StoredFile, allowed: Allowed = ()) -> tuple[str | None, str | None, str | None]:
    """Test-load a ``torch.save`` file with ``weights_only=True`` and ``allowed`` as the only
    extra globals. Returns (problem, not_decoded, structural): a problem when the file is
    damaged; when torch refuses it, its pickle is decoded structurally (``pickle_scan``:
    opcodes parsed, nothing run): "decoded structurally: names ..." when the stream is whole,
    else a "not decoded (...)" text."""
    import torch

    with local_copy(f) as where:
        # torch reads a path (mmap needs one): locally the descriptor's, so the file loaded is
        # the one checked to be regular, whatever the name points at by now; on object storage
        # a temporary copy streamed in pieces.
        zipped = not is_legacy(f)
        try:
            with torch.serialization.safe_globals(list(allowed)):
                # mmap: the load maps the tensors instead of reading them (the CRC-32 pass read
                # every byte already); only the zip format can be mapped.
                obj = torch.load(where, map_location="cpu", weights_only=True, mmap=zipped)
            del obj
            return None, None, None
        except pickle.UnpicklingError:
            return (None, *structural_text(pickle_scan.scan_torch(f)))
        except (RuntimeError, OSError, EOFError, ValueError, KeyError, TypeError, IndexError, OverflowError,
                RecursionError, NotImplementedError, UnicodeDecodeError, zipfile.BadZipFile) as e:
            return f"does not load: {_first_line(e)}", None, None


def structural_text(scan: pickle_scan.Scan) -> tuple[str | None, str | None]:
    """(not_decoded, structural) phrases for a file or record torch's loader refused."""
    if scan.problem is not None:
        return f"not decoded ({scan.problem}; never unpickled)", None
    shown = scan.classes[:pickle_scan.MAX_NAMED]
    more = f" and {len(scan.classes) - len(shown)} more" if len(scan.classes) > len(shown) else ""
    what = f"names {', '.join(shown)}{more}" if shown else "plain values only"
    return None, f"{STRUCTURAL_MARK}: {what}; never unpickled"


def pickle_file_of(f: StoredFile) -> tuple[str | None, str | None]:
    """The structural decode alone of a file the layout knows to be a pickle of a class (the
    Trainer's ``training_args.bin``): never handed to any unpickler. Returns (not_decoded,
    structural) as ``structural_text``."""
    return structural_text(pickle_scan.scan_torch(f))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def safetensors_file_of(f: StoredFile) -> tuple[str | None, int]:
    """Read every tensor of a ``.safetensors`` file, one at a time. Returns (problem, bytes)."""
    from safetensors import SafetensorError, safe_open

    total = 0
    with local_copy(f) as where:
        try:
            with safe_open(where, framework="pt") as st:
                for key in st.keys():
                    t = st.get_tensor(key)
                    total += t.numel() * t.element_size()
                    del t
        except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as e:
            return f"safetensors refuses the file: {_first_line(e)}", total
    return None, total


def safetensors_header_of(f: StoredFile) -> str | None:
    """The cheap check, from the header alone: it parses (bounded, ``format.parse``), and the
    tensors it lists tile the data section exactly, so the file is 8 + header length + the end
    of the last tensor bytes long: no short file, no trailing bytes (safetensors' own rule).
    Returns the problem or None."""
    size = f.size
    if size < 8:
        return f"{size} bytes: too short for a safetensors header"
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    if n > MAX_SAFETENSORS_HEADER or n > size - 8:
        return f"header of {n} bytes does not fit the {size}-byte file (truncated, or not safetensors)"
    raw = f.read(n)
    try:
        header = parse.load_json(raw, "", "header", max_bytes=MAX_SAFETENSORS_HEADER)
    except InvalidCheckpoint as e:
        return _own_words(e)
    if not isinstance(header, dict):
        return "header is not a JSON object"
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem, span = _tensor_span(name, entry)
        if problem is not None:
            return problem
        spans.append((span, name))
    spans.sort()
    pos = 0
    for (begin, end), name in spans:
        if begin != pos:
            return (f"tensor {name!r} at bytes {begin}-{end} of the data "
                    + ("overlaps the previous one" if begin < pos else f"leaves a gap at byte {pos}"))
        pos = end
    data = size - 8 - n
    if pos < data:
        return (f"{data - pos} trailing bytes after the last tensor: the header says the file ends at byte "
                f"{8 + n + pos}, it has {size}")
    if pos > data:
        return f"tensor data runs to byte {8 + n + pos}, past the end of the {size}-byte file (truncated)"
    return None


zip_structure = opened(zip_structure_of, NOT_PLAIN)
zip_crc = opened(zip_crc_of, (NOT_PLAIN, 0))
torch_file = opened(torch_file_of, (NOT_PLAIN, None, None))
pickle_file = opened(pickle_file_of, (f"not decoded ({NOT_PLAIN})", None))
safetensors_file = opened(safetensors_file_of, (NOT_PLAIN, 0))
safetensors_header = opened(safetensors_header_of, NOT_PLAIN)


def _tensor_span(name: str, entry: Any) -> tuple[str | None, tuple[int, int]]:
    """(problem, (begin, end)) of one header entry's data; the size is checked against dtype
    and shape when the dtype is one ckptctl knows (safetensors checks the others on load)."""
    bad = f"tensor {name[:80]!r}: "
    if not isinstance(entry, dict):
        return bad + "header entry is not an object", (0, 0)
    offs = entry.get("data_offsets")
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            and 0 <= offs[0] <= offs[1] <= parse.INT64_MAX):
        return bad + f"data_offsets {parse.show(offs)} is not a pair of increasing integers", (0, 0)
    dtype = dtypes.name_from_code(entry.get("dtype"))
    if dtype is not None:
        def err(why: str) -> InvalidCheckpoint:
            return parse.invalid("", why)

        try:
            shape = parse.shape(entry.get("shape"), dtypes.itemsize(dtype), err)
        except InvalidCheckpoint as e:
            return bad + f"shape {_own_words(e)}", (0, 0)
        need = math.prod(shape) * dtypes.itemsize(dtype)
        if need != offs[1] - offs[0]:
            return bad + f"shape {list(shape)} of {dtype} needs {need} bytes, data_offsets give {offs[1] - offs[0]}", (0, 0)
    return None, (offs[0], offs[1])


def json_of(f: StoredFile, limit: int = 64 << 20) -> tuple[Any, str | None]:
    """Parse a small JSON sidecar through the bounded parser (``format.parse``: size, nesting,
    finite numbers; NaN and Infinity only in the documents that log them). Returns
    (document, problem); nothing raises for a hostile file."""
    f.seek(0)
    raw = f.read(limit + 1)
    name = f.url.rstrip("/").rsplit("/", 1)[-1]
    try:
        return parse.load_json(raw, "", "JSON", max_bytes=limit, max_depth=JSON_DEPTH,
                               allow_nonfinite=name in LOGS_NON_FINITE), None
    except InvalidCheckpoint as e:
        return None, _own_words(e)


def json_file(store: Storage, key: str, limit: int = 64 << 20) -> tuple[Any, str | None]:
    """``json_of`` of the file ``key`` under ``store``; a problem when it is not a plain file."""
    f = open_file(store, key)
    if f is None:
        return None, "missing or not a regular file"
    with f:
        return json_of(f, limit)


def _own_words(e: InvalidCheckpoint) -> str:
    """The parser's message without the empty file name it was given (the caller names the file)."""
    text = str(e)
    return text[2:] if text.startswith(": ") else text


def numpy_rng() -> list[Any]:
    """What ``numpy.random.get_state()`` pickles to: arrays, dtypes and the array rebuilder,
    under numpy 2's name and numpy 1's (files written by either)."""
    try:
        import numpy as np
    except ImportError:
        return []
    out: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    rebuild: Callable[..., Any] | None = None
    try:
        from numpy._core.multiarray import _reconstruct as rebuild  # type: ignore[no-redef]
    except ImportError:
        from numpy.core.multiarray import _reconstruct as rebuild  # type: ignore[no-redef]
    out += [rebuild, (rebuild, "numpy.core.multiarray._reconstruct"), (rebuild, "numpy._core.multiarray._reconstruct")]
    return out
