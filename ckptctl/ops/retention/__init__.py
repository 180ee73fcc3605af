"""Retention: which checkpoints to keep and why, and deleting the rest safely.

* ``policies`` (with ``base`` and ``best``): the rules, small pure objects that say why each
  checkpoint is kept (``KeepLast(3) | KeepEvery(1000)``), shared by the CLI and the library;
* ``plan``, ``execute`` and ``prune``: restic-style: plan first (anchors verified), print the
  plan, then execute against the snapshot the plan was made from; ``planned``: what a plan
  says (``PlanItem``, ``PrunePlan``); ``scratch``: the staging copies killed restores left;
* ``background``: the library's retention after each commit (``Checkpointer(retention=...)``).

May import: ``format``, ``storage``, ``layouts``, ``ops.verify``, ``ops.seal``, ``ops.lock`` (the
root's lock, shared with ``rm``, ``sync`` and ``repoint``), ``ops.transfer.uploads``,
``ops.transfer.staging`` (a restore's staging names) and the leaves; never ``cli``.
"""
