"""Transforms: a checkpoint rewritten into another shape, streaming, every byte checked.

* ``reshard``: the same checkpoint for another world size (``ckptctl reshard``);
* ``convert``: into another file format, or from another tool's (``ckptctl convert``), with
  ``convert_tree`` for the state tree's names (``--only``, ``--strip-prefix``) and
  ``convert_target`` for where and how the target is written;
* ``stream_shard``: writing one shard in two passes with bounded memory, and
  ``reshard_source``: checking the source chunks as they are read;
* ``safety``: what both keep around what they write: a new target, never the source, a
  verified source, a result verified before success (its marker removed if it fails).

May import: ``format``, ``storage``, ``load``, ``state``, ``interop``, ``layouts``,
``ops.verify`` (a source is verified before it is read), ``ops.distributed`` (reshard's
collectives under torchrun, each bounded by the ranks' presence) and the leaves; never ``cli``
nor the rest of ``ops`` (docs/architecture.md).
"""
