"""The structural decode of a pickle that ``torch.load(weights_only=True)`` refuses: its opcode
stream is walked with ``pickletools.genops``, which parses opcodes and executes nothing.

A record or file that needs a class outside the layout's test-load allow-list (torchtitan's
``train_state`` holds ``io.BytesIO`` values; the Trainer's ``training_args.bin`` is a
``TrainingArguments``) is still not a blind spot: the stream must parse opcode by opcode, end
in STOP with nothing after it, and every class it names (GLOBAL, STACK_GLOBAL) must be on the
layout's list of known-harmless or framework classes (``STRUCTURAL``, per layout). Such a
stream counts as *decoded structurally*; an unlisted class or a broken stream (a zeroed or
truncated record) does not, and the load level reports the file as not decoded.

A ``torch.save`` zip is opened with ``zipfile`` (its members' CRC-32s checked as they are
read) and its ``data.pkl`` walked; every tensor storage the pickle refers to by persistent id
must be a member of the archive.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickletools
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable

# Classes each layout's files are known to pickle beyond what torch's weights-only unpickler
# builds. Listed by name only: nothing here is imported, and nothing is ever called.
_BYTES_IO = "_io.BytesIO"  # DCP saves a Stateful's BytesIO values (torchtitan train_state, TE _extra_state)
STRUCTURAL: dict[str, frozenset[str]] = {
    "dcp": frozenset({_BYTES_IO}),
    "megatron": frozenset({_BYTES_IO, "argparse.Namespace", "megatron.core.enums.ModelType",
                           "megatron.core.transformer.enums.AttnBackend",
                           "megatron.core.transformer.enums.AttnMaskType"}),
    "hf-trainer": frozenset({"argparse.Namespace", "transformers.training_args.TrainingArguments",
                             "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
                             "transformers.training_args.OptimizerNames", "transformers.trainer_utils.IntervalStrategy",
                             "transformers.trainer_utils.SaveStrategy", "transformers.trainer_utils.HubStrategy",
                             "transformers.trainer_utils.SchedulerType", "transformers.trainer_utils.FSDPOption",
                             "transformers.debug_utils.DebugOption", "transformers.trainer_pt_utils.AcceleratorConfig",
                             "accelerate.utils.dataclasses.DistributedType", "accelerate.state.PartialState"}),
    "deepspeed": frozenset({"argparse.Namespace", "deepspeed.runtime.zero.config.ZeroStageEnum",
                            "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                            "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}),
    "lightning": frozenset({"lightning.fabric.utilities.data.AttributeDict",
                            "lightning_fabric.utilities.data.AttributeDict"}),
}
# Plain builtins a protocol-2 pickle names for sets, bytes and objects' default reduction.
_PLAIN = frozenset({"builtins.set", "builtins.frozenset", "builtins.bytearray", "builtins.complex", "builtins.slice",
                    "builtins.object", "copyreg._reconstructor", "copyreg.__newobj__", "_codecs.encode",
                    "collections.OrderedDict", "collections.Counter", "collections.defaultdict"})
MAX_PICKLE = 256 << 20  # a pickle stream this large is no record a stack writes
MAX_OPS = 50_000_000  # far beyond any real record; a hostile stream cannot spin forever
_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING")
_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")
_GETS = ("GET", "BINGET", "LONG_BINGET")


@dataclass(frozen=True)
class Scan:
    """The outcome of a structural decode: ``problem`` None means decoded structurally."""

    problem: str | None
    classes: tuple[str, ...] = ()  # the classes the stream names, beyond torch's own


def torch_allowed() -> frozenset[str]:
    """What torch's weights-only unpickler builds (tensors, storages, dtypes, containers)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        return frozenset(_get_allowed_globals())
    except (ImportError, AttributeError):  # a torch without that table: tensors only
        return frozenset({"torch._utils._rebuild_tensor_v2", "torch.storage.UntypedStorage", "torch.Size"})


def _canonical(module: str, name: str) -> str:
    """``module.name`` as Python 3 spells it (protocol 2 writes ``__builtin__``, ``copy_reg``)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def scan_pickle(data: bytes, allowed: Iterable[str]) -> tuple[Scan, set[str]]:
    """Walk one pickle stream. Returns the scan and the storage keys its persistent ids name
    (torch's ``('storage', TYPE, KEY, LOCATION, NUMEL)``: the KEY, the third string pushed)."""
    ok = frozenset(allowed) | torch_allowed() | _PLAIN
    named: list[str] = []
    keys: set[str] = set()
    recent: list[Any] = []  # values of the last pushes, for STACK_GLOBAL and persistent ids
    memo: dict[int, Any] = {}
    stream = io.BytesIO(data)
    end = -1
    try:
        for count, (op, arg, pos) in enumerate(pickletools.genops(stream)):
            if count > MAX_OPS:
                return Scan(f"more than {MAX_OPS} opcodes"), keys
            if op.name in ("GLOBAL", "INST"):
                module, _, name = str(arg).partition(" ")
                named.append(_canonical(module, name))
            elif op.name in ("EXT1", "EXT2", "EXT4"):
                # copyreg's extension registry names a class by a number: which one cannot be read
                return Scan(f"byte {pos}: {op.name} names a class by extension code, not by name"), keys
            elif op.name == "STACK_GLOBAL":
                if len(recent) < 2 or not all(isinstance(v, str) for v in recent[-2:]):
                    return Scan(f"byte {pos}: STACK_GLOBAL whose class cannot be read from the stream"), keys
                named.append(_canonical(recent[-2], recent[-1]))
            elif op.name in _STRINGS:
                recent.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
            elif op.name in _PUTS or op.name == "MEMOIZE":
                memo[len(memo) if op.name == "MEMOIZE" else int(arg)] = recent[-1] if recent else None
                continue  # a memo write does not push
            elif op.name in _GETS:
                recent.append(memo.get(int(arg)))
            elif op.name in ("BINPERSID", "PERSID"):
                # torch: MARK 'storage' GLOBAL(type) KEY LOCATION NUMEL TUPLE, then BINPERSID
                at = [i for i, v in enumerate(recent) if v == "storage"]
                if not at or at[-1] + 2 >= len(recent) or not isinstance(recent[at[-1] + 2], str):
                    return Scan(f"byte {pos}: a persistent id that is not a torch storage reference"), keys
                keys.add(recent[at[-1] + 2])
            elif op.name == "STOP":
                end = pos + 1
            if op.name not in _STRINGS and op.name not in _GETS:
                recent.append(None if op.name not in ("BININT", "BININT1", "BININT2", "LONG1") else arg)
            del recent[:-8]
    except (ValueError, EOFError, UnicodeDecodeError, IndexError, KeyError, TypeError) as e:
        # genops raises ValueError for an unknown opcode or a stream that ends inside one
        return Scan(f"not a whole pickle stream: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"), keys
    if end < 0:
        return Scan("the pickle stream has no STOP (truncated)"), keys
    if end != len(data):
        return Scan(f"{len(data) - end} bytes after the pickle's STOP"), keys
    unlisted = sorted({n for n in named if n not in ok})
    extra = tuple(sorted({n for n in named if n not in torch_allowed() and n not in _PLAIN}))
    if unlisted:
        return Scan(f"pickle of {', '.join(unlisted[:3])}, a class outside the allow-list", extra), keys
    return Scan(None, extra), keys


def scan_torch_bytes(raw: bytes, allowed: Iterable[str]) -> Scan:
    """``scan_torch`` of a ``torch.save`` output held in memory (a DCP record)."""
    return scan_torch(io.BytesIO(raw), allowed)


def scan_torch(f: BinaryIO, allowed: Iterable[str]) -> Scan:
    """The structural decode of a ``torch.save`` output (a DCP record, a file): a zip archive's
    ``data.pkl``, with every member's CRC-32 checked as it is read and every storage the pickle
    names present; or a bare pickle. The legacy format's several streams are not decoded."""
    f.seek(0)
    head = f.read(4)
    f.seek(0)
    if head[:2] == b"\x80\x02":
        scan, _ = scan_pickle(f.read(MAX_PICKLE + 1), allowed)
        if scan.problem is not None and "after the pickle's STOP" in scan.problem:
            return Scan("a legacy (pre-zip) torch.save file: its several pickles are not decoded structurally")
        return scan
    if head != b"PK\x03\x04":
        return Scan("neither a torch.save zip archive nor a pickle (zeroed or overwritten)")
    try:
        with zipfile.ZipFile(f) as z:
            names = z.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                return Scan("the archive has no single <name>/data.pkl")
            prefix = pkl[0][: -len("data.pkl")]
            if z.getinfo(pkl[0]).file_size > MAX_PICKLE:
                return Scan(f"data.pkl is larger than {MAX_PICKLE >> 20} MiB")
            scan, keys = scan_pickle(z.read(pkl[0]), allowed)  # ZipFile.read checks the CRC-32
            for key in sorted(keys):
                if f"{prefix}data/{key}" not in names:
                    return Scan(f"the pickle names tensor storage {key!r}, which the archive lacks")
            for name in names:  # every member read once: its CRC-32 checked, in bounded pieces
                with z.open(name) as m:
                    while m.read(8 << 20):
                        pass
            return scan
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError, OSError) as e:
        return Scan(f"not a whole torch.save archive: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")


def allowed_for(layout: str, extra: Iterable[Any] = ()) -> frozenset[str]:
    """The structural allow-list of ``layout``: its named classes plus its test-load allow-list."""
    names = set(STRUCTURAL.get(layout, frozenset()))
    for a in extra:
        names.add(str(a[1]) if isinstance(a, tuple) else
                  f"{getattr(a, '__module__', '?')}.{getattr(a, '__qualname__', getattr(a, '__name__', '?'))}")
    return frozenset(names)
