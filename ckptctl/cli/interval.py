from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl.cli.common import JsonOpt, command, emit_json, err, out
from ckptctl.durations import format_duration, parse_duration
from ckptctl.errors import UsageError
from ckptctl.ops.interval import IntervalAdvice, advise
from ckptctl.ops.save_stats import SaveStats
from ckptctl.ops.verbs import advise_for_root


@command
def interval(
    root: Annotated[Optional[str], typer.Argument(help="Take the cost from the stall times recorded in this root's recent checkpoints.")] = None,
    cost: Annotated[Optional[str], typer.Option("--cost", help="Time training is blocked per checkpoint (for async saves: the stall, not the write).", metavar="DURATION")] = None,
    mtbf: Annotated[Optional[str], typer.Option("--mtbf", help="Mean time between failures of the whole job.", metavar="DURATION")] = None,
    json: JsonOpt = False,
) -> None:
    """How often to checkpoint: Young's interval sqrt(2*C*MTBF), Daly's refinement, and the
    expected fraction of time lost at each.

    With ROOT, C is the median stall recorded in the root's recent manifests, and a warning
    says when the background write takes longer than the interval (each save would wait for
    the previous one). Durations: 90s, 15m, 6h, 7d, 1h30m.

    Examples: ckptctl interval --cost 30s --mtbf 1d;  ckptctl interval /ckpt --mtbf 12h
    """
    if mtbf is None:
        raise UsageError("--mtbf is required", hint="e.g. --mtbf 24h: the mean time between failures of the whole job")
    mtbf_s = parse_duration(mtbf, option="--mtbf")
    cost_s = None if cost is None else parse_duration(cost, option="--cost")
    stats: SaveStats | None = None
    if root is not None:
        advice, stats = advise_for_root(root, mtbf_s, cost_s=cost_s)
    elif cost_s is not None:
        advice = advise(cost_s, mtbf_s)
    else:
        raise UsageError("give --cost DURATION, or a ROOT to take it from", hint="e.g. ckptctl interval --cost 30s --mtbf 24h")
    if json:
        emit_json(_doc(advice, stats, cost_from="option" if cost_s is not None else "manifests"))
    else:
        _print(advice, stats, cost_given=cost_s is not None)
    for w in advice.warnings:
        err.print(f"warning: {w}", markup=False, highlight=False)


def _doc(a: IntervalAdvice, stats: SaveStats | None, *, cost_from: str) -> dict:
    return {
        "cost_s": a.cost_s,
        "cost_from": cost_from,
        "mtbf_s": a.mtbf_s,
        "young_s": a.young_s,
        "daly_s": a.daly_s,
        "recommended_s": a.recommended_s,
        "waste_fraction_young": a.waste_fraction_young,
        "waste_fraction_daly": a.waste_fraction_daly,
        "write_s": a.write_s,
        "warnings": list(a.warnings),
        "recorded": None if stats is None else stats.to_dict(),
    }


def _print(a: IntervalAdvice, stats: SaveStats | None, *, cost_given: bool) -> None:
    src = ""
    if stats is not None and not cost_given:
        src = f"  (median stall of the {len(stats.stalls)} newest committed checkpoints)"
    lines = [
        f"cost C          {format_duration(a.cost_s)}{src}",
        f"MTBF M          {format_duration(a.mtbf_s)}",
        f"Young √(2CM)    {format_duration(a.young_s):<10} expected time lost {a.waste_fraction_young:.2%}",
        f"Daly            {format_duration(a.daly_s):<10} expected time lost {a.waste_fraction_daly:.2%}",
    ]
    if a.write_s is not None:
        lines.append(f"write           {format_duration(a.write_s)}  (median background write)")
    lines.append(f"checkpoint every {format_duration(a.recommended_s)}")
    for line in lines:
        out.print(line, markup=False, highlight=False)
