from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl.cli.common import JsonOpt, QuietOpt, command, emit_json, err, human_bytes, out, parse_size
from ckptctl.cli.progress import byte_progress
from ckptctl.ops.verbs import convert_path


@command
def convert(
    src: Annotated[str, typer.Argument(help="A ckptctl checkpoint, DCP directory, safetensors file/directory, torch.save file or DeepSpeed tag (global_stepN).")],
    dst: Annotated[str, typer.Argument(help="Where to write: a directory (ckptctl, dcp, sharded safetensors) or a file (torch, one .safetensors).")],
    to: Annotated[str, typer.Option("--to", help="Output format: ckptctl, safetensors, torch or dcp.", metavar="FORMAT")],
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Keep tensors whose names start with PREFIX (repeatable), e.g. model/.", metavar="PREFIX")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Cast floating tensors: bf16, fp16 or fp32.", metavar="DTYPE")] = None,
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="safetensors: split into shards of at most SIZE (5GB, 500MiB) plus an index.", metavar="SIZE")] = None,
    step: Annotated[Optional[int], typer.Option("--step", help="The training step to record; wins over the source's own (which is noted when it differs). Needed for --to ckptctl when the source records none.", metavar="N")] = None,
    strip_prefix: Annotated[Optional[str], typer.Option("--strip-prefix", help="Remove PREFIX from the names that start with it (e.g. model/ for inference code); other names stay unless --only leaves them out; a collision is refused.", metavar="PREFIX")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a checkpoint between ckptctl, PyTorch DCP, safetensors and torch.save.

    The input format is detected and reported. Tensors stream one at a time, so memory stays
    about the largest tensor whatever the checkpoint's size. Tensor names are ckptctl's
    (model/fc.weight) in safetensors; torch and DCP outputs hold the state nested as it was
    saved (DCP's own names are then model.fc.weight, loadable with dcp.load). Non-tensor
    state travels with the tensors (manifest, safetensors metadata, the torch dict, a DCP
    entry); anything the source cannot hand over is listed as dropped. torch.save files are read with weights_only=True only: one that needs pickle
    is refused and nothing in it runs. A ckptctl source is verified first; a ckptctl result
    gets checksums, a manifest and a marker, and is verified; from a ckptctl source it keeps
    every rank's RNG state (unless --only or --strip-prefix).

    The step comes from the source: a ckptctl manifest, torchtitan's train_state, a Hugging
    Face checkpoint-N's trainer_state.json global_step, Megatron's iter_NNNNNNN, a step,
    global_step or iteration key in a .pt/.ckpt. Records that disagree are refused; --step N
    wins over all of them. --to ckptctl refuses a source with no step unless --step is given.
    A Hugging Face Trainer checkpoint also carries optimizer.pt, scheduler.pt and scaler.pt
    (weights_only) under optimizer/, scheduler/, scaler/ and trainer_state.json; what cannot
    be loaded safely (rng_state.pth with numpy state, training_args.bin) is listed as dropped.
    A Hugging Face hub cache snapshot (links into ../../blobs) is read through its links while
    they stay inside the cache.

    A DeepSpeed tag (global_stepN) is read through mp_rank_00_model_states.pt, whose module is
    the model (its other keys come along as state): the ZeRO optimizer partitions
    (*_optim_states.pt) are not converted and are listed as dropped. ZeRO-3, pipeline and
    tensor parallel tags hold no whole model in one file: exit 2, pointing at DeepSpeed's
    zero_to_fp32.py, whose output convert reads.

    Exit 0 success; 1 the source is invalid, incomplete (a DCP directory without .metadata)
    or disagrees about its step, or DST exists without --overwrite; 2 bad arguments (DST is
    SRC, no step for --to ckptctl, a --strip-prefix collision); 3 storage error.

    Example: ckptctl convert /ckpt/step-0000001000 ./hf --to safetensors --only model/ --dtype bf16 --max-shard-size 5GB
    """
    if max_shard_size is not None:  # checked here, strictly (a finite whole number of bytes), before any work
        max_shard_size = str(parse_size(max_shard_size, "--max-shard-size"))
    with byte_progress("convert", quiet=quiet) as progress:
        r = convert_path(src, dst, to, only=only or (), dtype=dtype, max_shard_size=max_shard_size,
                         overwrite=overwrite, progress=progress, step=step, strip_prefix=strip_prefix)
    if json:
        emit_json(r.to_dict())
        return
    if quiet:  # what was dropped is routine for the target format (RNG state in safetensors); --json lists it
        return
    err.print(f"found {r.source_format} at {r.src}" + ("" if r.source_checksums else " (no checksums to verify in this format)"),
              markup=False, highlight=False)
    if r.step is not None:
        err.print(f"step {r.step} (from {r.step_from})", markup=False, highlight=False)
    for c in r.carried:
        err.print(f"carried: {c}", markup=False, highlight=False)
    for d in r.dropped:
        err.print(f"dropped: {d}", markup=False, highlight=False)
    cast = f", cast to {r.cast}" if r.cast else ""
    skipped = f" ({r.skipped_by_only} left out by --only)" if r.skipped_by_only else ""
    skipped += f" ({r.renamed} renamed by --strip-prefix)" if r.renamed else ""
    out.print(f"ok  {r.dst}  {r.source_format} -> {r.target_format}: {r.tensors} tensors{skipped}{cast}, "
              f"{human_bytes(r.bytes)} in {r.seconds:.2f}s", markup=False, highlight=False)
