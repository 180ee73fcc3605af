"""ckptctl: asynchronous sharded checkpoints you can trust.

>>> from ckptctl import Checkpointer, KeepBest, KeepLast
>>> ckpt = Checkpointer("/tmp/ckpt", retention=KeepLast(3) | KeepBest(2, "val_loss"))  # doctest: +SKIP
>>> ckpt.save(100, {"model": model, "optimizer": opt}, metrics={"val_loss": 0.21}).wait()  # doctest: +SKIP
"""

from ckptctl.version import __version__

# The retention rules: the same objects ``ckptctl prune`` builds from its options.
_RETENTION = ("AnyOf", "KeepBest", "KeepCalendar", "KeepEvery", "KeepLast", "KeepSteps", "KeepWithin",
              "Policy", "RetentionPolicy")

# Tiers: ``Checkpointer(tiers=[Tier(...), Tier(..., every=Steps(1000) | Minutes(30))])``.
_TIERS = ("Minutes", "Steps", "Tier")

__all__ = ["Checkpointer", "SaveHandle", "__version__", *_RETENTION, *_TIERS]


def __getattr__(name: str):
    # Lazy: `ckptctl --help` should not pay for importing torch.
    if name in ("Checkpointer", "SaveHandle"):
        from ckptctl import checkpointer

        return getattr(checkpointer, name)
    if name in _RETENTION:  # pure Python: no torch
        from ckptctl.ops.retention import policies as retention

        return getattr(retention, name)
    if name in _TIERS:  # pure Python: no torch
        from ckptctl import tiers

        return getattr(tiers, name)
    raise AttributeError(name)
