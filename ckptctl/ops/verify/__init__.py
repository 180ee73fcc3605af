"""Verification: whether a checkpoint is what it claims, at a level (quick, checksums, load).

* ``engine``: the one road for every checkpoint of every layout (and every file format): its
  handler's ``check`` (``layouts``), split over a torchrun job's ranks, made a report;
* ``report``: ``VerifyReport``, what ``verify`` prints and its JSON: a view of the layout's
  ``Checked`` with the URL, the time taken and the ranks that shared it;
* ``latest``: a root's checkpoints newest first (``verify --latest/--all``, ``latest``);
* ``whole``: a step judged whole across several roots (``verify --latest --tier URL``: a
  node-local tier's roots hold one node's part each);
* ``cache``: the record that lets prune skip re-reading a checkpoint it verified before.

May import: ``format``, ``storage``, ``layouts``, ``progress``, the leaves and
``ops.distributed`` (under torchrun each rank checks its share of a checkpoint's files); never
``cli``, nor another package of ``ops``.
"""
