"""The one vocabulary of checkpoint format names, for every option and output that names one.

A name says whose checkpoint it is. Some name a *layout* of a root (which directories are
checkpoints and when one is complete: ``latest --format``, ``repoint --format``, the FORMAT of
``ls``, ``layouts.catalog``); some a *file format* a checkpoint can be read from or written to
(``convert --to``, what ``layouts.classify`` finds a file to be); ``ckptctl`` and ``dcp`` are both. Whatever
the option, a name means the same thing, so ``latest --format dcp`` and ``convert --to dcp``
speak of the same checkpoints, and a name of the other kind is refused saying what it names.

Aliases are other spellings people type (``torchtitan`` for its DCP checkpoints, ``hf`` for
the Hugging Face Trainer, ``pt`` for ``torch.save`` files); every canonical name stays
accepted as it is. Pure: names in, names out, ValueError for an unknown one.
"""

from __future__ import annotations

from typing import Iterable

CKPTCTL = "ckptctl"
DCP = "dcp"  # PyTorch Distributed Checkpoint; torchtitan's step-N directories hold one each
SAFETENSORS = "safetensors"
TORCH = "torch"  # a torch.save file
HF_TRAINER = "hf-trainer"
MEGATRON = "megatron"
DEEPSPEED = "deepspeed"
LIGHTNING = "lightning"
ACCELERATE = "accelerate"  # Hugging Face Accelerate save_state directories
COMPOSER = "composer"  # MosaicML Composer ep{E}-ba{B}-rank{R}.pt files
NEMO = "nemo"  # NVIDIA NeMo checkpoint directories and .nemo files

# The built-in layouts, in the order listings and messages show them (ckptctl's own first).
# Third-party layouts (``layouts.registry``) add their own names after these: the full list is
# the caller's (``layouts.catalog.FORMATS``), passed here as ``among``.
LAYOUT_NAMES: tuple[str, ...] = (CKPTCTL, DCP, HF_TRAINER, MEGATRON, DEEPSPEED, LIGHTNING, ACCELERATE, COMPOSER,
                                  NEMO)
FILE_FORMATS: tuple[str, ...] = (CKPTCTL, DCP, SAFETENSORS, TORCH)
NAMES: tuple[str, ...] = tuple(dict.fromkeys(LAYOUT_NAMES + FILE_FORMATS))

ALIASES: dict[str, str] = {
    "torchtitan": DCP,
    "hf": HF_TRAINER,
    "huggingface": HF_TRAINER,
    "hf_trainer": HF_TRAINER,
    "megatron-lm": MEGATRON,
    "pt": TORCH,
    "pth": TORCH,
    "torch.save": TORCH,
}


def _kind(name: str) -> str:
    return "a file format" if name in FILE_FORMATS else "a layout of a root"


def canonical(name: str, among: Iterable[str] = ()) -> str | None:
    """The canonical name ``name`` stands for (any case, an alias or the name itself), or None.
    A name of ``among`` that the vocabulary does not know (a plugin layout's) stands for itself."""
    key = name.strip().lower()
    return key if key in NAMES or key in among else ALIASES.get(key)


def names_among(names: Iterable[str], among: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` as canonical names, each of which must be one of ``among`` (the layouts'
    names, ``LAYOUT_NAMES`` and any plugin's, or ``FILE_FORMATS``); duplicates dropped, order
    kept. Raises ValueError naming every name that is unknown, or known but of the other kind,
    and what is accepted."""
    out: list[str] = []
    bad: list[str] = []
    for name in names:
        found = canonical(name, among)
        if found is None:
            bad.append(f"unknown format {name!r}")
        elif found not in among:  # a name of the other kind (ckptctl and dcp are both, never here)
            wanted = "a file format" if set(among) <= set(FILE_FORMATS) else "a layout of a root"
            bad.append(f"{name!r} names {_kind(found)}, not {wanted}")
        elif found not in out:
            out.append(found)
    if bad:
        raise ValueError(f"{'; '.join(bad)}; known: {', '.join(among)}")
    return tuple(out)


def name_among(name: str, among: tuple[str, ...]) -> str:
    """One name, as ``names_among``."""
    return names_among([name], among)[0]
