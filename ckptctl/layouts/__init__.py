"""How a checkpoint root is read: which directories are checkpoints, and their status.

``catalog`` is the one listing API (``list_checkpoints``, ``newest_committed``,
``newest_marked``); ``native`` reads, commits and deletes one of ckptctl's own checkpoints;
``base`` defines what a layout is. Other tools' layouts, each with its own commit rule and
pointer: ``dcp`` (torchtitan, torch DCP), ``hf_trainer`` (the Hugging Face Trainer),
``megatron`` (Megatron-LM), ``deepspeed``, ``lightning`` (``*.ckpt`` files); ``stack`` is what they share and ``safe_load``
test-loads their files without unpickling anything (``man/ckptctl-layouts.7``).
"""
