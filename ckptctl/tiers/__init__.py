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

A node-local first tier (``Tier("/nvme/ckpt", node_local=True)``: each node's disk holds its
own ranks' shards plus the manifest and marker) is wired by ``node_chain`` from:

* ``channel``: rank 0's messages and each rank's replies, through the c10d store;
* ``stream``: one numbered stream of it (rank 0's ``Outbox``, each rank's ``StreamWorker``
  thread), and how long each store key lives;
* ``link``: one thread's store connection, made again after a network error, and the pool;
* ``health``: the tier threads in trouble, as ``save()``, ``health()`` and ``close()`` tell;
* ``liveness``: a slow rank told from a dead one while rank 0 waits for a round;
* ``promotion_round``: one promotion, every rank uploading its own shards, rank 0's marker last;
* ``upload``: one rank's shard files copied to the next tier, checked on the way;
* ``node_commit``: when a node's copy of a checkpoint counts as committed there;
* ``node_retention``: rank 0 plans, each node verifies its part of the newest and deletes;
* ``leftovers``: abandoned partial steps (a node's failed save, a promotion round's objects on
  the next tier) removed by ``ckptctl prune``'s partial rules and its ``execute``;
* ``node_keeper``: the thread on each node's leader that applies rank 0's commits and prunes;
* ``layered``: the recovery view, each file from the nearest tier that holds it;
* ``node_resume``: what a rank reads when it resumes: the candidates, the view of each, the
  damaged copies it sets aside, and where its files came from.

Peer replicas (``Tier(..., node_local=True, replicas=1)``: each node also keeps the shards of
the node before it in a ring), wired by ``node_chain`` from:

* ``replica_link``: the ring (each rank's partner and source) and files sent rank to rank
  over the replicas' own gloo group, in bounded chunks, every wait bounded;
* ``replica_store``: where a node keeps replicas (``<root>/.ckptctl-replicas/<step>/``), the
  marker that makes one count, and their removal with their steps;
* ``replica``: the round after each commit, on every rank's replica thread;
* ``replica_recovery``: a node that lost its part of a candidate gets it back from its
  partner before ``load_latest`` reads it;
* ``node_candidates``: the steps every node's leader holds, offered as candidates by rank 0
  (so a replaced rank-0 node still resumes the newest step on the other nodes).

May import: ``ops``, ``layouts``, ``format``, ``storage`` and the leaves (see docs/architecture.md).
"""

from ckptctl.tiers.spec import Cadence, Minutes, Steps, Tier

__all__ = ["Cadence", "Minutes", "Steps", "Tier"]
