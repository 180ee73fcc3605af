"""File formats another tool's reader takes: a ``.safetensors`` or ``torch.save`` file, a
directory of safetensors (a Hugging Face export), a DCP directory read whole.

``format_of`` and ``format_by_name`` are how these formats recognise a path (by names and magic
bytes, never by loading): ``classify`` asks them, as it asks each layout's ``claims``, and gives
the one answer every verb uses. ``FileFormat`` handles a path that is such a file, named by
itself (``verify`` and ``inspect`` ask its ``check`` and ``inspect`` as they ask a layout's),
and ``inspect_local`` shows another tool's checkpoint through the reader of its files' format.

None of these formats records checksums, so ``check`` cannot tell a flipped bit from a real
value; it says so in its notes instead of reporting a clean bill of health it cannot back
(``ckptctl convert --to ckptctl`` gives the checkpoint checksums). The readers (``interop``)
take local paths and import torch: they are imported when a file is actually read.
"""

from __future__ import annotations

import os

from ckptctl.errors import CkptError, InvalidCheckpoint, UsageError
from ckptctl.format.layout import MANIFEST, MARKER, is_own_shard_name
from ckptctl.interop.detect import SAFETENSORS_INDEX, Format
from ckptctl.layouts.checked import ALONE, Checked, Level, Problem, Split, by_one
from ckptctl.layouts.inspected import ForeignInspect
from ckptctl.progress import Progress
from ckptctl.storage.base import Storage
from ckptctl.storage.plain_file import open_plain

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
NO_FORMAT_DIR = "no manifest, marker, DCP .metadata or .safetensors in it"
NO_CHECKSUMS = "{fmt} records no checksums: corruption that still decodes cannot be detected; " \
               "structure and coverage were checked{loaded}. `ckptctl convert --to ckptctl` adds checksums."


class Unfinished(InvalidCheckpoint):
    """A directory of DCP records without the ``.metadata`` DCP writes last: a save that did
    not finish (no reader takes it)."""


def _is_torch_file(path: str) -> bool:
    """A torch.save file: by suffix, else by the zip magic its archive starts with."""
    if path.endswith(TORCH_SUFFIXES):
        return True
    f = open_plain(path)  # never blocks on a FIFO
    if f is None:
        return False
    with f:
        return f.read(4) == b"PK\x03\x04"


def format_of(path: str) -> Format | None:
    """Which reader's format the local ``path`` holds, from names and magic bytes: ``ckptctl``
    (its manifest, marker or shards: a save in progress too), ``dcp``, ``safetensors`` or
    ``torch``; None for anything else. Raises ``Unfinished`` for DCP records without the
    ``.metadata`` DCP writes last."""
    if os.path.isdir(path):
        names = frozenset(os.listdir(path))
        if _ckptctl(names):
            return "ckptctl"
        if ".metadata" in names:
            return "dcp"
        if any(n.endswith(".distcp") for n in names):
            raise Unfinished(f"{path}: DCP files (*.distcp) but no .metadata, which DCP writes last: "
                             "this save did not finish",
                             hint="use a checkpoint whose save completed (`ckptctl latest ROOT` names the newest)")
        return format_by_name(os.path.basename(path), "dir", names)
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return "safetensors"
        return "torch" if _is_torch_file(path) else None
    return None


def _ckptctl(names: frozenset[str]) -> bool:
    """ckptctl's manifest, marker or shards (a save in progress too)."""
    return MARKER in names or MANIFEST in names or any(is_own_shard_name(n) for n in names)


def format_by_name(name: str, kind: str, names: frozenset[str] = frozenset()) -> Format | None:
    """The format from names only, where reading magic bytes costs a request (object storage):
    a file ``name`` by its suffix (safetensors, torch), a directory (``kind`` "dir") by the
    ``names`` of its files (ckptctl, safetensors). None for anything else (DCP's directories
    are read locally only)."""
    if kind == "file":
        return "safetensors" if name.endswith(".safetensors") else "torch" if name.endswith(TORCH_SUFFIXES) else None
    if _ckptctl(names):
        return "ckptctl"
    return "safetensors" if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names) else None


def local_path_of(ckpt: Storage, verb: str, what: str) -> str:
    """The local path the readers take; UsageError on object storage, where they do not read."""
    path = ckpt.local_path()
    if path is None:
        raise UsageError(f"{ckpt.url} is {what} on object storage; {verb} reads it from a local path only",
                         hint="copy it to a local directory first (`ckptctl cp` copies a checkpoint directory)")
    return path


def _foreign_format(path: str) -> Format | None:
    try:
        fmt = format_of(path)
    except Unfinished:
        return None
    return None if fmt == "ckptctl" else fmt


def inspect_local(ckpt: Storage, *, tensors: bool = False, what: str = "another tool's checkpoint") -> ForeignInspect:
    """What another tool's checkpoint ``ckpt`` holds, read through its files' format reader.
    Raises InvalidCheckpoint when no reader takes them, UsageError on object storage."""
    from ckptctl.interop.sources import open_foreign

    path = local_path_of(ckpt, "inspect", what)
    fmt = _foreign_format(path)
    if fmt is None:
        raise InvalidCheckpoint(f"not a checkpoint: {ckpt.url} ({NO_FORMAT_DIR})",
                                hint="give a checkpoint directory (ROOT/step-XXXXXXXXXX), a DCP directory, "
                                     "a .safetensors or a torch.save file")
    with open_foreign(path, fmt) as src:
        groups: dict[str, int] = {"model": 0, "optimizer": 0, "other": 0}
        for m in src.tensors.values():
            groups[m.group] = groups.get(m.group, 0) + m.nbytes
        keys = sorted(src.tree) if isinstance(src.tree, dict) else []
        return ForeignInspect(
            url=ckpt.url, format=src.kind, step=src.step, tensor_count=len(src.tensors), total_bytes=_disk_bytes(path),
            bytes_by_group=groups, state_keys=keys, metadata=dict(src.metadata), dropped=list(src.dropped),
            tensors=[{"name": m.name, "dtype": m.dtype, "shape": list(m.shape), "bytes": m.nbytes, "group": m.group}
                     for m in src.tensors.values()] if tensors else [],
        )


class FileFormat:
    """A path that is a file another tool's reader takes, named by itself: checked by its
    structure and a test-load of every tensor, one at a time; shown by its reader."""

    def __init__(self, fmt: Format) -> None:
        self.name: str = fmt

    def check(self, ckpt: Storage, level: Level, *, split: Split = ALONE, progress: Progress | None = None) -> Checked:
        """Structure (headers, index), then, unless ``quick``, every tensor read and decoded one
        at a time. Problems go in the result; nothing raises for them. Under a split one process
        reads it all and tells the others."""
        path = local_path_of(ckpt, "verify", f"a {self.name} checkpoint")
        return by_one(split, lambda: self._checked(path, ckpt.url, level, progress))

    def _checked(self, path: str, url: str, level: Level, progress: Progress | None) -> Checked:
        from ckptctl.interop.sources import open_foreign

        out = Checked(level)
        loaded = ""
        try:
            with open_foreign(path, self.name) as src:  # type: ignore[arg-type]
                out.step, out.tensors = src.step, len(src.tensors)
                out.files = 1 if os.path.isfile(path) else sum(
                    1 for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
                for d in src.dropped:
                    out.problems.append(Problem(f"cannot be read safely: {d}"))
                if level != "quick":
                    loaded = _test_load(src, out, progress)
        except CkptError as e:
            out.problems.append(Problem(str(e), hint=e.hint))
        out.notes.append(NO_CHECKSUMS.format(fmt=self.name, loaded=loaded))
        if level != "quick":
            out.unsummed = [self.name]
            out.seal_hint = f"`ckptctl convert {url} DST --to ckptctl` writes a copy that records checksums"
        return out

    def inspect(self, ckpt: Storage, *, tensors: bool = False) -> ForeignInspect:
        return inspect_local(ckpt, tensors=tensors, what=f"a {self.name} checkpoint")


def _test_load(src: object, out: Checked, progress: Progress | None) -> str:
    import torch

    from ckptctl.interop.base import Source
    from ckptctl.state.buffers import TensorBuffer

    assert isinstance(src, Source)
    buf = TensorBuffer()
    for m in src.tensors.values():
        t = buf.view(m.dtype, m.shape)
        try:
            src.read_into(m.name, t)
        except (CkptError, RuntimeError, OSError, ValueError) as e:
            out.problems.append(Problem(f"does not load: {str(e).splitlines()[0][:300]}", tensor=m.name))
            continue
        if m.dtype == "bool" and t.numel() and bool((t.view(torch.uint8) > 1).any()):
            out.problems.append(Problem("bool tensor holds bytes other than 0 and 1", tensor=m.name))
        out.bytes_read += m.nbytes
        if progress:
            progress(m.nbytes)
    return " and every tensor test-loaded"


def _disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
