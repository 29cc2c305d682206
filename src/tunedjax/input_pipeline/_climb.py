"""The climb: `Trial`, `TuningResult`, neighbours, seeds and `hill_climb`.

Pure search over `LoaderSettings` with an injected measurement and clock
(`_tuner` supplies the real ones): it never touches grain or the cache, so
it is tested on synthetic speeds with a fake clock.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from tunedjax._errors import ConfigError
from tunedjax._errors import did_you_mean
from tunedjax._errors import format_choices
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import Space
from tunedjax.input_pipeline._settings import TUNE_NAMES

log = logging.getLogger("tunedjax.input_pipeline")

DEFAULT_STARTUP_PER_WORKER_S = 1.5  # until one is measured
NOISE_MARGIN = 0.05


def _knob_attributes(cls: type) -> type:
  """Gives `cls` (which has a `settings` field) one read-only attribute per knob."""
  for k in _settings.KNOBS:
    setattr(cls, k.name, property(
        lambda self, name=k.name: getattr(self.settings, name),
        doc=f"``settings.{k.name}`` (see `LoaderSettings`)."))
  return cls


@_knob_attributes
@dataclasses.dataclass(frozen=True, init=False)
class Trial:
  """One timed run of one setting.

  Each knob of `settings` is also an attribute (``trial.worker_count``,
  ``trial.read_threads``, ``trial.prefetch_buffer``).

  Attributes:
    settings: the `LoaderSettings` measured.
    batches_per_s: batches (or end-to-end steps) per second in the window.
    batches: batches read, warm-up included.
    startup_s: seconds until the first batch (worker start).
    seconds: the whole trial, start to close.
    phase: "climb" (a step of the climb; in this process, a neighbour of
      the best against it, in interleaved rounds), "guess" (the model-based
      first guesses, compared in interleaved rounds: see `compare`),
      "contention" (a consumer-bound start against reading in series, end to
      end), "seed" (see `seed_settings`) or "confirm" (the alternating
      re-measurement).
    cpu_s: this process's CPU seconds per batch in the window (all its
      threads), for a setting read in this process without a consumer;
      else None.

  Example:
    >>> t = Trial(LoaderSettings(worker_count=2, read_threads=1), batches_per_s=9.0,
    ...           batches=20, startup_s=1.2, seconds=3.0)
    >>> t.worker_count, t.prefetch_buffer, t.setting
    (2, 2, (2, 1))
  """

  settings: LoaderSettings
  batches_per_s: float
  batches: int
  startup_s: float
  seconds: float
  phase: str = "climb"
  cpu_s: float | None = None

  def __init__(self, settings: LoaderSettings | Sequence[int] | None = None, *,
               batches_per_s: float, batches: int, startup_s: float, seconds: float,
               phase: str = "climb", cpu_s: float | None = None, **knobs: int):
    object.__setattr__(self, "settings", LoaderSettings.of(settings, **knobs))
    object.__setattr__(self, "batches_per_s", batches_per_s)
    object.__setattr__(self, "batches", batches)
    object.__setattr__(self, "startup_s", startup_s)
    object.__setattr__(self, "seconds", seconds)
    object.__setattr__(self, "phase", phase)
    object.__setattr__(self, "cpu_s", cpu_s)

  @property
  def setting(self) -> tuple[int, int]:
    """``(worker_count, read_threads)``, as earlier versions gave it; `settings`
    has every knob."""
    return (self.settings.worker_count, self.settings.read_threads)


@_knob_attributes
@dataclasses.dataclass(frozen=True, init=False)
class TuningResult:
  """What the tuner measured and chose.

  Each knob of `settings` is also an attribute (``result.worker_count``,
  ``result.read_threads``, ``result.prefetch_buffer``), and the constructor
  takes them as keywords in place of `settings`.

  Attributes:
    settings: the chosen `LoaderSettings`.
    batches_per_s: the median throughput of the chosen setting (batches, or
      end-to-end steps when a consumer was measured, per second).
    start: the `LoaderSettings` the climb started from.
    trials: every trial, in order.
    seconds: the time spent tuning (0 on a cache hit).
    batches: the batches read while tuning (0 on a cache hit).
    stopped: why the tuning ended: "converged", "budget", "max_batches",
      "fast enough" (the start already reads over `fast_enough` batches/s),
      "consumer-bound" (the loader is not the bottleneck: no search; the
      start is kept unless reading in series made the steps faster),
      "no payback" (over the horizon no setting could save enough to pay
      for a trial: read in series without one), "cache" (reused a stored
      choice) or "no budget".
    from_cache: whether the choice came from the persistent cache.
    step_s: the consumer's seconds per step alone (timed on a ready batch,
      or `consumer_s`); None without a consumer.
    batch_s: the loader's seconds per batch alone, read in series (the
      first look, a median); None where it was not measured (a cache hit).
    reason: why the tuner searched, skipped or stopped where it did, in words.

  Example:
    >>> r = TuningResult(worker_count=2, read_threads=0, batches_per_s=25.0,
    ...                  start=(0, 16), trials=(), seconds=0.0, batches=0,
    ...                  stopped="cache", from_cache=True)
    >>> r.setting, r.prefetch_buffer
    ((2, 0), 2)
    >>> r.settings
    LoaderSettings(worker_count=2, read_threads=0, prefetch_buffer=2)
  """

  settings: LoaderSettings
  batches_per_s: float
  start: LoaderSettings
  trials: tuple[Trial, ...]
  seconds: float
  batches: int
  stopped: str
  from_cache: bool = False
  step_s: float | None = None
  batch_s: float | None = None
  reason: str = ""

  def __init__(self, settings: LoaderSettings | Sequence[int] | None = None, *,
               batches_per_s: float, start: LoaderSettings | Sequence[int],
               trials: tuple[Trial, ...], seconds: float, batches: int, stopped: str,
               from_cache: bool = False, step_s: float | None = None,
               batch_s: float | None = None, reason: str = "", **knobs: int):
    object.__setattr__(self, "settings", LoaderSettings.of(settings, **knobs))
    object.__setattr__(self, "batches_per_s", batches_per_s)
    object.__setattr__(self, "start", LoaderSettings.of(start))
    object.__setattr__(self, "trials", tuple(trials))
    object.__setattr__(self, "seconds", seconds)
    object.__setattr__(self, "batches", batches)
    object.__setattr__(self, "stopped", stopped)
    object.__setattr__(self, "from_cache", from_cache)
    object.__setattr__(self, "step_s", step_s)
    object.__setattr__(self, "batch_s", batch_s)
    object.__setattr__(self, "reason", reason)

  @property
  def setting(self) -> tuple[int, int]:
    """``(worker_count, read_threads)``, as earlier versions gave it; `settings`
    has every knob."""
    return (self.settings.worker_count, self.settings.read_threads)

  def table(self) -> str:
    """The trials as a plain-text table, the chosen setting marked."""
    names = [_settings.knob(f).tune_name for f in _FIELDS]
    lines = ["  ".join(names) + "  batches/s  startup(s)  phase"]
    for t in self.trials:
      mark = "  <- chosen" if t.settings == self.settings else ""
      knobs = "  ".join(f"{getattr(t.settings, f):{len(n)}d}" for f, n in zip(_FIELDS, names))
      lines.append(f"{knobs}  {t.batches_per_s:9.2f}  {t.startup_s:10.2f}  {t.phase}{mark}")
    lines.append(f"chose {describe(self.settings)} ({self.batches_per_s:.2f}/s) in "
                 f"{self.seconds:.1f} s, {self.batches} batches; stopped: {self.stopped}")
    if self.reason:
      lines.append(self.reason)
    return "\n".join(lines)


_FIELDS = tuple(f.name for f in dataclasses.fields(LoaderSettings))


def describe(settings: LoaderSettings) -> str:
  """The knobs as ``tune=`` names and values, for logs.

  Example:
    >>> describe(LoaderSettings(worker_count=2, read_threads=1))
    'workers=2 read_threads=1 prefetch_buffer=2'
  """
  return " ".join(f"{_settings.knob(f).tune_name}={getattr(settings, f)}" for f in _FIELDS)


Measure = Callable[[LoaderSettings, float], Trial]


def neighbours(settings: LoaderSettings, space: Space) -> list[LoaderSettings]:
  """The settings one step away: threads down/up, then workers down/up, then
  the per-worker buffer down/up (with workers only), in `KNOBS` order.

  Also the jump to the fewest threads (a synchronous read): thread hand-offs
  cost more than they give on a light pipeline, but the settings in between
  are often worse than both ends, which would stop a plain climb.

  Example:
    >>> space = search_space(LoaderSettings(), maxima={"worker_count": 2},
    ...                      tune=("workers", "read_threads"))
    >>> [(s.worker_count, s.read_threads) for s in neighbours(LoaderSettings(), space)]
    [(0, 8), (0, 0), (1, 16)]
  """
  return space.neighbours(settings)


def seed_settings(start: LoaderSettings, space: Space, *,
                  cpus: int | None = None) -> list[LoaderSettings]:
  """Worker counts doubling from 1, each with about one read thread per core.

  A climb that adds one worker at a time stalls on the plateau where a new
  worker process only takes the cores the read threads were using (measured:
  on 2 cores, 1 worker with 16 threads reads no faster than none, while 2
  workers with 1 thread read 1.36x faster). These settings sample the
  multi-process side of the plateau; their number grows with log2(workers).
  The other knobs keep `start`'s values (within the memory bound).

  Example:
    >>> def seeds(max_workers, cpus):
    ...   space = search_space(LoaderSettings(), maxima={"worker_count": max_workers})
    ...   return [_pair(s) for s in seed_settings(LoaderSettings(), space, cpus=cpus)]
    >>> seeds(2, cpus=2)
    [(1, 2), (2, 1)]
    >>> seeds(8, cpus=8)
    [(1, 8), (2, 4), (4, 2), (8, 1)]
  """
  cpus = cpus or os.cpu_count() or 1
  worker_choices = space.values["worker_count"]
  thread_choices = space.values["read_threads"]
  positive = [t for t in thread_choices if t > 0] or list(thread_choices)
  seeds, w = [], 1
  while w <= max(worker_choices, default=0):
    if w in worker_choices:
      fit = [t for t in positive if t <= max(1, cpus // w)]
      seeds.append(space.fit(start.replace(worker_count=w,
                                           read_threads=max(fit) if fit else min(positive))))
    w *= 2
  return seeds


def search_space(start: LoaderSettings, *, maxima: Mapping[str, int],
                 tune: Sequence[str] = TUNE_NAMES,
                 batches_in_memory: int | None = None) -> Space:
  """The values each knob may take: its ladder up to `maxima`, or, for a knob
  not in `tune`, its `start` value alone.

  Args:
    start: the settings the climb starts from.
    maxima: field name -> the most the knob may be (a knob not named: its
      start value, or its default if higher).
    tune: the ``tune=`` names of the knobs to climb over.
    batches_in_memory: batches the memory budget holds (None: no bound).

  Example:
    >>> space = search_space(LoaderSettings(), maxima={"worker_count": 3,
    ...                      "read_threads": 4}, tune=("workers",))
    >>> space.values["worker_count"], space.values["read_threads"]
    ([0, 1, 2, 3], [16])
  """
  for name in tune:
    if name not in TUNE_NAMES:
      raise ConfigError(f"tune={tuple(tune)!r}: unknown knob {name!r}"
                        f"{did_you_mean(str(name), TUNE_NAMES)}; valid: "
                        f"{format_choices(TUNE_NAMES)}.")
  values = {}
  for k in _settings.KNOBS:
    here = getattr(start, k.name)
    most = maxima.get(k.name, max(here, k.default))
    values[k.name] = k.values(most) if k.tune_name in tune else [here]
  return Space(values, batches_in_memory=batches_in_memory)


def hill_climb(measure: Measure, *, start: LoaderSettings, space: Space, budget_s: float,
               max_batches: int | None, trial_batches: Callable[[LoaderSettings], int],
               margin: float = NOISE_MARGIN, confirm_rounds: int = 2,
               fast_enough: float = float("inf"),
               seeds: Sequence[LoaderSettings] = (),
               known: Sequence[Trial] = (),
               allowance: Callable[[float], float] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> TuningResult:
  """Climbs from `start` to the best-measured setting within the bounds.

  Each round measures every untried neighbour of the current setting and moves
  to the best one if it beats the current by more than `margin`; then the two
  best settings are re-measured alternately and the better median wins. The
  start stays unless the winner beats it by more than `margin` (tuning never
  makes things slower beyond noise). A trial is only started if the time spent
  plus its estimated length fits `budget_s`, and its batches fit `max_batches`;
  `measure` gets the deadline and must stop by it.

  Args:
    measure: `measure(settings, deadline) -> Trial`.
    start: the settings to start from (always measured first).
    space: the values each knob may take and the memory bound
      (`search_space`).
    budget_s: seconds the whole climb may take.
    max_batches: batches all trials together may read (None: no limit).
    trial_batches: batches one trial of a setting reads.
    margin: the relative gain that counts as better than noise.
    confirm_rounds: re-measurements of each of the two best settings.
    fast_enough: stop after the first trial if it reads this fast.
    seeds: settings measured right after `start`, before climbing; the
      climb starts from the best of them all (see `seed_settings`), so it
      can reach a region a step-by-step climb would not cross into.
    known: trials measured before (an earlier phase): their settings are
      not measured again, and count in the choice; they are not in the
      result's `trials`.
    allowance: `allowance(best batches/s so far) -> seconds` the climb may
      take, within `budget_s`: a tuning that must stay a fraction of the
      time the batches take shrinks as it finds faster settings.
    clock: seconds, monotonic (a fake one in tests).

  Returns:
    A `TuningResult` with every trial.

  Example:
    >>> speed = {(0, 16): 10.0, (0, 8): 9.0, (1, 16): 15.0, (1, 8): 14.0,
    ...          (2, 16): 12.0, (1, 4): 13.0}
    >>> def measure(s, deadline):
    ...   return Trial(s, batches_per_s=speed.get(_pair(s), 1.0), batches=10,
    ...                startup_s=0.0, seconds=0.1)
    >>> space = search_space(LoaderSettings(), maxima={"worker_count": 2},
    ...                      tune=("workers", "read_threads"))
    >>> hill_climb(measure, start=LoaderSettings(), space=space, budget_s=60,
    ...            max_batches=1000, trial_batches=lambda s: 10).setting
    (1, 16)
  """
  t0 = clock()
  trials: list[Trial] = []
  scores: dict[LoaderSettings, list[float]] = {}
  for t in known:
    scores.setdefault(t.settings, []).append(t.batches_per_s)
  batches = 0
  stopped = "converged"

  def estimate(settings: LoaderSettings) -> float:
    seen = [*known, *trials]
    same = [t.seconds for t in seen if t.worker_count == settings.worker_count]
    if same:
      # A trial in this process stops at the deadline (its threads start at
      # once): the cheapest one bounds it. A worker start cannot be cut short.
      return min(same) if settings.worker_count == 0 else max(same)
    per_worker = [t.startup_s / t.worker_count for t in seen if t.worker_count]
    startup = ((max(per_worker) if per_worker else DEFAULT_STARTUP_PER_WORKER_S)
               * settings.worker_count)
    body = max((t.seconds - t.startup_s for t in seen), default=0.0)
    return startup + body

  def run(settings: LoaderSettings, phase: str) -> bool:
    nonlocal batches, stopped
    if max_batches is not None and batches + trial_batches(settings) > max_batches:
      stopped = "max_batches"
      return False
    spent = clock() - t0
    budget = budget_s
    if allowance is not None and scores:
      budget = min(budget, allowance(max(score(s) for s in scores)))
    if spent >= budget or spent + estimate(settings) > budget:
      stopped = "budget"
      return False
    trial = dataclasses.replace(measure(settings, t0 + budget), phase=phase)
    trials.append(trial)
    batches += trial.batches
    scores.setdefault(settings, []).append(trial.batches_per_s)
    log.debug("dataloader tuning trial %d (%s): %s %.2f batches/s (%.4f s/batch), "
              "startup %.2f s, %d batches", len(trials), phase, describe(settings),
              trial.batches_per_s,
              1.0 / trial.batches_per_s if trial.batches_per_s else float("inf"),
              trial.startup_s, trial.batches)
    return True

  def score(settings: LoaderSettings) -> float:
    return statistics.median(scores[settings])

  log.debug("========= tunedjax DataLoader auto-tune =========")
  log.debug("start: %s; range: %s; memory bound: %s batches; budget %.1f s, %s batches",
            describe(start), {k: list(v) for k, v in space.values.items()},
            space.batches_in_memory, budget_s, max_batches)
  if start not in scores and not run(start, "climb"):
    return TuningResult(start, batches_per_s=0.0, start=start, trials=(),
                        seconds=clock() - t0, batches=0,
                        stopped="no budget" if stopped == "budget" else stopped)
  current = start
  climbing = score(start) < fast_enough
  if not climbing:
    stopped = "fast enough"
  for seed in (seeds if climbing else ()):
    if seed not in scores and not run(seed, "seed"):
      climbing = False
      break
  if scores:
    best_seed = max(scores, key=score)
    if score(best_seed) > score(current) * (1 + margin):
      current = best_seed
  while climbing:
    untried = [n for n in space.neighbours(current) if n not in scores]
    if not untried:
      break
    for n in untried:
      if not run(n, "climb"):
        climbing = False
        break
    best = max(scores, key=score)
    if climbing and score(best) > score(current) * (1 + margin):
      current = best
    elif climbing:
      stopped = "converged"
      climbing = False

  top = sorted(scores, key=score, reverse=True)[:2]
  for r in range(confirm_rounds if len(top) == 2 else 0):
    for settings in (top if r % 2 == 0 else top[::-1]):
      if not run(settings, "confirm"):
        break
  winner = max(top, key=score)
  if winner != start and score(winner) <= score(start) * (1 + margin):
    winner = start
  result = TuningResult(winner, batches_per_s=score(winner), start=start,
                        trials=tuple(trials), seconds=clock() - t0, batches=batches,
                        stopped=stopped)
  log.debug("auto-tune dataloader best: %s (%.2f batches/s, start %.2f) after %d trials, "
            "%.1f s", describe(winner), score(winner), score(start), len(trials),
            result.seconds)
  return result


def _pair(settings: LoaderSettings) -> tuple[int, int]:
  return (settings.worker_count, settings.read_threads)


def compare(measure: Measure, candidates: Sequence[LoaderSettings], *, rounds: int,
            left: Callable[[], float], estimate: Callable[[LoaderSettings], float],
            margin: float = NOISE_MARGIN, phase: str = "round",
            clock: Callable[[], float] = time.perf_counter,
            ) -> tuple[list[Trial], LoaderSettings | None, dict[LoaderSettings, float]]:
  """Times `candidates` side by side in interleaved rounds; the best wins.

  Each round measures every candidate once, the order rotating from round to
  round, so that a host whose speed drifts (other processes on the shared
  cores) slows every candidate of a round alike; a candidate's score is the
  median over the complete rounds of its rate divided by the rate of
  `candidates[0]` (the incumbent) in the same round. A challenger wins only
  if its score beats the incumbent's (1.0) by more than `margin`. A round
  starts only if the sum of `estimate` over the candidates fits in `left()`
  seconds, and a trial only if its own estimate does; the first round that
  does not fit ends the comparison (a round cut short keeps its trials, but
  only complete rounds are scored).

  Args:
    measure: `measure(settings, deadline) -> Trial`.
    candidates: the incumbent first, then the challengers.
    rounds: the most rounds to run.
    left: seconds the comparison may still take.
    estimate: seconds a trial of a setting is expected to take.
    margin: the relative gain that counts as better than noise.
    phase: the `Trial.phase` the trials are given.
    clock: seconds, monotonic.

  Returns:
    (trials, the winner or None where no round was complete, the scores).

  Example:
    >>> speed = {0: 10.0, 2: 30.0, 4: 20.0}
    >>> def measure(s, deadline):
    ...   return Trial(s, batches_per_s=speed[s.read_threads], batches=4,
    ...                startup_s=0.0, seconds=0.01)
    >>> trials, best, scores = compare(
    ...     measure, [LoaderSettings(0, t) for t in (0, 2, 4)], rounds=2,
    ...     left=lambda: 1.0, estimate=lambda s: 0.01)
    >>> len(trials), best.read_threads, scores[best]
    (6, 2, 3.0)
  """
  trials: list[Trial] = []
  complete: list[dict[LoaderSettings, float]] = []
  n = len(candidates)
  for r in range(rounds):
    rates: dict[LoaderSettings, float] = {}
    if sum(estimate(c) for c in candidates) > left():
      break  # a round that cannot finish would only be thrown away
    for settings in [*candidates[r % n:], *candidates[:r % n]]:
      remaining = left()
      if remaining <= 0 or estimate(settings) > remaining:
        break
      trial = dataclasses.replace(measure(settings, clock() + remaining), phase=phase)
      trials.append(trial)
      rates[settings] = trial.batches_per_s
      log.debug("dataloader tuning %s %d: %s %.2f batches/s, %.4f s", phase, r + 1,
                describe(settings), trial.batches_per_s, trial.seconds)
    if len(rates) < n:
      break
    complete.append(rates)
  if not complete:
    return trials, None, {}
  incumbent = candidates[0]
  scores = {c: statistics.median(r[c] / max(r[incumbent], 1e-12) for r in complete)
            for c in candidates}
  best = max(candidates, key=lambda c: scores[c])
  if scores[best] <= 1.0 + margin:
    best = incumbent
  return trials, best, scores
