"""Long-lived writer processes for tests/test_zombie_writer.py.

Two of them play a zombie job and its restart: each receives trials over a pipe (a root URL,
a step, a delay and the value to fill its tensor with), sleeps the delay, saves the step with a
``Checkpointer`` of its own, and answers with the outcome. One process runs every trial, so
fifty trials cost one Python + torch start-up per writer, not fifty.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

ELEMENTS = 1 << 18  # 1 MiB of float32: long enough a write for two saves to overlap


def state_of(fill: float, who: str) -> dict[str, Any]:
    import torch

    return {"w": torch.full((ELEMENTS,), fill), "extra": {"who": who}}


def serve(conn: Connection, who: str) -> None:
    """Answer each trial ``(url, step, delay_s, fill)`` with ``(outcome, detail)``: outcome
    "ok" (this writer's save committed), "refused" (RefusedForSafety, directly or as the
    cause of SaveFailed) or "error" (anything else, with its text). ``None`` ends the loop."""
    import warnings

    warnings.filterwarnings("ignore")
    from ckptctl import Checkpointer
    from ckptctl.errors import RefusedForSafety, SaveFailed

    conn.send(("ready", who))
    while True:
        trial = conn.recv()
        if trial is None:
            return
        url, step, delay_s, fill = trial
        state = state_of(fill, who)
        time.sleep(delay_s)
        try:
            ckpt = Checkpointer(url)
            try:
                ckpt.save(step, state).wait()
            finally:
                try:
                    ckpt.close()
                except SaveFailed:
                    pass  # the same failure wait() raised just now
            conn.send(("ok", ""))
        except RefusedForSafety as e:
            conn.send(("refused", str(e)))
        except SaveFailed as e:
            kind = "refused" if isinstance(e.__cause__, RefusedForSafety) else "error"
            conn.send((kind, f"{e} <- {type(e.__cause__).__name__}: {e.__cause__}"))
        except Exception as e:  # the test reads every other failure as text
            conn.send(("error", f"{type(e).__name__}: {e}"))


# --- one interleaving at a time --------------------------------------------------------------


def race_at(root: str, when: str, step: int = 7) -> dict[str, Any]:
    """This writer ("loser", fill 1.0) saves ``step`` under ``root`` on a disk where another
    writer ("winner", fill 2.0, its own plain ``Checkpointer``) commits the same step at one
    moment, ``when``:

    - "publish": just before this writer publishes its shard;
    - "commit": just before this writer's commit writes its manifest (its shard is published,
      and its marker would come next).

    Returns {"outcome": "ok" or the name of the error, "message", "fired"}."""
    from ckptctl import Checkpointer
    from ckptctl.errors import CkptError, SaveFailed
    from ckptctl.format.layout import SHARD_SUFFIX, is_manifest_name
    from ckptctl.storage.local import LocalStorage, LocalWriter

    fired: list[str] = []

    def winner_commits() -> None:
        if not fired:
            fired.append(when)
            with Checkpointer(root) as other:
                other.save(step, state_of(2.0, "winner")).wait()

    class Disk(LocalStorage):
        def open_writer(self, key: str) -> LocalWriter:
            writer = super().open_writer(key)
            if when == "publish" and key.endswith(SHARD_SUFFIX):
                for method in ("commit", "publish"):  # whichever this version publishes with
                    original = getattr(writer, method, None)
                    if original is None:
                        continue

                    def hooked(*args: Any, original: Any = original) -> Any:
                        winner_commits()
                        return original(*args)

                    setattr(writer, method, hooked)
            return writer

        def write_if_absent(self, key: str, data: bytes) -> bool:
            if when == "commit" and is_manifest_name(key):
                winner_commits()
            return super().write_if_absent(key, data)

    ckpt = Checkpointer(root, storage=Disk(root))
    outcome, message = "ok", ""
    try:
        ckpt.save(step, state_of(1.0, "loser")).wait()
    except SaveFailed as e:
        cause = e.__cause__
        outcome, message = type(cause).__name__, str(cause)
    except CkptError as e:
        outcome, message = type(e).__name__, str(e)
    finally:
        try:
            ckpt.close()
        except SaveFailed:
            pass  # seen above
    return {"outcome": outcome, "message": message, "fired": fired}


def race_at_on_gloo(root: str, when: str, port: int, out: "Connection") -> None:
    """``race_at`` in a process of its own with a one-rank gloo group, so the save runs the
    multi-rank path (the coordinator commits on rank 0 and tells every rank the outcome)."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        out.send(race_at(root, when))
    finally:
        dist.destroy_process_group()
