"""Test-loading other tools' files without ever running their pickle code.

Every ``torch.save`` file is loaded with ``torch.load(weights_only=True)``: torch's own
restricted unpickler, which builds tensors, containers and plain values only. A layout may
widen it with an explicit allow-list of harmless classes its stack really stores (numpy's RNG
state in Hugging Face ``rng_state.pth``, ``argparse.Namespace`` in Megatron's ``args``), given
to ``torch.serialization.safe_globals`` for that one load. A file that needs anything else is
*not* unpickled: it is reported as ``not test-loaded (pickle of CLASS)``, and a ``--trust-pickle``
is deliberately not offered.

``torch.save`` files are zip archives with a CRC-32 per record, so their bytes can be checked
without unpickling anything (``zip_crc``): that is the checksum level for those stacks.
torch is imported only when a file is actually loaded.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat
import zipfile
from typing import Any, BinaryIO, Callable, Sequence

Allowed = Sequence[Any]  # classes/functions, or (object, "module.name") pairs for old names

CHUNK = 8 << 20


def regular_size(path: str) -> int | None:
    """The size of a regular file at ``path``; None when it is missing, a symlink, a FIFO or
    anything else that is not a plain file (never followed, never opened)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def open_plain(path: str) -> "BinaryIO | None":
    """Open a regular file for reading without following a link and without ever blocking (a
    FIFO planted under a pointer's name is never waited on); None when there is no plain file
    there. Checking with ``regular_size`` and then calling ``open`` would leave a window in
    which the name could be swapped for a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink: never followed
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_pointer(path: str, limit: int) -> str | None:
    """The first ``limit`` bytes of a small pointer file at a root (DeepSpeed's ``latest``,
    Megatron's tracker), decoded and stripped; None when there is no plain file there."""
    f = open_plain(path)
    if f is None:
        return None
    with f:
        return f.read(limit).decode("utf-8", "replace").strip()


def zip_crc(path: str) -> tuple[str | None, int]:
    """Check every record of a ``torch.save`` zip archive against its CRC-32. Returns (problem
    or None, bytes read). Nothing is unpickled."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            read = sum(i.file_size for i in z.infolist())
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"not a readable torch.save archive ({e})", 0
    if bad is not None:
        return f"record {bad} fails its CRC-32 check (the bytes changed after it was written)", read
    return None, read


def torch_file(path: str, allowed: Allowed = ()) -> tuple[str | None, str | None]:
    """Test-load a ``torch.save`` file with ``weights_only=True`` and ``allowed`` as the only
    extra globals. Returns (problem, not_loaded): a problem when the file is damaged; a
    "not test-loaded (pickle of CLASS)" text when it needs a class outside the allow-list."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            # mmap: the load maps the tensors instead of reading them (the CRC-32 pass read
            # every byte already); only the zip format can be mapped.
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        del obj
        return None, None
    except pickle.UnpicklingError as e:
        classes = _unsafe_globals(path, allowed) or [_first_line(e)]
        return None, f"not test-loaded (pickle of {', '.join(classes[:3])})"
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, TypeError) as e:
        return f"does not load: {_first_line(e)}", None


def _unsafe_globals(path: str, allowed: Allowed) -> list[str]:
    import torch

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, OSError, ValueError, pickle.UnpicklingError):
        return []  # the caller reports the load error's own text instead
    ok = {_qualname(a) for a in allowed}
    return [n for n in names if n not in ok]


def _qualname(a: Any) -> str:
    if isinstance(a, tuple):
        return str(a[1])
    return f"{getattr(a, '__module__', '?')}.{getattr(a, '__qualname__', getattr(a, '__name__', '?'))}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def safetensors_file(path: str) -> tuple[str | None, int]:
    """Read every tensor of a ``.safetensors`` file, one at a time. Returns (problem, bytes)."""
    from safetensors import SafetensorError, safe_open

    total = 0
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
                del t
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        return f"safetensors refuses the file: {_first_line(e)}", total
    return None, total


def safetensors_header(path: str) -> str | None:
    """The cheap check: the header parses and the data it describes fits in the file."""
    size = regular_size(path)
    if size is None or size < 8:
        return "too short for a safetensors header"
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8 or n > 100 << 20:
            return f"header of {n} bytes does not fit the {size}-byte file"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            return f"header is not JSON ({e})"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items()
                   if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    except (TypeError, ValueError, IndexError, OverflowError):
        return "header is garbled: a tensor's data_offsets is not a pair of integers"
    if 8 + n + end > size:
        return f"tensor data runs to byte {8 + n + end}, past the end of the {size}-byte file (truncated)"
    return None


def json_file(path: str, limit: int = 64 << 20) -> tuple[Any, str | None]:
    """Parse a small JSON file. Returns (document, problem)."""
    size = regular_size(path)
    if size is None:
        return None, "missing or not a regular file"
    if size > limit:
        return None, f"{size} bytes, more than the {limit} a JSON sidecar may have"
    try:
        with open(path, "rb") as f:
            return json.loads(f.read()), None
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"not valid JSON ({_first_line(e)})"


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
