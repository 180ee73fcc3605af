"""Sealing other tools' checkpoints: a sidecar recording each file's checksums and the
checkpoint's commit time, so later verifies, copies and prunes can vouch for its bytes.

* ``sealing``: the ``seal`` verb (``seal_path``), and the seals ``ckptctl.integrations`` write
  from checksums taken while a stack saves (``seal_as_written``, ``seal_just_written``);
* ``check``: reading a seal and checking a checkpoint's bytes against it;
* ``leftovers``: what a killed seal or copy leaves, removed before a rerun decides.

May import: ``format``, ``storage``, ``layouts``, ``ops.verify`` and the leaves; never ``cli``.
"""
