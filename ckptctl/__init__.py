"""ckptctl: asynchronous sharded checkpoints you can trust.

>>> from ckptctl import Checkpointer
>>> ckpt = Checkpointer("/tmp/ckpt")                           # doctest: +SKIP
>>> ckpt.save(100, {"model": model, "optimizer": opt}).wait()  # doctest: +SKIP
"""

from ckptctl.version import __version__

__all__ = ["Checkpointer", "SaveHandle", "__version__"]


def __getattr__(name: str):
    # Lazy: `ckptctl --help` should not pay for importing torch.
    if name in ("Checkpointer", "SaveHandle"):
        from ckptctl import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(name)
