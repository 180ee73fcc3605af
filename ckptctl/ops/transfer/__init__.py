"""Moving checkpoints between storages: ``cp``, ``restore`` and ``sync``, every byte checked on
the way and the commit file written last.

* ``copy``: one ckptctl checkpoint (``copy_checkpoint``, ``restore_latest``);
* ``stack_copy`` and ``file_copy``: another tool's checkpoint, a directory or one file;
* ``sync`` and ``stack_sync``: a whole root mirrored, ckptctl's own then the other stacks';
* ``uploads``: unfinished S3 multipart uploads a killed writer left, and aborting them;
* ``node_restore`` and ``node_reshard``: ``restore`` under torchrun, each node getting only its
  ranks' shards (copied, or re-sharded straight from the source).

May import: ``format``, ``storage``, ``layouts``, ``ops.verify``, ``ops.seal``,
``ops.transform`` (a re-sharding restore), ``ops.lock`` (sync takes the root's lock),
``ops.listing``, ``ops.targets``, ``ops.distributed`` (work split over torchrun
ranks), ``load`` and ``state`` (a node's shards re-sharded from the source) and the leaves;
never ``cli``.
"""
