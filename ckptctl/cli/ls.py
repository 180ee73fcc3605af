from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli.common import RootArg, command, emit_json, err, human_bytes, print_table, say
from ckptctl.durations import format_duration
from ckptctl.ops.tier_listing import list_tiers
from ckptctl.ops.verbs import list_root

NOT_A_STEP = "*"  # after a STEP that counts something else (accelerate's checkpoint_N: its save index)


@command
def ls(
    root: RootArg,
    json: Annotated[bool, typer.Option(
        "--json",
        help='Print one JSON object on stdout: {"url", "checkpoints": [{step, name, url, status, bytes, created, '
             'age_s, reason, layout, content, content_reason, numbered_by}, ...], "counts", "bytes", "schema": 2} '
             '(ckptctl-json(7)); content is "resumable" or "export" (model only) for a committed checkpoint, else '
             'null; numbered_by says what step counts: "step", or "save index" or "epoch" (accelerate). "aliases": '
             '[{name, url, layout, step, same_as, why}, ...]: files a tool keeps beside its checkpoints standing for one '
             "of them (Lightning's last.ckpt), never counted among them. A failure prints "
             '{"error": {"message", "hint", "type"}, "exit": N, "schema": 2} instead. With --tier: '
             '{"tiers": [ROOT, URL, ...], "checkpoints": [{step, name, tiers: {URL: status or null}}, ...], "schema": 2}.',
    )] = False,
    tier: Annotated[list[str] | None, typer.Option(
        "--tier", "--tiers", metavar="URL",
        help="Another tier of the same run (a Checkpointer(tiers=[...]) promotes ROOT's checkpoints to it; "
             "repeat for more): list where each checkpoint lives, one STATUS column per tier, ROOT first.",
    )] = None,
) -> None:
    """List every checkpoint under ROOT with its step, status, size and age, sorted by step
    (newest last), then a summary line on stderr.

    Status is committed (marker matches manifest), partial (no marker yet: being written or
    abandoned), corrupt (marker and manifest disagree) or link (a symlink, never followed).
    FORMAT is the layout: ckptctl, or another tool's (dcp, hf-trainer, megatron, deepspeed, lightning),
    whose status follows that tool's own commit rule; unknown: named like a checkpoint but no
    layout recognises its files (never deleted).

    CONTENT, for a committed checkpoint: resumable (it holds the optimizer state, and loader or
    train state where its stack saves them) or export (model weights only: torchtitan's
    model-only last step, the Trainer's save_only_model, Lightning's save_weights_only, a
    ckptctl save without an optimizer), which `latest` and prune's anchor pass over; - otherwise.
    The column is shown when the root holds an export (--json always has the field).

    ROOT must be a root, not one checkpoint: a checkpoint (a step directory, another tool's
    checkpoint, a Lightning .ckpt file) is a usage error (exit 2) pointing at `ckptctl inspect`
    and at its parent. A ROOT without checkpoints whose subdirectories hold some (torchtitan's
    output folder keeps them in checkpoint/) lists nothing, exit 0, with a hint on stderr
    naming them.

    With --tier URL (repeatable), ROOT and each URL are the tiers of one run
    (Checkpointer(tiers=[...]): ROOT the nearest): one row per checkpoint with its status on
    each tier, "-" where a tier does not hold it (not promoted yet, or pruned there).

    A STEP marked * is not a training step but what the checkpoint's name counts instead, said
    under the table: accelerate's automatic checkpoint_N counts save_state calls (its save
    index), its examples' epoch_N epochs. prune's step rules (--keep-every, --keep) refuse such
    a root.

    Lightning's last.ckpt (ModelCheckpoint(save_last=True), rewritten at every save) is not a
    checkpoint of its own: it is said under the table with the step it records and the
    checkpoint of that step, and prune never deletes it nor counts it.
    """
    if tier:
        _tiers(root, tier, json)
        return
    listing = list_root(root)
    rows = listing.rows
    counts = {status: sum(r.status == status for r in rows) for status in ("committed", "partial", "corrupt", "link", "unknown")}
    if json:
        if listing.hint:  # none here, but a subdirectory holds some: on stderr, as without --json
            say(f"hint: {listing.hint}", console=err)
        emit_json({"url": _root_url(rows, root), "checkpoints": [_entry(r.to_dict()) for r in rows], "counts": counts,
                   "bytes": sum(r.size for r in rows), "aliases": [a.to_dict() for a in listing.aliases]})
        return
    # Reasons (why a checkpoint is corrupt) can be long: their own column, last, and only when
    # there is one, so that the other columns stay aligned and easy to cut.
    with_reason = any(r.reason for r in rows)
    with_export = any(r.content == "export" for r in rows)  # a root of resumable ones keeps its columns
    print_table(
        ("STEP", "FORMAT", "STATUS") + (("CONTENT",) if with_export else ()) + ("SIZE", "AGE", "PATH")
        + (("REASON",) if with_reason else ()),
        [(str(r.step) + ("" if r.numbered_by == "step" else NOT_A_STEP), r.layout, r.status) + ((r.content or "-",) if with_export else ())
         + (human_bytes(r.size), format_duration(r.age_s), r.url) + ((r.reason or "-",) if with_reason else ())
         for r in rows],
        right=("STEP", "SIZE", "AGE"),
    )
    exports = sum(r.content == "export" for r in rows)
    say(f"{len(rows)} checkpoints: " + ", ".join(f"{n} {status}" for status, n in counts.items() if n or status == "committed")
        + (f" ({exports} of them model-only export{'' if exports == 1 else 's'})" if exports else "")
        + f"; total {human_bytes(sum(r.size for r in rows))}", console=err)
    for counts in sorted({r.numbered_by for r in rows} - {"step"}):
        names = [r.name for r in rows if r.numbered_by == counts]
        which = names[0] if len(names) == 1 else f"{names[0]} to {names[-1]}"
        say(f"{NOT_A_STEP} not a training step: the {counts} in the name ({which}); prune's --keep-every and --keep "
            "refuse this root", console=err)
    for a in listing.aliases:  # Lightning's last.ckpt: shown, never counted above
        of = (f"step {a.step}" + (f", as {a.same_as}" if a.same_as else "")) if a.step is not None else "step unknown"
        say(f"{a.name}: {of}; {a.why}; not a checkpoint of its own: prune never deletes or counts it", console=err)
    if listing.hint:  # none here, but a subdirectory holds some
        say(f"hint: {listing.hint}", console=err)


def _tiers(root: str, others: list[str], json: bool) -> None:
    """``ls ROOT --tier URL ...``: one row per checkpoint, its status on each tier."""
    listing = list_tiers([root, *others])
    if json:
        emit_json(listing.to_dict())
        return
    print_table(("STEP", "NAME", *(f"TIER {i}" for i in range(len(listing.tiers)))),
                [(str(r.step), r.name, *(r.where[t] or "-" for t in listing.tiers)) for r in listing.rows],
                right=("STEP",))
    for i, url in enumerate(listing.tiers):
        say(f"tier {i}: {url}", console=err)


def _entry(d: dict) -> dict:
    """One checkpoint as JSON: sizes are ``bytes`` in every verb's output (ckptctl-json(7))."""
    size = d.pop("size")
    return {**d, "bytes": size}


def _root_url(rows: list, given: str) -> str:
    """The root's URL: the parent of the first checkpoint's, else the path as given."""
    if rows:
        return rows[0].url.rstrip("/").rsplit("/", 1)[0]
    return given
