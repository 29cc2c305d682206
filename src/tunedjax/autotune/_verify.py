"""The whole program is the judge: a tuned program against the untuned one, on real runs.

Kernel selection decides each bucket alone; a kernel faster alone can still
make the whole program slower (a layout change it forces around itself, a
fusion it breaks). `Verifier` is the search that finds out, one program run
at a time, without naming any op family: whoever runs the program (the
`tunedjax.jit` wrapper, for the `Trainer` and for ``tj.jit`` with a
horizon) asks it which *variant* to run next, times that run and reports the
time back. A variant is the set of decisions it vetoes (those buckets run
their family's default): ``frozenset()`` is the tuned program, the set of
every decision the untuned one.

The search, each step a *trial* of two variants run alternately (``rounds``
pairs, the order swapped every pair, a variant's first run, its compile,
not counted):

1. the untuned program against the tuned one: faster by more than the
   margin, the tuned program is verified and kept;
2. otherwise, starting from the untuned program, each group of decisions
   (one per op family, then halves of a group, bisecting) is put back in
   turn and kept when the program is not slower with it; a group that makes
   it slower is split, down to single buckets: those *lose in context*;
3. the program so built is checked once more against the untuned one (no
   compile: both ran already); the faster is kept.

Every trial that needs a new compile must pay back within the calls left
(the horizon): the least gain it can find (``margin`` x the step's time, on
each call left) must exceed what compiling it costs; otherwise the search
stops with the best program seen, and says so.

Example (a fake step time per variant: bucket ``b`` loses in context):
  >>> step_s = {frozenset(): 1.2, frozenset({"a", "b"}): 1.0, frozenset({"a"}): 1.3,
  ...           frozenset({"b"}): 0.9}
  >>> v = Verifier({"a": "conv", "b": "conv"}, calls_left=None, compile_s=0.0)
  >>> while (variant := v.next_variant()) is not None:
  ...   v.record(variant, step_s[variant], compiled=variant in v.compiled)
  >>> v.outcome, sorted(v.final), v.lost
  ('found losers', ['b'], {'b': 'alone'})
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

# The clock that times program runs; tests replace it with a fake one.
_clock: Callable[[], float] = time.perf_counter

DEFAULT_ROUNDS = 5
DEFAULT_MARGIN = 0.03
FASTER, SLOWER, TIE = "faster", "slower", "tie"

# Outcomes.
VERIFIED = "verified"  # the tuned program beat the untuned one
FOUND_LOSERS = "found losers"  # some decisions lose in context; the rest kept
UNTUNED_KEPT = "untuned kept"  # no decision could be kept: the untuned program runs
TIE_KEPT = "tie: tuned kept"  # no faster, no slower; nothing to search, or it cannot pay back
SKIPPED = "skipped: cannot pay back"  # too few calls left to gain from checking


def clock() -> float:
  """The current time on the verification clock (seconds)."""
  return _clock()


@dataclasses.dataclass
class Trial:
  """Two variants run alternately: `ref` and `cand`, their times per run."""

  ref: frozenset[str]
  cand: frozenset[str]
  group: tuple[str, ...] = ()  # the decisions `cand` differs by (empty: tuned vs untuned)
  times: dict[frozenset[str], list[float]] = dataclasses.field(default_factory=dict)

  def ratio(self) -> tuple[float, float]:
    """The median over rounds of cand/ref, and the median absolute deviation."""
    refs, cands = self.times.get(self.ref, []), self.times.get(self.cand, [])
    ratios = [c / r for r, c in zip(refs, cands) if r > 0]
    if not ratios:
      return 1.0, 0.0
    mid = statistics.median(ratios)
    return mid, statistics.median(abs(x - mid) for x in ratios)


def judge(ratio: float, spread: float, margin: float) -> str:
  """``"faster"``, ``"slower"`` or ``"tie"`` for a candidate at `ratio` of its reference.

  The margin is the larger of `margin` and twice the rounds' spread, so a
  noisy trial needs a clearer difference.

  Example:
    >>> judge(0.9, 0.0, 0.03), judge(1.02, 0.0, 0.03), judge(1.1, 0.06, 0.03)
    ('faster', 'tie', 'tie')
  """
  threshold = max(margin, 2.0 * spread)
  if ratio < 1.0 - threshold:
    return FASTER
  return SLOWER if ratio > 1.0 + threshold else TIE


class Verifier:
  """The whole-program search over one program's decisions (see the module doc).

  Args:
    decisions: ``{bucket id: op family}`` of every decision the tuned program
      made that is not its family's default.
    calls_left: how many more times the program is expected to run (None:
      unbounded), for the payback of each compile.
    compile_s: what compiling one variant costs (the tuned program's first call).
    compiled: the variants already compiled (the untuned one when the
      program ran it before its tuning window); the tuned one is assumed.
    rounds: pairs of runs per trial.
    margin: the least relative difference a trial calls faster or slower.
  """

  def __init__(self, decisions: Mapping[str, str], *, calls_left: int | None,
               compile_s: float, compiled: frozenset[frozenset[str]] = frozenset(),
               rounds: int = DEFAULT_ROUNDS, margin: float = DEFAULT_MARGIN):
    if not decisions:
      raise ValueError("Verifier needs at least one decision to verify.")
    self.decisions = dict(decisions)
    self.all = frozenset(self.decisions)
    self.calls_left = calls_left
    self.compile_s = float(compile_s)
    self.compiled: set[frozenset[str]] = {frozenset(), *compiled}
    self.rounds, self.margin = int(rounds), float(margin)
    self.best = frozenset()  # the vetoed set of the program kept so far
    self.lost: dict[str, str] = {}  # bucket id -> "alone" | "group" | "program"
    self.trials: list[Trial] = []
    self.compiles = 0  # variants compiled for the search
    self.calls = 0
    self.ratio: float | None = None  # tuned / untuned, from the first trial
    self.outcome: str | None = None
    self.step_s: float | None = None
    self._queue: list[tuple[str, ...]] = []
    self._plan: list[frozenset[str]] = []
    self._trial: Trial | None = None
    self._final_check = False
    self._tie = False
    self._plan = [frozenset()]  # a probe: one run of the tuned program gives the step's time

  # -- what to run, and what it took ----------------------------------------------

  @property
  def done(self) -> bool:
    return self.outcome is not None

  @property
  def final(self) -> frozenset[str]:
    """The decisions the kept program vetoes (every one: the untuned program)."""
    return self.best

  def next_variant(self) -> frozenset[str] | None:
    """The variant to run next; None once done (then run `final`)."""
    while not self.done and not self._plan:
      self._conclude()
    return None if self.done else self._plan[0]

  def record(self, variant: frozenset[str], seconds: float, *, compiled: bool) -> None:
    """One run of `variant` took `seconds` (`compiled`: it had run before)."""
    self.calls += 1
    if self.calls_left is not None:
      self.calls_left -= 1
    if not self._plan or self._plan[0] != variant:
      return  # not the run asked for: ignored
    self._plan.pop(0)
    if self._trial is None:  # the probe
      self.step_s = float(seconds)
      return
    if not compiled and variant not in self.compiled:
      self.compiled.add(variant)
      self.compiles += 1
      self.compile_s = max(self.compile_s, float(seconds))
      return  # a compile, not a step
    self.compiled.add(variant)
    self._trial.times.setdefault(variant, []).append(float(seconds))

  # -- the search -----------------------------------------------------------------

  def _start(self, trial: Trial) -> None:
    self._trial = trial
    self.trials.append(trial)
    plan = [v for v in (trial.ref, trial.cand) if v not in self.compiled]  # warm-ups
    for i in range(self.rounds):
      plan += [trial.ref, trial.cand] if i % 2 == 0 else [trial.cand, trial.ref]
    self._plan = plan

  def _pays(self, trial: Trial) -> bool:
    """Whether the least gain `trial` can find pays for its compiles and runs."""
    if self.calls_left is None:
      return True
    new = sum(v not in self.compiled for v in {trial.ref, trial.cand})
    runs = 2 * self.rounds + new
    left = self.calls_left - runs
    if left <= 0:
      return False
    step_s = self.step_s or 0.0
    return new == 0 or self.margin * step_s * left > new * self.compile_s

  def _finish(self, outcome: str) -> None:
    self.outcome, self._plan, self._trial = outcome, [], None

  def _conclude(self) -> None:
    """The trial in flight has all its runs: judge it and start the next."""
    trial = self._trial
    if trial is None:  # the probe ran: is checking worth its runs and compiles?
      first = Trial(ref=self.all, cand=frozenset())
      return self._start(first) if self._pays(first) else self._finish(SKIPPED)
    ratio, spread = trial.ratio()
    verdict = judge(ratio, spread, self.margin)
    if len(self.trials) == 1:
      return self._after_first(ratio, verdict)
    if self._final_check:
      return self._after_final(verdict)
    return self._after_group(trial, verdict)

  def _after_first(self, ratio: float, verdict: str) -> None:
    self.ratio = ratio
    if verdict == FASTER:
      return self._finish(VERIFIED)
    self._tie = verdict == TIE
    if len(self.all) == 1:  # the first trial was the only one to make
      if self._tie:
        return self._finish(TIE_KEPT)
      self.lost = {next(iter(self.all)): "alone"}
      self.best = self.all
      return self._done_searching()
    self.best = self.all  # build up from the untuned program
    families: dict[str, list[str]] = {}
    for bucket, family in sorted(self.decisions.items()):
      families.setdefault(family, []).append(bucket)
    groups = [tuple(v) for v in families.values()]
    self._queue = groups if len(groups) > 1 else _halves(groups[0])
    self._next_group()

  def _after_group(self, trial: Trial, verdict: str) -> None:
    if verdict != SLOWER:  # the group is no loss in context: put back
      self.best = trial.cand
    elif len(trial.group) == 1:
      self.lost[trial.group[0]] = "alone"
    else:
      self._queue[:0] = _halves(trial.group)
    self._next_group()

  def _next_group(self) -> None:
    while self._queue:
      group = self._queue.pop(0)
      trial = Trial(ref=self.best, cand=self.best - frozenset(group), group=group)
      if not self._pays(trial):
        return self._give_up()
      return self._start(trial)
    if self.best in (self.all, frozenset()):
      return self._done_searching()
    self._final_check = True
    final = Trial(ref=self.all, cand=self.best)
    if not self._pays(final):
      return self._done_searching()
    self._start(final)

  def _after_final(self, verdict: str) -> None:
    if verdict == SLOWER:  # put back one by one, the groups add up to a loss
      self.best = self.all
    self._done_searching()

  def _give_up(self) -> None:
    """The next trial cannot pay back: keep the best program seen (checked
    against the untuned one, which needs no compile)."""
    self._queue = []
    if self.best == self.all and self._tie and not self.lost:
      self.best = frozenset()  # nothing attributed, and the tuned program is no slower
      return self._finish(TIE_KEPT)
    self._next_group()

  def _done_searching(self) -> None:
    for bucket in self.best:
      self.lost.setdefault(bucket, "program" if self.best == self.all else "group")
    if not self.best:
      self._finish(VERIFIED)
    elif all(how == "program" for how in self.lost.values()):
      self._finish(UNTUNED_KEPT)
    else:
      self._finish(FOUND_LOSERS)

  def summary(self) -> dict[str, Any]:
    """What the search did, as plain values (for reports and ``History.tuning``)."""
    return {"outcome": self.outcome, "decisions": len(self.decisions),
            "tuned_over_untuned": None if self.ratio is None else round(self.ratio, 4),
            "trials": len(self.trials), "runs": self.calls, "compiles": self.compiles,
            "compile_s": round(self.compile_s, 4), "vetoed": len(self.best),
            "lost": dict(sorted(self.lost.items()))}


def _halves(group: tuple[str, ...] | list[str]) -> list[tuple[str, ...]]:
  """`group` split in two (one part when it holds one bucket)."""
  group = tuple(group)
  if len(group) <= 1:
    return [group]
  mid = len(group) // 2
  return [group[:mid], group[mid:]]
