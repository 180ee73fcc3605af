"""Every command line run by torchrun is one rank's run of one command: the ranks agree on it
before any work, and end together.

``command()`` (``cli.common``) runs every verb inside ``torchrun_command``: under torchrun the
ranks first compare the verb, its arguments and its resolved paths (``ops.torchrun.
torchrun_session``): ranks given different commands stop with exit 2 naming them and what
differs, a rank that never starts the command is named (exit 3), and nothing is read or
written before. At the end each rank waits until every rank has ended, so that rank 0 has
printed the job's result before torchrun stops the others.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator, Mapping

import typer

from ckptctl.cli.locations import READS, WRITES
from ckptctl.errors import CkptError
from ckptctl.ops.rollcall import Command, resolved
from ckptctl.ops.torchrun import torchrun_session, under_torchrun

# Arguments that may differ between the nodes of a job (never between the ranks of one node).
PER_NODE = {"restore": ("dst",)}  # each node restores to its own disk


@contextlib.contextmanager
def torchrun_command(verb: str, arguments: Mapping[str, Any]) -> Iterator[None]:
    """Run the command line of ``verb`` with ``arguments`` (as the verb's function got them) as
    one rank of a torchrun job; nothing extra in a plain run. An end the ranks agree on (a
    result, a CkptError, an exit status) waits for every rank; anything else (a bug, an
    interrupt) ends this rank at once, and torchrun the job."""
    if not under_torchrun():
        yield
        return
    with torchrun_session(_command(verb, arguments)) as session:
        try:
            yield
        except (CkptError, typer.Exit):
            session.finish()
            raise
        session.finish()


def _command(verb: str, arguments: Mapping[str, Any]) -> Command:
    """What the ranks compare: every argument as text, paths and URLs resolved."""
    args = {}
    for name, value in sorted(arguments.items()):
        values = value if isinstance(value, (list, tuple)) else [value]
        if name in READS + WRITES:
            values = [resolved(v) if isinstance(v, str) else v for v in values]
        args[name] = json.dumps(values if isinstance(value, (list, tuple)) else values[0], default=str)
    return Command(verb, args, per_node=PER_NODE.get(verb, ()))
