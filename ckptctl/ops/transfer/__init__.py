"""Moving checkpoints between storages: ``cp``, ``restore`` and ``sync``, every byte checked on
the way and the commit file written last.

* ``copy``: one ckptctl checkpoint (``copy_checkpoint``, ``restore_latest``);
* ``stack_copy`` and ``file_copy``: another tool's checkpoint, a directory or one file;
* ``sync`` and ``stack_sync``: a whole root mirrored, ckptctl's own then the other stacks';
* ``uploads``: unfinished S3 multipart uploads a killed writer left, and aborting them.

May import: ``format``, ``storage``, ``layouts``, ``ops.verify``, ``ops.seal``,
``ops.transform`` (a re-sharding restore), ``ops.retention.lock`` (sync takes the root's lock),
``ops.listing``, ``ops.targets``, ``ops.expect`` and the leaves; never ``cli``.
"""
