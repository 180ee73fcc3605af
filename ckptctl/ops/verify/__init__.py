"""Verification: whether a checkpoint is what it claims, at a level (quick, checksums, load).

* ``checkpoint``: ckptctl's own checkpoints, against the manifest's checksums (``verify_checkpoint``);
* ``layouts``: any layout's checkpoint, asking the layout (``verify_entry``, ``latest_checkpoint``);
* ``foreign``: one file or directory another tool wrote (DCP, safetensors, torch.save);
* ``shard_scan``: one shard file's header and one streaming read of its chunks; ``decode``:
  the load level's test-decode of chunk bytes;
* ``cache``: the record that lets prune skip re-reading a checkpoint it verified before;
* ``problem``: ``Problem``, one thing wrong, located as precisely as it can be.

May import: ``format``, ``storage``, ``layouts``, ``interop``, ``state``, ``progress``, the
leaves, ``ops.expect``, ``ops.seal.check`` (a sealed checkpoint is checked against its seal) and
``ops.transform.convert`` (a foreign file is opened as convert opens it), ``ops.distributed`` (under
torchrun each rank checks its share of a checkpoint's files); never ``cli``.
"""
