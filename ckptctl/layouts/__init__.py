"""Every tool's checkpoints, each layout the whole handler of its own (``base.Layout``).

``base`` defines the protocol every verb asks (recognise, commit rule, removal, check, inspect,
seal, pointers, resume, metrics) and ``checked`` what a check finds; ``registry`` lists the
layouts (built-in, then plugins by entry point); ``classify`` says what is at a path and which
layout owns a directory; ``catalog`` is the one listing API (``list_checkpoints``,
``newest_committed``, ``newest_marked``). ``native`` reads, commits and deletes one of ckptctl's
own checkpoints and is its layout (checked against its manifest by ``native_check``). Other
tools' layouts, each with its own commit rule and pointer: ``dcp`` (torchtitan, torch DCP),
``hf_trainer`` (the Hugging Face Trainer), ``megatron`` (Megatron-LM), ``deepspeed``,
``lightning`` (``*.ckpt`` files), ``accelerate``, ``composer``, ``nemo``; ``stack`` is what they
share, ``file_check`` checks their files (and a plugin's) at every level with their seal
(``seal_check``), and ``safe_load`` and ``pickle_scan`` test-load them without unpickling
anything (``man/ckptctl-layouts.7``). ``files`` handles file formats named by themselves.
"""
