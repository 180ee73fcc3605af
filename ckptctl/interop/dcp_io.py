"""PyTorch Distributed Checkpoint (DCP): a directory with ``.metadata`` and ``*.distcp`` files,
as torchtitan, torchtune and ``torch.distributed.checkpoint.save`` write it.

Reading never runs pickle code from the checkpoint:

- ``.metadata`` is a pickle; it is read with an unpickler that only builds DCP's own metadata
  dataclasses and enums, ``torch.Size``, dtypes and layouts (anything else is refused, naming
  the file). DCP's own reader would unpickle it unrestricted.
- tensors are loaded one at a time with ``torch.distributed.checkpoint.load`` into a target we
  own (DCP itself reads tensor records with ``torch.load(weights_only=True)``);
- non-tensor entries (optimizer hyper-parameters, strings) are decoded with
  ``torch.load(weights_only=True)`` instead of DCP's default ``weights_only=False``; one that
  needs more is reported as dropped.

Names: an entry's path in DCP's ``planner_data`` (the nesting the saver flattened, e.g.
``("optim", "state", "fc.weight", "exp_avg")``) is joined with ``/`` as ckptctl names are
(``optim/state/fc.weight/exp_avg``); a top-level key is kept as it is.

Writing: the state goes to ``torch.distributed.checkpoint.save`` nested as it was saved
(``{"model": {"fc.weight": ...}, "optimizer": {"state": ..., "param_groups": [...]}}``), so
DCP's own fqns are the usual ``model.fc.weight`` and a training job loads it the standard way
(``dcp.load({"model": model.state_dict()})``, or ``get_state_dict``/``set_state_dict`` for the
optimizer). The exact ckptctl state tree rides along as a JSON string under ``_ckptctl.state``.
The dict holds meta (zero-memory) tensors; a planner reads each real tensor only when DCP asks
to write it and frees it right after, so memory stays about one tensor. Round trips through DCP
are bitwise.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import os
import pickle
import warnings
from typing import Any

import torch

from ckptctl.errors import InvalidCheckpoint, StorageError, UsageError
from ckptctl.format import dtypes, parse
from ckptctl.interop.base import Fill, Source, TensorMeta, Written, group_of
from ckptctl.state.buffers import TensorBuffer
from ckptctl.interop.dcp_check import check_metadata
from ckptctl.interop.steps import StepClue, as_step
from ckptctl.state import tree as statetree
from ckptctl.storage import open_storage
from ckptctl.storage.base import Storage
from ckptctl.storage.stored_file import open_file

METADATA = ".metadata"
# Top-level keys of a ckptctl state never start with "_", so these cannot collide with it.
STATE_KEY = "_ckptctl.state"
STEP_KEY = "_ckptctl.step"
TRAIN_STATE_STEP = ("train_state", "step")  # torchtitan's Checkpointer: states["train_state"]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                              ("collections", "OrderedDict")):
            return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


def read_metadata(where_: "str | Storage") -> Any:
    """DCP's ``.metadata`` of the checkpoint at ``where_`` (a local directory or its
    ``Storage``), unpickled with the restricted unpickler and then checked: every storage
    record is a plain file in the checkpoint with its bytes inside that file, every size and
    chunk is in range. Raises InvalidCheckpoint naming the file and the record."""
    from torch.distributed.checkpoint.metadata import Metadata

    store = open_storage(where_) if isinstance(where_, str) else where_
    where = store.url_of(METADATA)
    f = open_file(store, METADATA)
    if f is None:
        if store.stat(METADATA) is None:
            raise InvalidCheckpoint(f"{where} is missing", hint="the checkpoint is incomplete")
        raise InvalidCheckpoint(f"{where} is not a regular file (a symlink, FIFO, device or directory)",
                                hint="the checkpoint layout was altered; treat it as untrusted")
    with f:
        try:
            md = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError,
                OverflowError, IndexError, KeyError, RuntimeError, RecursionError, MemoryError) as e:
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise InvalidCheckpoint(f"{where}: refusing DCP metadata: {detail}",
                                    hint="the file is not plain DCP metadata; do not trust this checkpoint") from None
    if not isinstance(md, Metadata):
        raise InvalidCheckpoint(f"{where}: refusing DCP metadata: it holds a {type(md).__name__}, not Metadata")
    check_metadata(md, store, where)
    return md


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """DCP's file reader with the restricted metadata unpickler, read once."""

        def __init__(self, path: str, metadata: Any) -> None:
            super().__init__(path)
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self._metadata

    return SafeReader


def _load_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)  # DCP's default would allow any pickle
            self.state_dict[read_item.dest_index.fqn] = obj  # flat: our state dicts are flat

    return SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _quiet() -> Any:
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    return ctx


class DcpSource(Source):
    kind = "dcp"

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        super().__init__()
        self.url = path
        self.md = read_metadata(path)
        self._reader = _reader_class()(path, self.md)
        planner_data = self.md.planner_data if isinstance(self.md.planner_data, dict) else {}
        self._fqn: dict[str, str] = {}
        paths: dict[str, tuple] = {}
        values: dict[tuple, Any] = {}
        saved_tree: Any = None
        for fqn, meta in self.md.state_dict_metadata.items():
            p = tuple(planner_data.get(fqn) or (fqn,))
            name = p[0] if len(p) == 1 else statetree.join(tuple(str(x) for x in p))
            if isinstance(meta, TensorStorageMetadata):
                try:
                    dt = dtypes.name_of(meta.properties.dtype)
                except ValueError:
                    self.dropped.append(f"tensor {fqn!r}: dtype {meta.properties.dtype} is not supported")
                    continue
                if name in self.tensors:
                    raise UsageError(f"{self.url}: entries {self._fqn[name]!r} and {fqn!r} are both named {name!r} "
                                     "(keys that differ only in type); refusing to convert",
                                     hint="rename one of the keys so that every tensor has its own name")
                self.tensors[name] = TensorMeta(name, dt, tuple(meta.size), group_of(name))
                self._fqn[name] = fqn
                paths[name] = p
            elif isinstance(meta, BytesStorageMetadata):
                try:
                    value = self._load_bytes(fqn)
                except pickle.UnpicklingError as e:
                    self.dropped.append(f"{fqn!r}: needs pickle beyond plain values ({str(e).splitlines()[0][:120]})")
                    continue
                if fqn == STATE_KEY and isinstance(value, str):
                    saved_tree = self._saved_tree(value)
                elif fqn == STEP_KEY and as_step(value) is not None:
                    self.step_clues.append(StepClue(value, f"{STEP_KEY} entry"))
                    self.step = value
                else:
                    values[p] = value
        if saved_tree is not None and set(statetree.tensor_refs(saved_tree)) <= set(self.tensors):
            self.tree = saved_tree
        else:
            self.tree = _tree_from_paths(paths, values, self.dropped)
        self._train_state_step(values)

    def _train_state_step(self, values: dict[tuple, Any]) -> None:
        """torchtitan's step: its ``train_state`` entry holds ``{"step": torch.tensor(step,
        dtype=torch.int32), ...}`` (``torchtitan/train.py``; newer releases save a plain int)."""
        flat = ".".join(TRAIN_STATE_STEP)  # the fqn itself, when the metadata has no planner data
        step = as_step(values.get(TRAIN_STATE_STEP, values.get((flat,))))
        name = statetree.join(TRAIN_STATE_STEP) if statetree.join(TRAIN_STATE_STEP) in self.tensors else flat
        meta = self.tensors.get(name)
        if step is None and meta is not None and meta.shape in ((), (1,)) and meta.dtype.startswith(("int", "uint")):
            out = torch.empty(meta.shape, dtype=dtypes.torch_dtype(meta.dtype))
            self.read_into(name, out)
            step = as_step(out)
        if step is not None:
            self.step_clues.append(StepClue(step, "torchtitan train_state step"))

    def _saved_tree(self, text: str) -> Any:
        try:
            tree = parse.load_json(text, self.url, f"{STATE_KEY} entry", max_bytes=1 << 30, allow_nonfinite=True)
            statetree.check(tree, self.url)
        except InvalidCheckpoint as e:
            self.dropped.append(f"{STATE_KEY}: {e}")
            return None
        return tree

    def _load_bytes(self, fqn: str) -> Any:
        sd: dict[str, Any] = {fqn: None}
        self._load(sd, fqn)
        return sd[fqn]

    def read_into(self, name: str, out: torch.Tensor) -> None:
        self._load({self._fqn[name]: out}, self._fqn[name])

    def _load(self, sd: dict[str, Any], fqn: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        ctx = _quiet()
        try:
            dcp.load(sd, storage_reader=self._reader, planner=_load_planner(), no_dist=True)
        except CheckpointException as e:  # a BaseException: DCP wraps each rank's failure in it
            cause: Any = next(iter(e.failures.values()), e) if getattr(e, "failures", None) else e
            if isinstance(cause, tuple):  # (exception, traceback) as DCP records it
                cause = cause[0]
            if isinstance(cause, pickle.UnpicklingError):
                raise cause from None
            detail = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
            files = sorted({str(i.relative_path) for k, i in (self.md.storage_data or {}).items() if k.fqn == fqn})
            raise InvalidCheckpoint(f"{self.url}: entry {fqn!r} (in {', '.join(files) or '?'}) does not load: {detail}",
                                    hint="the .distcp file is truncated or corrupt; DCP has no checksums to say which bytes") from None
        finally:
            ctx.__exit__(None, None, None)


def _tree_from_paths(paths: dict[str, tuple], values: dict[tuple, Any], dropped: list[str]) -> dict:
    """Rebuild the nesting DCP flattened: dict keys, list indices (ints), leaves."""
    from ckptctl.errors import StateError

    root: dict = {}
    leaves = [(p, {statetree.TENSOR: name}) for name, p in paths.items()]
    for p, v in values.items():
        try:
            leaves.append((p, statetree.encode(v, tuple(str(x) for x in p), lambda n, t: None)))
        except StateError as e:
            dropped.append(f"{'/'.join(map(str, p))!r}: {e}")
    for p, leaf in leaves:
        node: Any = root
        for key, nxt in zip(p[:-1], p[1:]):
            child = node.get(key) if isinstance(node, dict) else None
            if child is None:
                child = {}
                node[key] = child
            node = child
        node[p[-1]] = leaf
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts whose keys are exactly 0..n-1 (list indices in DCP paths) become lists."""
    if not isinstance(node, dict) or statetree.TENSOR in node:
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return {str(k): v for k, v in out.items()}


def _placeholder(m: TensorMeta) -> torch.Tensor:
    # DCP plans from shapes and dtypes only; the data comes from the planner's resolve_data.
    return torch.empty(m.shape, dtype=dtypes.torch_dtype(m.dtype), device="meta")


def write_dcp(path: str, metas: dict[str, TensorMeta], fill: Fill, *, tree: Any, step: int | None) -> Written:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingPlanner(DefaultSavePlanner):
        """Hands DCP each tensor only when it is about to be written, and frees the previous
        one: DCP's writer keeps a reference to every tensor of a file until the file is done."""

        prev: torch.Tensor | None = None

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            self.release()
            m = metas[names[id(self.lookup_object(write_item.index))]]
            # Filled through a reusable buffer, then copied into a tensor of its own: byte
            # reads export memory to numpy, which makes a storage impossible to free early.
            view = buf.view(m.dtype, m.shape)
            fill(m, view)
            t = torch.empty(m.shape, dtype=dtypes.torch_dtype(m.dtype))
            t.copy_(view)
            self.prev = t
            return t

        def release(self) -> None:
            if self.prev is not None:
                self.prev.untyped_storage().resize_(0)  # the bytes are in the file already
                self.prev = None

    buf = TensorBuffer()
    holders = {n: _placeholder(m) for n, m in metas.items()}
    names = {id(t): n for n, t in holders.items()}
    state = statetree.decode(tree, lambda n: holders[n])
    if not isinstance(state, dict):
        state = {"state": state}
    state[STATE_KEY] = json.dumps(tree)
    if step is not None:
        state[STEP_KEY] = step
    planner = StreamingPlanner(flatten_state_dict=True, flatten_sharded_tensors=False)
    ctx = _quiet()
    try:
        dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=1, single_file_per_rank=True), planner=planner, no_dist=True)
    except CheckpointException as e:  # a BaseException: it escaped every handler as a traceback
        cause: Any = next(iter(e.failures.values()), e) if getattr(e, "failures", None) else e
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, traceback) as DCP records it
        if isinstance(cause, OSError):
            raise StorageError(f"cannot write {path}: {cause.strerror or cause}",
                               hint="check the destination, its permissions and free space") from None
        if isinstance(cause, (Exception, KeyboardInterrupt)):
            raise cause from None  # ours (a source chunk that failed its checksum) or a bug: as raised
        raise StorageError(f"cannot write {path}: {cause}", hint="check the destination") from None
    finally:
        ctx.__exit__(None, None, None)
        planner.release()
    files = sorted(os.path.join(path, f) for f in os.listdir(path))
    return Written(files, sum(os.path.getsize(f) for f in files))
