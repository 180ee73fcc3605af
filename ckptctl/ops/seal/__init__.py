"""Sealing other tools' checkpoints: a sidecar recording each file's checksums and the
checkpoint's commit time, so later verifies, copies and prunes can vouch for its bytes.

* ``sealing``: the ``seal`` verb (``seal_path``): a test-load by the one verify engine, then
  every file hashed and the sidecar written; and the seals ``ckptctl.integrations`` write from
  checksums taken while a stack saves (``seal_as_written``, ``seal_just_written``);
* ``leftovers``: what a killed seal or copy leaves, removed before a rerun decides.

Checking a checkpoint against its seal is its layout's (``layouts.seal_check``, asked by
``layouts.file_check``): every verb that verifies such a checkpoint does it.

May import: ``format``, ``storage``, ``layouts``, ``ops.verify`` and the leaves; never ``cli``.
"""
