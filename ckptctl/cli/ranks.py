"""Commands under torchrun: rank 0 speaks for the job, every rank exits with one status.

``ckptctl verify``, ``cp`` and ``restore`` started by ``torchrun`` split their work over the
ranks (``ops.distributed``); this is the printing side of it, shared by those commands.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

from ckptctl.cli.common import debug_enabled, emit_json, err
from ckptctl.cli.errors import describe
from ckptctl.errors import CkptError
from ckptctl.ops.torchrun import torchrun_session, under_torchrun


@contextlib.contextmanager
def rank0_speaks(as_json: bool = False) -> Iterator[bool]:
    """Under torchrun, rank 0 speaks for the job (yields whether this process is it): the other
    ranks print nothing, not even an error (the ranks agree on one, which rank 0 prints), and
    every rank exits with the same status, once rank 0 has printed (``torchrun_session``).
    A plain run speaks, and its errors are reported as every verb's are."""
    code = None
    with torchrun_session() as speaker:
        try:
            yield speaker
        except CkptError as e:
            if not under_torchrun() or debug_enabled():
                raise  # the plain run's report, exactly as every verb's (``cli.common.command``)
            if speaker:  # printed here, before the session's last barrier lets the other ranks exit
                text, code = describe(e)
                err.print(text, markup=False, highlight=False)
                if as_json:
                    emit_json({"error": {"message": str(e), "hint": e.hint, "type": type(e).__name__}, "exit": code})
            code = e.exit_code
    if code is not None:
        raise typer.Exit(code)
