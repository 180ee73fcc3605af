"""Moving checkpoints between storages: ``cp``, ``restore`` and ``sync``, every byte checked on
the way and the commit file written last.

* ``engine``: the one copy engine every copy goes through (cp, restore, sync, tier promotion),
  driven by each checkpoint's layout (``layouts.base``, its copying section); ``files``: its
  file copier (each file streamed, checked, published without replacing anything);
  ``first_look``: its verdict on the destination, asked beside the copy's first questions;
* ``copy``: ``cp`` and ``restore`` of one checkpoint of any layout;
* ``sync``: a whole root mirrored, every layout's checkpoints;
* ``uploads``: unfinished S3 multipart uploads a killed writer left, and aborting them;
* ``staging``: the names of a re-sharding restore's staging copies, one per run;
* ``node_restore`` and ``node_reshard``: ``restore`` under torchrun, each node getting only its
  ranks' shards (copied, or re-sharded straight from the source).

May import: ``format``, ``storage``, ``layouts``, ``ops.verify``, ``ops.seal``,
``ops.transform`` (a re-sharding restore), ``ops.lock`` (sync takes the root's lock),
``ops.listing``, ``ops.targets``, ``ops.distributed`` (work split over torchrun
ranks), ``load`` and ``state`` (a node's shards re-sharded from the source) and the leaves;
never ``cli``.
"""
