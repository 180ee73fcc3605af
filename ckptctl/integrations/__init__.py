"""ckptctl's guarantees inside the stacks people already run, through each stack's own
extension point: checksums taken while the stack saves, checked when it loads.

* ``dcp``: a ``StorageWriter``/``StorageReader`` for ``torch.distributed.checkpoint`` (and so
  torchtitan): ``dcp.save(state, storage_writer=dcp.Writer(path))``;
* ``lightning``: a ``CheckpointIO`` plugin: ``Trainer(plugins=[lightning.CheckpointIO()])``;
* ``trainer``: a ``TrainerCallback`` for the Hugging Face Trainer and every subclass (TRL's);
* ``accelerate``: a hook on ``Accelerator.save_state``.

Each module imports its framework and is imported only by the code that uses it: nothing here
is imported by ``import ckptctl``. They sit above ``ops`` (the seal, prune's retention) beside
``checkpointer``: user code imports them; nothing in ckptctl imports them.
"""
