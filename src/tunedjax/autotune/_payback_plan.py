"""A bucket's payback planning: which candidates `tune_bucket` compiles.

With a tuning horizon, the default's compile and first call decide whether
tuning the rest can pay back (`_weigh_payback`; the candidates a prediction
ranks best, predicted to compile within `AHEAD_COMPILE_S`, compile beside the
default on a spare core, `_compiled_ahead`); with a `Prediction`, only the
candidates that could win are compiled (`_pruning`). `plan` is the entry.

The bucket is the tuner's `_tuner._Bucket` in progress; the tuner's own
steps (compiling, a call, timing, its clock) come in as `Steps`, read from
the tuner at each call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from tunedjax import _tuning
from tunedjax.autotune._payback import CANNOT_PAY_BACK, Payback
from tunedjax.autotune._result import TuneResult

logger = logging.getLogger("tunedjax.autotune")

# A first call below SCREEN_MIN_S is confirmed by a second before tuning is
# paid for, unless tuning would pay back even if only this share of it were
# the kernel's own time (the rest one-time costs).
WARM_SHARE = 0.25
# Candidates predicted to compile within this many seconds may compile beside
# the default, before the payback decision (`_compiled_ahead`).
AHEAD_COMPILE_S = 0.5


class Steps(NamedTuple):
  """The tuner's steps the planning runs (`_tuner._steps()`).

  Attributes:
    compile_all: ``(functions, args, compile_s) -> {name: executable}``, side by side.
    runner: ``(executable, args) -> call``.
    timed: ``(bucket, runners, **kw) -> {name: [seconds]}`` (`time_interleaved`).
    keeping: ``(outputs, name, run) -> call`` that keeps the call's output.
    was_warm: ``(bucket) -> bool``: the family made a timed call before.
    temps_of: ``(compiled) -> {name: temporary bytes}``.
    clock: the tuner's clock.
  """

  compile_all: Callable[[Mapping[str, Callable[..., Any]], Sequence[Any], dict[str, float]],
                        dict[str, Any]]
  runner: Callable[[Any, Sequence[Any]], Callable[[], Any]]
  timed: Callable[..., dict[str, list[float]]]
  keeping: Callable[[dict[str, Any], str, Callable[[], Any]], Callable[[], None]]
  was_warm: Callable[[Any], bool]
  temps_of: Callable[[Mapping[str, Any]], dict[str, int]]
  clock: Callable[[], float]


def _weigh_payback(bucket: Any, payback: Payback, steps: Steps
                   ) -> TuneResult | tuple[dict[str, Any], list[float]]:
  """The default alone first: its compile and first call say what tuning the
  rest would cost and what it could save.

  Returns:
    The result keeping the default (``"cannot pay back"``), or the default's
    executable and its first call's time (its screening round).
  """
  default = bucket.default
  # Compiled ahead (`_prefetch`), the default has no compile to pair a candidate
  # with: the candidates wait for the decision.
  todo = ({} if default in bucket.compiled else
          {default: bucket.functions[default], **_compiled_ahead(bucket)})
  compile_start, compiled = steps.clock(), dict(bucket.compiled)
  compiled.update(steps.compile_all(todo, bucket.args, bucket.compile_s) if todo else {})
  # The default's compile is its own thread's time, and deciding is counted
  # as if it had compiled alone: the compiles beside it belong to tuning the
  # rest (`decided_s`).
  compile_s = bucket.compile_s[default]
  beside_s = max(0.0, steps.clock() - compile_start - (compile_s if default in todo else 0.0))
  # The default failing to compile: an error.
  ref_run = steps.runner(compiled[default], bucket.args)
  bucket.warm = steps.was_warm(bucket)
  screen = list(steps.timed(bucket, {default: steps.keeping(bucket.outputs, default, ref_run)},
                       rounds=1, warmup=0)[default])
  default_s, calls = screen[0], list(screen)
  cost, compile_bound, plan, share = _expected_cost(bucket, payback, compile_s, default_s)
  if (default_s < bucket.screen_min_s and payback.pays(default_s, cost)
      and not compile_bound
      and not _pays_even_if_mostly_warmup(bucket, payback, compile_s, default_s)):
    # A short first call can be mostly one-time costs (the process's first
    # convolution: ~60 ms): a second call confirms before paying for tuning.
    calls += steps.timed(bucket, {default: ref_run}, rounds=1, warmup=0)[default]
    default_s = min(calls)
    cost, compile_bound, plan, share = _expected_cost(bucket, payback, compile_s, default_s)
  _apply_pruning(bucket, plan)
  others = len(bucket.functions) - 1
  bucket.record.update(
      horizon=payback.horizon, sites=payback.sites, default_s=float(default_s),
      cost_s=float(cost), estimate_s=float(cost * share / payback.cost_factor),
      decided_s=float(max(0.0, steps.clock() - bucket.start - beside_s)),
      kept=compile_bound or not payback.pays(default_s, cost))
  if not bucket.record["kept"]:
    compiled = {n: c for n, c in compiled.items() if n in bucket.functions}
    bucket.temps.update(steps.temps_of(compiled))
    return compiled, screen
  bucket.temps.update(steps.temps_of({default: compiled[default]}))
  saved = payback.most_saved(default_s)
  at_best = ("" if share == 1.0 else
             f" (the best predicted at best {1 - share:.2g}x {default}'s time)")
  why = (f"no candidate predicted to beat it saves its compile within the horizon (at "
         f"least {cost:.3g} s of {default}'s time needed)" if compile_bound else
         f"{saved * share:.3g} s at most to save{at_best}, below the {cost * share:.3g} s "
         f"tuning {others} other candidate(s) is expected to cost")
  basis = f" ({payback.basis})" if payback.basis else ""  # the platform's rule, not measured
  return bucket.finish(default, (
      f"{CANNOT_PAY_BACK}: {default} took {1e3 * default_s:.3g} ms x {payback.sites} "
      f"site(s) x {payback.horizon} runs = {saved:.3g} s; {why}{basis}"), {default: calls}, {})


def _compiled_ahead(bucket: Any) -> dict[str, Callable[..., Any]]:
  """The candidates compiled beside the default, before the payback decision.

  Compiling the default alone leaves the other cores idle (XLA compiles
  without the GIL, and a small program's compile is one thread's work), so
  the candidates a `Prediction` ranks best among those that could win
  (`Prediction.could_win`, unbounded) compile at the same time, one per
  spare core. What they cost is what a bucket that turns out to be kept
  wastes on cores that would have been idle; a bucket that is tuned has its
  best candidates compiled already. Only a candidate predicted to compile
  within `AHEAD_COMPILE_S` goes ahead (the default waits for it: a long
  compile is left to the payback decision). Nothing is compiled ahead
  without a prediction (exhaustive tuning compiles every candidate after
  the decision, as before), on one core, or where the default was compiled
  before (`_prefetch`: no compile to pair with).
  """
  spare = _tuning.usable_cores() - 1
  plan = _pruning(bucket) if spare > 0 else None
  if plan is None:
    return {}
  estimates = bucket.prediction.estimates
  quick = [n for n in plan[0] if n != bucket.default and n in estimates
           and estimates[n].compile_s is not None and estimates[n].compile_s <= AHEAD_COMPILE_S]
  ranked = sorted(quick, key=lambda n: estimates[n].ratio)
  return {n: plan[0][n] for n in ranked[:spare]}


def _pays_even_if_mostly_warmup(bucket: Any, payback: Payback, compile_s: float,
                                default_s: float) -> bool:
  """Whether tuning pays back even if only `WARM_SHARE` of the default's first
  call was its own time: then a second call could not change the decision."""
  low = default_s * WARM_SHARE
  cost, compile_bound, _, _ = _expected_cost(bucket, payback, compile_s, low)
  return payback.pays(low, cost) and not compile_bound


def plan(bucket: Any, payback: Payback | None, steps: Steps
         ) -> TuneResult | tuple[dict[str, Any], list[float] | None]:
  """Which candidates to compile: with a horizon, those that can pay back
  (`_weigh_payback`), else those the prediction says could win (`_pruning`).

  Returns:
    The finished result when nothing is left to tune (kept, or no candidate
    could win), else what is compiled already and the default's first call.
  """
  compiled, default_screen = dict(bucket.compiled), None
  if payback is not None and len(bucket.functions) > 1:
    weighed = _weigh_payback(bucket, payback, steps)
    if isinstance(weighed, TuneResult):
      return weighed
    compiled, default_screen = weighed
  else:
    _apply_pruning(bucket, _pruning(bucket))
  if bucket.pruned and list(bucket.functions) == [bucket.default]:
    why = "; ".join(f"{n} {r}" for n, r in bucket.pruned.items())
    return bucket.finish(bucket.default, f"predicted: no other candidate could win ({why})",
                         {bucket.default: default_screen} if default_screen else {}, {})
  return compiled, default_screen


Pruning = tuple[dict[str, Callable[..., Any]], dict[str, str]]


def _pruning(bucket: Any, horizon_s: float | None = None,
             default_compile_s: float = 0.0) -> Pruning | None:
  """The candidates the prediction says could win (`Prediction.could_win`), and
  the others with their reasons; None without a prediction (every one stays)."""
  if bucket.prediction is None:
    return None
  kept, pruned = bucket.prediction.could_win(
      margin=bucket.options.margin, horizon_s=horizon_s, default_compile_s=default_compile_s)
  pruned = {n: r for n, r in pruned.items() if n in bucket.every}
  functions = {n: f for n, f in bucket.every.items()
               if n not in pruned and (n in kept or n == bucket.default)}
  return functions, pruned


def _apply_pruning(bucket: Any, plan: Pruning | None) -> None:
  """Leaves in `bucket.functions` only the candidates `plan` keeps; the others go
  to `bucket.pruned` with their reasons."""
  if plan is None:
    return
  bucket.functions, bucket.pruned = plan
  if bucket.pruned:
    logger.info("autotune %s: predicted; compiling %s, not %s", bucket.label,
                ", ".join(bucket.functions), ", ".join(bucket.pruned))


def _expected_cost(bucket: Any, payback: Payback, compile_s: float,
                   default_s: float) -> tuple[float, bool, Pruning | None, float]:
  """What tuning the candidates that could win is expected to cost: each one's
  predicted compile (the default's where none is predicted) and a call each.
  Changes nothing in `bucket`.

  Returns:
    ``(cost, compile_bound, plan, share)``; `plan` is the pruning for this
    horizon (`_apply_pruning`). The cost is the default's time the horizon
    must hold for tuning to pay back, so that a cached "cannot pay back"
    holds for this horizon and a longer one tunes the bucket
    (`still_cannot_pay_back`): the expected cost over `share`, the most of
    the default's time a candidate could save (1 less the best optimistic
    ratio a prediction measured gives the candidates left, `Estimate.low`;
    1 where one has no measured estimate). Compile-bound: some candidates
    could beat the default, but none would save its own compile within the
    horizon; the cost is then that of the cheapest of them (its compile
    over the fraction it saves), and `share` 1.
  """
  unbounded = _pruning(bucket)
  could_win = [n for n in (unbounded[0] if unbounded else bucket.functions)
               if n != bucket.default]
  plan = _pruning(bucket, horizon_s=payback.most_saved(default_s), default_compile_s=compile_s)
  others = [n for n in (plan[0] if plan else bucket.functions) if n != bucket.default]
  estimates = bucket.prediction.estimates if bucket.prediction is not None else {}

  def compile_of(name: str) -> float:
    est = estimates.get(name)
    return est.compile_s if est is not None and est.compile_s is not None else compile_s

  if could_win and not others and all(n in estimates for n in could_win):
    needed = min(compile_of(n) / max(1.0 - estimates[n].low, 1e-3) for n in could_win)
    cost = max(needed * payback.cost_factor, payback.most_saved(default_s) * 1.001)
    return cost, True, plan, 1.0
  each = [compile_of(n) for n in others]
  cost = payback.expected_cost(
      compile_s=compile_s, call_s=default_s, candidates=len(others),
      compile_each=each if bucket.prediction is not None else None)
  measured = [estimates[n].low for n in others
              if n in estimates and estimates[n].source == "measured"]
  share = (min(1.0, max(1.0 - min(measured), 1e-3))
           if others and len(measured) == len(others) else 1.0)
  return cost / share, False, plan, share
