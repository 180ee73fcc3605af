"""Commands under torchrun: rank 0 speaks for the job, every rank exits with one status.

Every verb runs on every rank inside ``cli.torchrun.torchrun_command`` (the ranks agree on
the command first); ``verify``, ``cp`` and ``restore`` split their work over the ranks
(``ops.distributed``), and this is the printing side of it, shared by those commands.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

from ckptctl.cli.common import debug_enabled, emit_json, err
from ckptctl.cli.errors import describe
from ckptctl.errors import CkptError
from ckptctl.ops.distributed import speaks
from ckptctl.ops.torchrun import under_torchrun

@contextlib.contextmanager
def rank0_speaks(as_json: bool = False) -> Iterator[bool]:
    """Under torchrun, rank 0 speaks for the job (yields whether this process is it): the other
    ranks print nothing, not even an error (the ranks agree on one, which rank 0 prints), and
    every rank exits with the same status (once rank 0 has printed: ``cli.torchrun``).
    A plain run speaks, and its errors are reported as every verb's are."""
    if not under_torchrun():
        yield True
        return
    speaker, code = speaks(), None
    try:
        yield speaker
    except CkptError as e:
        if debug_enabled():
            raise
        if speaker:
            text, code = describe(e)
            err.print(text, markup=False, highlight=False)
            if as_json:
                emit_json({"error": {"message": str(e), "hint": e.hint, "type": type(e).__name__}, "exit": code})
        code = e.exit_code
    if code is not None:
        raise typer.Exit(code)
