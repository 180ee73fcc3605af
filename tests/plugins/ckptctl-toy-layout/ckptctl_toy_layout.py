"""A toy checkpoint layout: what a third-party layout for ckptctl is (docs/extending.md).

    ROOT/toy-N/
        a.bin, b.bin    data, any number of *.bin files
        DONE            written last: {"step": N, "files": {"a.bin": SIZE, ...}}

A ``toy-N`` directory is a checkpoint of step N once ``DONE`` is there and agrees with the
directory's name and the files' sizes. The layout implements ckptctl's ``Layout`` protocol
(``ckptctl.layouts.base``) and subclasses nothing; the checking of its files is ckptctl's
(``check_files``). It is registered by the ``ckptctl.layouts`` entry point of this package;
``build_checkpoint`` and ``commit_sidecar`` are its fixture for ckptctl's layout conformance
suite (tests/test_layout_conformance.py). It imports neither torch nor anything slow: every
ckptctl command loads the installed layouts.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable

from ckptctl.errors import InvalidCheckpoint
from ckptctl.layouts import safe_load, stack_copying
from ckptctl.layouts.base import NOT_TOLD, Examined, Resume
from ckptctl.layouts.checked import ALONE
from ckptctl.layouts.file_check import check_files, name_of
from ckptctl.layouts.removal import commit_files_first
from ckptctl.storage.base import ObjectInfo, Storage

DONE = "DONE"
_NAME = re.compile(r"toy-([0-9]{1,18})\Z", re.ASCII)  # a directory's name -> its step
_OWN = re.compile(r"(DONE|[A-Za-z0-9_.-]+\.bin)\Z", re.ASCII)  # files that make a directory ours
_DATA = re.compile(r"[A-Za-z0-9_.-]+\.bin\Z", re.ASCII)


class ToyLayout:
    name = "toy"  # as ls's FORMAT column and --format spell it
    title = "toy (ckptctl's test plugin)"
    files_are_checkpoints = False  # a directory per checkpoint
    commit_marker = DONE  # without it partial; with it committed, or corrupt when it does not hold
    commit_files = (DONE,)  # deleted first, copied last
    seal_note = None  # `ckptctl seal` gives its checkpoints the checksums they lack
    pointer_file = None  # no root-level pointer names a checkpoint

    def for_root(self, root: Storage) -> "ToyLayout":
        return self

    def step_of(self, child: ObjectInfo) -> int | None:
        m = _NAME.match(child.key.rsplit("/", 1)[-1])
        return int(m.group(1)) if m is not None and child.kind in ("dir", "link") else None

    def claims(self, ckpt: Storage, names: frozenset[str]) -> bool:
        return any(_OWN.match(n) for n in names)  # an empty toy-N may be anybody's: never ours

    def claims_alone(self, ckpt: Storage, names: frozenset[str]) -> bool:
        return False  # only under its own names

    def examine(self, ckpt: Storage) -> Examined:
        if ckpt.stat(DONE) is None:
            return Examined("partial", f"no {DONE}: the toy writes it last, so this save did not finish")
        doc, problem = safe_load.json_file(ckpt, DONE)  # bounded size and nesting; never raises
        if problem is not None:
            return Examined("corrupt", f"{DONE}: {problem}")
        step = self.step_of(ObjectInfo(name_of(ckpt), 0, 0.0, "dir"))
        got, files = (doc.get("step"), doc.get("files")) if isinstance(doc, dict) else (None, None)
        if not isinstance(got, int) or isinstance(got, bool) or not isinstance(files, dict):
            return Examined("corrupt", f"{DONE} has no integer step or no files")
        if step is not None and got != step:
            return Examined("corrupt", f"{DONE} says step {got}, the directory says {step}; they must agree")
        for name, size in files.items():
            if not _DATA.match(name):  # checked before it is used as a key: never a path
                return Examined("corrupt", f"{DONE} names {name!r}, which is no data file of this checkpoint")
            info = ckpt.stat(name)
            if info is None or info.kind != "file" or info.size != size:
                return Examined("corrupt", f"{name}: missing or not the {size} bytes {DONE} records")
        return Examined("committed")

    def removal_order(self, keys: Iterable[str]) -> list[str]:
        return commit_files_first(keys, self.commit_files)

    def check(self, ckpt: Storage, level: str, *, split: Any = ALONE, progress: Any = None) -> Any:
        return check_files(self, ckpt, level, kind_of=lambda rel: "json" if rel == DONE else "other", split=split)

    def reads_on_resume(self, rel: str) -> bool:
        return True  # its resume reads every file

    def identity(self, ckpt: Storage) -> str | None:
        return None  # nothing names its contents: each prune checks it afresh (or by its seal)

    def inspect(self, ckpt: Storage, *, tensors: bool = False) -> Any:
        raise InvalidCheckpoint(f"{ckpt.url}: a toy checkpoint holds opaque *.bin files; nothing reads tensors there")

    def pointer_target(self) -> None:
        return None

    def pointer_for(self, name: str, step: int) -> None:
        return None

    def pointer_step(self, raw: bytes) -> None:
        return None

    def assuming_pointer(self, name: str, step: int) -> "ToyLayout":
        return self

    def protected(self, entries: Iterable[tuple[str, str]]) -> dict[str, str]:
        return {}  # no pointer, no best checkpoint

    def kind_of_checkpoint(self, ckpt: Storage, manifest: object = None) -> Any:
        return NOT_TOLD  # exports are not told apart: every committed one may resume

    def resume(self, ckpt_path: str, step: int) -> Resume:
        return Resume(ckpt_path, f"--resume {ckpt_path}", ("--resume", ckpt_path))

    def recorded_metrics(self, root: Storage, checkpoints: Iterable[tuple[str, int]]) -> dict[str, dict[str, float]]:
        return {}  # the toy records no metrics

    # Copying (cp, restore, sync): data files first, DONE last, each checked against a seal
    # when there is one, by ckptctl's rules for other tools' checkpoints.

    def copy_source(self, ckpt: Storage) -> Any:
        return stack_copying.copy_source(self, ckpt)

    def copy_committed(self, source: Any, dst: Storage) -> Any:
        return stack_copying.copy_committed(self, source, dst)

    def uncommit_copy(self, source: Any, dst: Storage) -> None:
        stack_copying.uncommit_copy(self, source, dst)

    def commit_copy(self, source: Any, dst: Storage, published: Any = ()) -> None:
        stack_copying.commit_copy(self, source, dst, published)

    def pointer_after_copy(self, source: Any) -> None:
        return None


def open_toyfs(url: str, **kwargs: Any) -> Storage:
    """``toyfs:///PATH``: the local directory PATH (the ``ckptctl.storage`` entry point)."""
    from ckptctl.storage.local import LocalStorage

    path = url[len("toyfs://"):]
    if not path.startswith("/"):
        raise ValueError(f"{url}: toyfs URLs are toyfs:///ABSOLUTE/PATH")
    return LocalStorage(path, url=url, **kwargs)


# --- the fixture: ckptctl's layout conformance suite builds checkpoints with these ----------


def build_checkpoint(root: str, step: int, *, complete: bool = True) -> str:
    """Write ``ROOT/toy-STEP`` as the toy saves it, ``DONE`` last; ``complete=False`` is a save
    killed before ``DONE``. Returns the checkpoint's path."""
    path = os.path.join(root, f"toy-{step}")
    os.makedirs(path)
    files = {"a.bin": os.urandom(4096), "b.bin": bytes(range(256)) * 8}
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    if complete:
        with open(os.path.join(path, DONE), "w") as f:
            json.dump({"step": step, "files": {n: len(d) for n, d in files.items()}}, f)
    return path


def commit_sidecar(root: str, step: int) -> str:
    """The file whose content decides whether ``toy-STEP`` is committed: what a hostile-input
    test replaces."""
    return os.path.join(root, f"toy-{step}", DONE)
