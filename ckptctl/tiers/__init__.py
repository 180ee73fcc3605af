"""Tiered checkpointing: commit to a fast first tier, promote to slower ones in the background.

``Checkpointer(tiers=[Tier("/nvme/ckpt", retention=KeepLast(2)), Tier("s3://lab/run7",
retention=KeepLast(3), every=Steps(1000) | Minutes(30))])``. One concept per module:

* ``spec``: ``Tier`` and the cadences (``Steps``, ``Minutes``) a user writes;
* ``pins``: the retention rule that keeps a checkpoint awaiting promotion;
* ``guarded``: library retention of one tier that honours those pins;
* ``promoter``: the background thread that copies one tier's checkpoints to the next;
* ``durability``: time to durable per tier, and what ``close()`` reports;
* ``recovery``: the candidates ``load_latest`` tries, newest step first, nearest tier first;
* ``chain``: the tiers of one ``Checkpointer`` wired together.

May import: ``ops``, ``layouts``, ``storage`` and the leaves (see docs/architecture.md).
"""

from ckptctl.tiers.spec import Cadence, Minutes, Steps, Tier

__all__ = ["Cadence", "Minutes", "Steps", "Tier"]
