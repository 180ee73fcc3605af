from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, human_bytes, say
from ckptctl.cli.progress import byte_progress
from ckptctl.errors import EXIT_CHECKPOINT
from ckptctl.ops.seal.sealing import seal_path


@command
def seal(
    path: Annotated[str, typer.Argument(help="A checkpoint of another tool (checkpoint-N, step-N, iter_N, global_stepN), or a root holding them.", metavar="CKPT|ROOT")],
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Record checksums for another tool's checkpoint, after test-loading every file of it once.

    For a checkpoint of the Hugging Face Trainer, torchtitan/DCP, Megatron-LM or DeepSpeed:
    its stack's commit rule is checked, every file is test-loaded
    (torch.load with weights_only=True, nothing unpickled), then every file's size and XXH3-64
    (and one per 64 MiB chunk of a larger file) go into CKPT/.ckptctl-seal.json. The seal is
    created only if absent and never replaced; the checkpoint's own files are never modified.
    From then on `verify` checks every byte against the seal (a changed byte is reported with its
    file and byte range; a file added, removed or resized after sealing too), `prune` trusts a
    sealed anchor whose bytes still match without test-loading it again, and `cp`/`restore`
    check the copy on the fly. An incomplete or corrupt checkpoint is refused. ckptctl's own
    checkpoints need no seal (their manifest holds checksums): nothing is done. Given a root,
    every complete checkpoint not sealed yet is sealed; incomplete ones are skipped.

    Exit status: 0 sealed (or nothing to do); 1 a checkpoint is incomplete or fails its test-load
    (nothing written for it); 2 usage error; 3 storage error.

    Example: ckptctl seal /runs/hf/checkpoint-1500 && ckptctl cp /runs/hf/checkpoint-1500 s3://bucket/hf
    """
    with byte_progress("seal", quiet=quiet) as progress:
        outcome = seal_path(path, progress)
    if json:
        emit_json(outcome.to_dict())
    else:
        for r in outcome.results:
            if quiet and r.status != "failed":
                continue  # -q: only what failed
            if r.status == "sealed":
                say(f"sealed  {r.url}  ({r.layout}, step {r.step}): {r.files} files, {human_bytes(r.bytes)} "
                    f"test-loaded and checksummed in {r.seconds:.2f}s")
                for n in r.not_loaded:
                    say(f"  note: {n}", console=err)
            elif r.status == "failed":
                say(f"FAILED  {r.url}: {r.reason}")
            else:
                say(f"{r.status}  {r.url}: {r.reason}")
    if not outcome.ok:
        raise typer.Exit(EXIT_CHECKPOINT)
