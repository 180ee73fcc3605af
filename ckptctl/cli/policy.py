"""The retention options ``prune`` and ``du`` share, and the policy they build."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckptctl.durations import parse_duration
from ckptctl.ops.retention import RetentionPolicy, from_options

KeepLastOpt = Annotated[Optional[int], typer.Option("--keep-last", help="Keep the N newest committed checkpoints.", metavar="N")]
KeepEveryOpt = Annotated[Optional[int], typer.Option("--keep-every", help="Keep steps that are multiples of STEPS.", metavar="STEPS")]
KeepWithinOpt = Annotated[Optional[str], typer.Option(
    "--keep-within", metavar="DURATION",
    help="Keep checkpoints committed within DURATION of the newest trustworthy commit time (90s, 15m, 6h, 7d).")]
KeepHourlyOpt = Annotated[Optional[int], typer.Option(
    "--keep-hourly", metavar="N", help="Keep the newest checkpoint of each of the last N UTC hours that have one.")]
KeepDailyOpt = Annotated[Optional[int], typer.Option(
    "--keep-daily", metavar="N", help="Keep the newest checkpoint of each of the last N UTC days that have one.")]
KeepWeeklyOpt = Annotated[Optional[int], typer.Option(
    "--keep-weekly", metavar="N", help="Keep the newest checkpoint of each of the last N ISO weeks that have one.")]
KeepMonthlyOpt = Annotated[Optional[int], typer.Option(
    "--keep-monthly", metavar="N", help="Keep the newest checkpoint of each of the last N months that have one.")]
KeepOpt = Annotated[Optional[list[int]], typer.Option("--keep", help="Keep this step (repeatable).", metavar="STEP")]


def policy_from(
    keep_last: int | None,
    keep_every: int | None,
    keep_within: str | None,
    keep: list[int] | None,
    keep_hourly: int | None = None,
    keep_daily: int | None = None,
    keep_weekly: int | None = None,
    keep_monthly: int | None = None,
) -> RetentionPolicy:
    """The policy the options describe (UsageError, exit 2, when none is given or one is bad)."""
    return from_options(
        keep_last, keep_every,
        None if keep_within is None else parse_duration(keep_within, option="--keep-within"),
        keep or (),
        keep_hourly=keep_hourly, keep_daily=keep_daily, keep_weekly=keep_weekly, keep_monthly=keep_monthly,
    )


def any_policy(*values: object) -> bool:
    """Whether any retention option was given."""
    return any(v not in (None, [], ()) for v in values)
