"""A real demonstration: train, checkpoint asynchronously, be killed mid-save, resume.

    python -m ckptctl.demo [--dir DIR] [--steps 60] [--every 10] [--kill-at 40] [--threads 1]

1. A reference job trains a small model for ``--steps`` steps, saving every ``--every`` steps,
   and is never interrupted.
2. The same job runs again, saving every ``--every`` steps with ``Checkpointer`` (``save``
   returns after the host snapshot; a background thread writes the shard). While the shard of
   step ``--kill-at`` is being written, this process kills the job with SIGKILL.
3. The checkpoints on disk are listed: the half-written one has no marker, so it is no
   checkpoint.
4. A new job process resumes from the newest *committed* checkpoint and trains to the end.
5. Every step's loss is compared bit for bit with the reference: every step the killed job
   trained (those after the checkpoint too, lost with the kill) and every step the resumed job
   trained. Model, AdamW state, LR schedule, data loader position and RNG states (dropout) must
   all have come back. The last line is the verdict; exit status 0 PASS, 1 FAIL, 2 usage.

Bit-identical curves need runs that compute identically, so every run (the reference too) is a
fresh process started the same way (``python -m ckptctl.demo --job``, one environment built
once) with fixed thread counts, ``torch.use_deterministic_algorithms(True)``, explicitly seeded
generators and no loader workers. Losses are logged and compared as raw float64 bits; a
difference names the first step that differs with both values in full precision.
"""


# The parts (this docstring is also the demo's --help): ``job``, the training job each child
# process runs; ``curves``, the loss logs and the bit-for-bit verdict; ``run``, the parent that
# starts, kills and resumes the jobs; ``__main__``, ``python -m ckptctl.demo``.
