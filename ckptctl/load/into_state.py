"""Loading a training state in place from a checkpoint: ``load_into(reader, state)``.

Modules and plain tensors are filled where they are: bytes go from storage straight into the
parameter's memory. Optimizers and other stateful objects get a state dict whose tensors were
read into the object's own current tensors where shapes match, then ``load_state_dict``.

``strict=True`` (the default) requires every tensor of the target state to be in the
checkpoint and vice versa. ``strict=False`` loads what matches by name, shape and dtype and
returns the names it skipped, leaving those targets untouched.

Re-sharding: a DTensor target (FSDP2, tensor parallel) is filled by reading only its local
region of the global tensor, whatever the world size and sharding at save time; a plain
target is read whole. So a checkpoint saved by 4 ranks loads on 3, 2 or 1, and a DDP-saved
one into an FSDP2 model and back: the names are the same (``get_model_state_dict``).

Per-rank state, when loading as rank ``r`` of a job of any size:

- data loader, scheduler, ``extra`` and other non-module, non-optimizer keys: rank ``r``'s own
  copy from rank ``r``'s shard header when the checkpoint was saved by more than ``r`` ranks;
  otherwise rank 0's copy (the one in the manifest), with a warning on the "ckptctl" logger,
  since a data position that belonged to another rank is a choice the user should know about;
- RNG states: rank ``r``'s when saved, else rank 0's, with the same warning.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ckptctl.errors import InvalidCheckpoint, StateError
from ckptctl.format import dtypes
from ckptctl.load.reader import CheckpointReader, ReadJob
from ckptctl.load.staged import HostLender, StagedLoad
from ckptctl.state import rng, tree
from ckptctl.state.capture import RNG_KEY, model_for, module_state_dict, optimizer_state_dict
from ckptctl.state.per_rank import RANK_STATE_KEY, per_rank_values
from ckptctl.state.roles import Role, role_of

log = logging.getLogger("ckptctl")


@dataclass
class LoadResult:
    step: int
    skipped: list[str] = field(default_factory=list)  # strict=False: names not loaded


class _Filler:
    """Collects read jobs for every tensor of the state: ``live`` ones fill the caller's tensors,
    ``fresh`` ones tensors made here (no one else holds them until the load is applied)."""

    def __init__(self, reader: CheckpointReader, strict: bool) -> None:
        self.reader = reader
        self.strict = strict
        self.live: list[ReadJob] = []
        self.fresh: list[ReadJob] = []
        self.skipped: list[str] = []

    @property
    def jobs(self) -> list[ReadJob]:
        return [*self.live, *self.fresh]

    def tensor(self, name: str, target: torch.Tensor | None) -> torch.Tensor | None:
        """Schedule ``name`` into ``target`` (or a new tensor when None). Returns the tensor
        that will hold the data, or None when skipped under strict=False."""
        entry = self.reader.manifest.tensors.get(name)
        if entry is None:
            if self.strict:
                self.reader.tensor(name)  # raises the standard "not in checkpoint" error
            self.skipped.append(name)
            return None
        if target is None:
            target = torch.empty(entry.shape, dtype=dtypes.torch_dtype(entry.dtype))
            self.fresh.append(ReadJob(name, target))
            return target
        if _is_dtensor(target):
            if tuple(target.shape) != entry.shape or target.dtype != _dtype(entry.dtype):
                return self._mismatch(name, entry, target)
            local, offsets = _local_region(target)
            if local.numel():
                self.live.append(ReadJob(name, local, offsets))
            return target
        if tuple(target.shape) != entry.shape or target.dtype != _dtype(entry.dtype):
            return self._mismatch(name, entry, target)
        self.live.append(ReadJob(name, target.detach()))
        return target

    def _mismatch(self, name: str, entry, target: torch.Tensor) -> None:
        if self.strict:
            raise StateError(
                f"tensor {name!r}: checkpoint has {entry.dtype}{list(entry.shape)}, the target "
                f"is {dtypes.name_of(target.dtype)}{list(target.shape)}",
                hint="the model differs from the checkpoint's; pass strict=False to skip mismatched tensors",
            )
        self.skipped.append(name)
        return None


def _dtype(name: str) -> torch.dtype:
    return dtypes.torch_dtype(name)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A DTensor's local shard (sharing its memory, so the read fills it in place) and where
    that shard starts in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local().detach(), tuple(int(o) for o in offsets)


def load_into(reader: CheckpointReader, state: dict[str, Any], *, strict: bool = True, rank: int = 0,
              host: HostLender | None = None) -> LoadResult:
    """Fill ``state`` in place as rank ``rank`` of the loading job (see the module docstring
    for which rank's per-rank state it gets).

    All or nothing: first every record this rank will apply is decoded (per-rank state, RNG
    states, module extra state) and every chunk its tensors need is read and checked against
    its checksum, changing nothing in ``state``; only then are the tensors filled and the rest
    applied, RNG last. So a corrupt checkpoint raises before the first byte of ``state``
    changes, and a fallback to an older one leaves exactly that one's state.

    With ``host`` (memory lent for the load: the ``Checkpointer``'s staging buffer) each byte is
    read once, into that memory, checked there and then copied into place (``load.staged``).
    Without it, or when it lends nothing, every chunk is read and checked, then read again into
    place and checked again: memory stays one piece buffer per thread, and the second read
    comes from the page cache, or from a local spool for remote files (``load.spool``);
    ``docs/decisions.md``, "All-or-nothing loads in one pass"."""
    saved = reader.manifest.state
    fill = _Filler(reader, strict)
    rank_states = reader.rank_states((rank, 0))  # its own shard's and rank 0's headers only
    own = _own_state(rank_states, rank, reader)
    restore_rng = _staged_rng(rank_states, rank, reader)
    finish: list = []  # load_state_dict calls and assignments, run after the reads
    for key, value in state.items():
        if key in saved:
            _schedule(fill, state, key, value, saved[key], own, finish, strict)
        elif strict:
            raise StateError(
                f"state key {key!r} is not in checkpoint {reader.storage.url}",
                hint="pass strict=False to restore the keys that exist",
            )
        else:
            fill.skipped.append(key)
    if strict and set(saved) - set(state):
        raise StateError(
            f"checkpoint {reader.storage.url} has state keys the target lacks: {sorted(set(saved) - set(state))}",
            hint="add them to the state passed to load, or pass strict=False",
        )
    staged = _fetch_staged(reader, fill, host)  # None: nothing lent
    if staged is None:
        reader.verify_many(fill.jobs)  # every chunk read and checked; nothing applied yet
    # --- apply: from here on, the checkpoint has been proven ------------------------------
    _warn_borrowed(reader, state, rank_states, own, rank)
    if staged is not None:
        staged.apply()
    else:
        reader.read_many(fill.jobs)
    for f in finish:
        f()
    restore_rng()
    return LoadResult(reader.manifest.step, fill.skipped)


def _fetch_staged(reader: CheckpointReader, fill: _Filler, host: HostLender | None) -> StagedLoad | None:
    """Every chunk read once and checked, the live targets' bytes into memory ``host`` lends;
    None (nothing read) when there is no lender or it lends nothing."""
    if host is None:
        return None
    staged = StagedLoad(reader, fill.live, fill.fresh)
    region = host(staged.nbytes, staged.cuda_device, staged.remote) if staged.nbytes else None
    if staged.nbytes and region is None:
        return None
    staged.fetch(region)
    return staged


@contextlib.contextmanager
def _decoding(where: str) -> Iterator[None]:
    """The boundary where the checkpoint's own records are decoded: any error from a record
    that does not decode (the typed parsers cover most; this is the net under them) is that
    checkpoint being corrupt, so a load falls back instead of crashing. User code (state_dict,
    load_state_dict) never runs inside it."""
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError, struct.error) as e:
        # UnicodeDecodeError and binascii.Error are ValueErrors.
        raise InvalidCheckpoint(
            f"{where}: cannot be decoded ({type(e).__name__}: {e})",
            hint="the checkpoint is corrupt; resume from an older checkpoint",
        ) from None


def _own_state(rank_states: dict[int, dict], rank: int, reader: CheckpointReader) -> dict[str, Any]:
    """This rank's own copy of its per-rank state, from its shard header; empty if none."""
    mine = rank_states.get(rank, {})
    if RANK_STATE_KEY not in mine:
        return {}
    where = f"{reader.storage.url}: rank {rank}'s per-rank state"
    with _decoding(where):
        return per_rank_values(mine[RANK_STATE_KEY], where)


def _warn_borrowed(reader: CheckpointReader, state: dict[str, Any], rank_states: dict[int, dict], own: dict[str, Any], rank: int) -> None:
    """Tell the user which per-rank state this rank takes from rank 0's copy."""
    saved = reader.manifest.state
    # Keys that were saved per rank (rank 0's header lists them).
    per_rank = set(rank_states.get(0, {}).get(RANK_STATE_KEY, {}).get("tree", {}))
    if rank >= reader.manifest.world_size:
        # This rank did not exist at save time (a 1-rank checkpoint keeps no per-rank copies at
        # all): every key that is per-rank state comes from rank 0's copy.
        per_rank |= {k for k, v in state.items() if k in saved and role_of(v) not in ("module", "optimizer", "tensor")}
    borrowed = sorted(k for k in state if k in per_rank and k not in own)
    if not borrowed:
        return
    resharded = reader.manifest.extra.get("resharded_from")
    before = resharded.get("world_size") if isinstance(resharded, dict) else None
    if isinstance(before, int) and before <= rank < reader.manifest.world_size:
        # ``ckptctl reshard`` gave the ranks the source job did not have no state of their own.
        log.warning("rank %d: %s was resharded from %d to %d ranks, and rank %d had no per-rank state in the "
                    "%d-rank job; restoring rank 0's copy of %s", rank, reader.storage.url, before,
                    reader.manifest.world_size, rank, before, ", ".join(borrowed))
    else:
        log.warning("rank %d: %s has no state saved by rank %d (saved by %d ranks); restoring rank 0's copy of %s",
                    rank, reader.storage.url, rank, reader.manifest.world_size, ", ".join(borrowed))


def _schedule(fill: _Filler, state: dict[str, Any], key: str, value: Any, doc: Any, own: dict[str, Any], finish: list, strict: bool) -> None:
    """Queue the reads of one state key's tensors, and what to do with them once read."""
    role = role_of(value)
    if role == "module":
        _module(fill, value, doc, key, finish, strict)
    elif role not in ("optimizer", "tensor") and key in own:
        # This rank's own copy of per-rank state: no shared tensors to read.
        finish.append(lambda: _set_own(state, key, value, own[key], role))
    elif role in ("optimizer", "stateful"):
        current = optimizer_state_dict(value, state, key, for_load=True) if role == "optimizer" else value.state_dict()
        loaded = _decode_into(fill, doc, current)
        finish.append(lambda: _load_stateful(value, loaded, role, state, key))
    elif role == "tensor":
        fill.tensor(tree.join((key,)), value)
    elif isinstance(value, dict):
        loaded = _decode_into(fill, doc, value)
        finish.append(lambda: _update_dict(value, loaded))
    else:
        loaded = _decode_into(fill, doc, None)
        finish.append(lambda: state.__setitem__(key, loaded))


def _set_own(state: dict[str, Any], key: str, value: Any, loaded: Any, role: Role) -> None:
    if role == "stateful":
        value.load_state_dict(loaded)
    elif isinstance(value, dict) and isinstance(loaded, dict):
        _update_dict(value, loaded)
    else:
        state[key] = loaded


def _module(fill: _Filler, module: torch.nn.Module, doc: Any, key: str, finish: list, strict: bool) -> None:
    target = module_state_dict(module)  # canonical names, as saved; DTensors stay sharded
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
    if non_tensor:  # e.g. a module's get_extra_state(): read (verified) now, given to the module last
        with _decoding(f"{fill.reader.storage.url}: module {key!r}'s extra state"):
            extra = tree.decode(non_tensor, fill.reader.read)
        finish.append(lambda: module.load_state_dict(extra, strict=False))


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


def _load_stateful(value: Any, loaded: Any, role: Role, state: dict[str, Any], key: str) -> None:
    if role == "optimizer":
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

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


def _staged_rng(states: dict[int, dict], rank: int, reader: CheckpointReader) -> Callable[[], None]:
    """The RNG states this rank will restore, decoded and validated now (``InvalidCheckpoint``
    if malformed); the returned call sets them (and warns when they are rank 0's)."""
    src = rank
    mine = states.get(rank)
    if not (mine and RNG_KEY in mine):
        src, mine = 0, states.get(0)
    if not (mine and RNG_KEY in mine):
        return lambda: None
    decoded = rng.decode(mine[RNG_KEY], f"{reader.storage.url}: rank {src}'s RNG state")

    def restore() -> None:
        if src != rank:
            log.warning("rank %d: %s has no RNG state of rank %d; restoring rank 0's", rank, reader.storage.url, rank)
        decoded.apply()

    return restore
