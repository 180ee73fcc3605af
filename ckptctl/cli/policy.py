"""The retention options ``prune`` and ``du`` share, declared once, and the policy they build.

A verb takes them by naming one parameter ``retention: RetentionOptions`` and wrapping itself
in :func:`retention_options`: the wrapper puts the options into the signature Typer reads (in
place of that parameter) and hands the verb their values as one object. So the nine rules and
their two qualifiers (``--metric``, ``--mode``) have one declaration, one help text and one
validation for both verbs.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer

from ckptctl.durations import parse_duration
from ckptctl.ops.retention.policies import RetentionPolicy, from_options

F = TypeVar("F", bound=Callable[..., Any])

_N = "N"
# name -> (type, option, help, metavar): the order is the order --help lists them in.
_OPTIONS: dict[str, tuple[Any, str, str, str]] = {
    "keep_last": (Optional[int], "--keep-last", "Keep the N newest committed checkpoints.", _N),
    "keep_every": (Optional[int], "--keep-every", "Keep steps that are multiples of STEPS.", "STEPS"),
    "keep_within": (Optional[str], "--keep-within",
                    "Keep checkpoints committed within DURATION of the newest trustworthy commit time "
                    "(90s, 15m, 6h, 7d).", "DURATION"),
    "keep_hourly": (Optional[int], "--keep-hourly",
                    "Keep the newest checkpoint of each of the last N UTC hours that have one.", _N),
    "keep_daily": (Optional[int], "--keep-daily",
                   "Keep the newest checkpoint of each of the last N UTC days that have one.", _N),
    "keep_weekly": (Optional[int], "--keep-weekly",
                    "Keep the newest checkpoint of each of the last N ISO weeks that have one.", _N),
    "keep_monthly": (Optional[int], "--keep-monthly",
                     "Keep the newest checkpoint of each of the last N months that have one.", _N),
    "keep_best": (Optional[int], "--keep-best",
                  "Keep the N checkpoints with the best value of --metric (recorded at save time, or "
                  "logged by a Hugging Face Trainer). Checkpoints without it are left to the other rules; "
                  "if none records it, all are kept.", _N),
    "metric": (Optional[str], "--metric", "The metric --keep-best ranks by (e.g. val_loss, eval_loss, best_metric).",
               "NAME"),
    "mode": (Optional[str], "--mode", "With --keep-best: min (lower is better, the default) or max.", "min|max"),
    "keep": (Optional[list[int]], "--keep", "Keep this step (repeatable).", "STEP"),
}


@dataclass(frozen=True)
class RetentionOptions:
    """The values of the retention options as given (None: not given)."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_within: str | None = None
    keep_hourly: int | None = None
    keep_daily: int | None = None
    keep_weekly: int | None = None
    keep_monthly: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str | None = None
    keep: list[int] | None = None

    @property
    def given(self) -> bool:
        """Whether any retention option was given."""
        return any(getattr(self, f.name) not in (None, [], ()) for f in fields(self))

    def policy(self) -> RetentionPolicy:
        """The policy the options describe (UsageError, exit 2, naming the option, when none is
        given or one is bad)."""
        return from_options(
            self.keep_last, self.keep_every,
            None if self.keep_within is None else parse_duration(self.keep_within, option="--keep-within"),
            self.keep or (),
            keep_hourly=self.keep_hourly, keep_daily=self.keep_daily, keep_weekly=self.keep_weekly,
            keep_monthly=self.keep_monthly, keep_best=self.keep_best, metric=self.metric, mode=self.mode,
        )


def retention_options(fn: F) -> F:
    """Replace ``fn``'s ``retention`` parameter by the retention options (for Typer), and pass
    ``fn`` their values as a :class:`RetentionOptions`."""
    sig = inspect.signature(fn, eval_str=True)  # the real types: Typer reads them from __signature__
    params = list(sig.parameters.values())
    at = [p.name for p in params].index("retention")
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=Annotated[kind, typer.Option(option, help=help, metavar=metavar)])
        for name, (kind, option, help, metavar) in _OPTIONS.items()
    ]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else p
            for p in params[at + 1:]]
    new = sig.replace(parameters=params[:at] + added + rest)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        given = RetentionOptions(**{name: kwargs.pop(name, None) for name in _OPTIONS})
        return fn(*args, retention=given, **kwargs)

    run.__signature__ = new  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in new.parameters.values()} | {"return": sig.return_annotation}
    return run  # type: ignore[return-value]
