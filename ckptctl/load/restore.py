"""Restoring a training state in place from a checkpoint.

Modules and plain tensors are filled where they are: bytes go from storage straight into the
parameter's memory. Optimizers and other stateful objects get a state dict whose tensors were
read into the object's own current tensors where shapes match, then ``load_state_dict``.

``strict=True`` (the default) requires every tensor of the target state to be in the
checkpoint and vice versa. ``strict=False`` loads what matches by name, shape and dtype and
returns the names it skipped, leaving those targets untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ckptctl.errors import StateError
from ckptctl.format import dtypes
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.state import rng, tree
from ckptctl.state.capture import RNG_KEY, kind_of, optimizer_state_dict


@dataclass
class RestoreReport:
    step: int
    skipped: list[str] = field(default_factory=list)  # strict=False: names not loaded


class _Filler:
    """Collects read jobs for every tensor of the state, then reads them in one parallel pass."""

    def __init__(self, reader: CheckpointReader, strict: bool) -> None:
        self.reader = reader
        self.strict = strict
        self.jobs: list[ReadJob] = []
        self.skipped: list[str] = []

    def tensor(self, name: str, target: torch.Tensor | None) -> torch.Tensor | None:
        """Schedule ``name`` into ``target`` (or a new tensor when None). Returns the tensor
        that will hold the data, or None when skipped under strict=False."""
        entry = self.reader.manifest.tensors.get(name)
        if entry is None:
            if self.strict:
                self.reader._entry(name)  # raises the standard "not in checkpoint" error
            self.skipped.append(name)
            return None
        if target is None:
            target = torch.empty(entry.shape, dtype=dtypes.torch_dtype(entry.dtype))
        elif tuple(target.shape) != entry.shape or target.dtype != _dtype(entry.dtype):
            if self.strict:
                raise StateError(
                    f"tensor {name!r}: checkpoint has {entry.dtype}{list(entry.shape)}, the target "
                    f"is {dtypes.name_of(target.dtype)}{list(target.shape)}",
                    hint="the model differs from the checkpoint's; pass strict=False to skip mismatched tensors",
                )
            self.skipped.append(name)
            return None
        self.jobs.append(ReadJob(name, target))
        return target

    def run(self) -> None:
        self.reader.read_many(self.jobs)


def _dtype(name: str) -> torch.dtype:
    return dtypes.torch_dtype(name)


def restore(reader: CheckpointReader, state: dict[str, Any], *, strict: bool = True) -> RestoreReport:
    saved = reader.manifest.state
    fill = _Filler(reader, strict)
    finish: list = []  # load_state_dict calls and assignments, run after the reads
    for key, value in state.items():
        if key not in saved:
            if strict:
                raise StateError(
                    f"state key {key!r} is not in checkpoint {reader.storage.url}",
                    hint="pass strict=False to restore the keys that exist",
                )
            fill.skipped.append(key)
            continue
        doc = saved[key]
        kind = kind_of(value)
        if kind == "module":
            _module(fill, value, doc, key, finish, strict)
        elif kind in ("optimizer", "stateful"):
            current = optimizer_state_dict(value, state, key) if kind == "optimizer" else value.state_dict()
            loaded = _decode_into(fill, doc, current)
            finish.append(lambda v=value, d=loaded, k=kind: _load_stateful(v, d, k, state, key))
        elif kind == "tensor":
            fill.tensor(tree.join((key,)), value)
        elif isinstance(value, dict):
            loaded = _decode_into(fill, doc, value)
            finish.append(lambda v=value, d=loaded: _update_dict(v, d))
        else:
            loaded = _decode_into(fill, doc, None)
            finish.append(lambda k=key, d=loaded: state.__setitem__(k, d))
    if strict:
        extra = set(saved) - set(state)
        if extra:
            raise StateError(
                f"checkpoint {reader.storage.url} has state keys the target lacks: {sorted(extra)}",
                hint="add them to the state passed to load, or pass strict=False",
            )
    fill.run()
    for f in finish:
        f()
    _restore_rng(reader)
    return RestoreReport(reader.manifest.step, fill.skipped)


def _module(fill: _Filler, module: torch.nn.Module, doc: Any, key: str, finish: list, strict: bool) -> None:
    target = module.state_dict()
    if not isinstance(doc, dict):
        raise StateError(f"state key {key!r}: checkpoint does not hold a module state here")
    missing = set(target) - set(doc)
    if missing and strict:
        raise StateError(
            f"module {key!r}: {len(missing)} tensors missing from the checkpoint, e.g. {sorted(missing)[0]!r}",
            hint="the architecture changed; pass strict=False to load the tensors that match",
        )
    non_tensor = {}
    for name, ref in doc.items():
        if name not in target:
            if strict:
                raise StateError(f"module {key!r}: checkpoint has {name!r}, the module does not", hint="pass strict=False to ignore it")
            fill.skipped.append(tree.join((key, name)))
            continue
        if isinstance(target[name], torch.Tensor) and isinstance(ref, dict) and tree.TENSOR in ref:
            fill.tensor(ref[tree.TENSOR], target[name])  # filled in place: no load_state_dict copy
        else:
            non_tensor[name] = ref
    if non_tensor:  # e.g. a module's get_extra_state(): let the module take it
        finish.append(lambda: module.load_state_dict(tree.decode(non_tensor, fill.reader.read), strict=False))


def _decode_into(fill: _Filler, doc: Any, current: Any) -> Any:
    """Decode ``doc``, reading each tensor into the matching tensor of ``current`` if any."""

    def walk(d: Any, cur: Any) -> Any:
        if isinstance(d, dict) and len(d) == 1 and tree.TENSOR in d:
            target = cur if isinstance(cur, torch.Tensor) else None
            got = fill.tensor(d[tree.TENSOR], target)
            return got if got is not None else cur
        if isinstance(d, dict) and len(d) == 1 and tree.TUPLE in d:
            cur_l = list(cur) if isinstance(cur, (list, tuple)) else []
            return tuple(walk(v, cur_l[i] if i < len(cur_l) else None) for i, v in enumerate(d[tree.TUPLE]))
        if isinstance(d, dict) and len(d) == 1 and tree.ITEMS in d:
            cur_d = cur if isinstance(cur, dict) else {}
            return {k: walk(v, cur_d.get(k)) for k, v in d[tree.ITEMS]}
        if isinstance(d, dict):
            cur_d = cur if isinstance(cur, dict) else {}
            return {k: walk(v, cur_d.get(k)) for k, v in d.items()}
        if isinstance(d, list):
            cur_l = cur if isinstance(cur, list) else []
            return [walk(v, cur_l[i] if i < len(cur_l) else None) for i, v in enumerate(d)]
        return d

    return walk(doc, current)


def _load_stateful(value: Any, loaded: Any, kind: str, state: dict[str, Any], key: str) -> None:
    if kind == "optimizer":
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from ckptctl.state.capture import model_for

        model = model_for(value, state, key)
        if model is not None:
            set_optimizer_state_dict(model, value, loaded)
            return
    value.load_state_dict(loaded)


def _update_dict(target: dict, loaded: dict) -> None:
    for k, v in loaded.items():
        if isinstance(target.get(k), torch.Tensor) and target[k] is v:
            continue  # filled in place
        if isinstance(target.get(k), dict) and isinstance(v, dict):
            _update_dict(target[k], v)
        else:
            target[k] = v


def _restore_rng(reader: CheckpointReader) -> None:
    from ckptctl.state.ranks import current_rank

    states = reader.rank_states()
    mine = states.get(current_rank()) or states.get(0)
    if mine and RNG_KEY in mine:
        rng.set_state(mine[RNG_KEY])
