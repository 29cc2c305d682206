"""How the loader's tuner chooses `LoaderSettings`: one search, in named stages.

`search` reads as the algorithm. `first_look`: the step timed alone, then a
few batches read here in series (what a step and a batch cost). Where the
loader is not the bottleneck (`consumer_bound`), only `check_contention`;
where a tenth of what any setting could save does not pay for a trial,
`no_payback`. Else the read threads (and buffer) at the start's worker
count: `search_threads` in this process (`thread_guess`, then the ladder's
neighbours, in interleaved rounds) or `climb_at_start_workers`; then
`search_workers`, where a tenth of what workers could save (`worker_floor`)
pays for a worker trial (`worker_trial_cost`). All of it within `OVERHEAD`
of the horizon's time at the best pace found (`allowance_for`); the start
stays unless beaten beyond noise (`keep_start`). Each rule is a function of
its own; the search measures only through a `Bench`, so tests run it on
synthetic speeds with a fake clock.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from tunedjax._tuning import usable_cores
from tunedjax.input_pipeline._result import Trial
from tunedjax.input_pipeline._result import TuningResult
from tunedjax.input_pipeline._result import describe
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import Space

log = logging.getLogger("tunedjax.input_pipeline")

OVERHEAD = 0.1  # tuning costs at most this fraction of the horizon's time
NOISE_MARGIN = 0.05  # the relative gain that counts as better than noise
CONSUMER_CALLS = 3  # the step is timed alone on this many calls, at most
SERIAL_BATCHES = 8  # the first look reads this many batches in series, at most,
SERIAL_LIMIT_S = 0.02  # and stops after this long
MIN_ALLOWANCE_S = 0.02  # the least time a search may take, beyond the first look
MIN_WINDOW_S = 0.004  # the shortest timing window of a trial
# A trial window is the allowance over this many (a window per trial of three
# rounds of three guesses and two rounds of two pairs, and some left).
WINDOWS_PER_ALLOWANCE = 20
GUESS_ROUNDS = 3  # interleaved rounds of the first guesses (a median of three)
ROUNDS = 2  # and of each pair compared after them
CONFIRM_ROUNDS = 2  # a climb re-measures its two best settings this often
# Until measured: a read thread's start (1-2 ms on the project's loaded 2-core
# host), a worker process's, and what any trial costs beyond its window and
# first wave (an iterator opened and closed, the last wave: 2-9 ms there).
THREAD_START_S = 0.002
DEFAULT_STARTUP_PER_WORKER_S = 1.5
TRIAL_START_S = 0.002
# The contention check: rounds of the start against reading in series, about
# this many steps a trial.
CONTENTION_ROUNDS = 2
CONTENTION_STEPS = 3

Measure = Callable[[LoaderSettings, float], Trial]  # (settings, deadline) -> a trial


@dataclasses.dataclass(frozen=True)
class Bench:
  """What the search measures through (`_tuner` makes the real one).

  Attributes:
    serial: `(batches, limit_s) -> (seconds, CPU seconds, batches read)` of a
      batch read here in series (medians).
    step: `(calls, limit_s) -> seconds` of a step alone; None without one.
    trial: `window_s -> Measure` whose timing windows last at most that.
  """

  serial: Callable[[int, float], tuple[float, float, int]]
  step: Callable[[int, float], float | None]
  trial: Callable[[float], Measure]


class Look(NamedTuple):
  """The first look: a batch read here in series, and the step alone."""

  serial_s: float  # seconds a batch read in series (a median)
  serial_cpu_s: float  # this process's CPU seconds of it
  batches: int  # the batches it read
  step_s: float | None  # seconds a step alone; None without a consumer

  @property
  def e2e_s(self) -> float:
    """A batch read in series and its step."""
    return self.serial_s + (self.step_s or 0.0)


class Scores(dict):
  """Each measured setting's rates, in the order first measured; a
  setting's score is their median."""

  def add(self, trials: Sequence[Trial]) -> None:
    for t in trials:
      self.setdefault(t.settings, []).append(t.batches_per_s)

  def of(self, settings: LoaderSettings) -> float:
    return statistics.median(self[settings])

  def best(self) -> LoaderSettings:
    """The best score's setting (on a tie, the first measured)."""
    return max(self, key=self.of)


def _ms(seconds: float | None) -> str:
  return "?" if seconds is None else f"{seconds * 1e3:.3g} ms"


# --- the rules -------------------------------------------------------------------


def beats(rate: float, incumbent: float, margin: float) -> bool:
  """Whether `rate` beats `incumbent` by more than `margin` (noise)."""
  return rate > incumbent * (1 + margin)


def keep_start(winner: LoaderSettings, start: LoaderSettings, scores: Scores,
               margin: float) -> LoaderSettings:
  """`winner`, unless it does not beat a measured `start` beyond `margin`:
  tuning never makes things slower beyond noise."""
  if winner != start and start in scores and not beats(scores.of(winner), scores.of(start),
                                                       margin):
    return start
  return winner


def consumer_bound(look: Look, margin: float) -> bool:
  """Whether a batch read in series costs the step at most `margin`."""
  return look.step_s is not None and look.serial_s <= margin * look.step_s


def allowance_for(pace_s: float, n: int, budget_s: float) -> float:
  """Seconds a tuning may take: `OVERHEAD` of `n` batches at `pace_s`, at
  least `MIN_ALLOWANCE_S`, within `budget_s`."""
  return min(budget_s, max(OVERHEAD * n * pace_s, MIN_ALLOWANCE_S))


def trial_window(look: Look, n: int, usable: int) -> float:
  """A trial's timing window, sized for the fastest any setting could be
  (the step, or this process's CPU a batch over the usable cores), so that
  the allowance shrinking to that pace leaves the trials done in it."""
  fastest_s = max(look.step_s or 0.0, look.serial_cpu_s / usable)
  return min(2.0, max(MIN_WINDOW_S, OVERHEAD * n * fastest_s / WINDOWS_PER_ALLOWANCE))


def trial_estimate(settings: LoaderSettings, trials: Sequence[Trial], look: Look, *,
                   usable: int, window_s: float) -> float:
  """Seconds a trial in this process takes: the shortest of the same setting
  so far; else a start, a first wave (a batch per usable core, and each
  thread's start: the most one took so far) and the window."""
  same = [t.seconds for t in trials if t.settings == settings]
  if same:
    return min(same)
  threads = settings.read_threads
  per_thread = [t.startup_s / t.read_threads for t in trials if t.read_threads]
  wave_s = (look.serial_s * max(1.0, threads / usable)
            + max(per_thread, default=THREAD_START_S) * threads)
  return TRIAL_START_S + wave_s + max(window_s, 2 * look.e2e_s)


def possible_saving(look: Look, n: int, usable: int) -> float:
  """The most any setting can save over `n` batches read in series: the
  reading itself with a consumer (threads overlap it with the step), else
  what spreading its CPU time over the usable cores leaves of it."""
  if look.step_s is not None:
    return n * look.serial_s
  return n * max(0.0, look.serial_s - look.serial_cpu_s / usable)


def in_series(start: LoaderSettings, space: Space) -> LoaderSettings | None:
  """`start` without read threads or workers, where the space has them."""
  if 0 in space.values["worker_count"] and 0 in space.values["read_threads"]:
    return space.fit(start.replace(worker_count=0, read_threads=0))
  return None


def startup_estimate(settings: LoaderSettings, serial_s: float, usable: int) -> float:
  """Seconds to the first batch, none measured: worker and thread starts, a wave."""
  threads = settings.read_threads * max(1, settings.worker_count)
  return (DEFAULT_STARTUP_PER_WORKER_S * settings.worker_count + THREAD_START_S * threads
          + serial_s * max(1.0, threads / usable))


def climb_estimate(settings: LoaderSettings, seen: Sequence[Trial]) -> float:
  """Seconds a climb's trial takes: at a worker count seen, the cheapest in
  this process (its trials stop at the deadline), else the dearest (a worker
  start cannot be cut short); else a start per worker and the longest body."""
  same = [t.seconds for t in seen if t.worker_count == settings.worker_count]
  if same:
    return min(same) if settings.worker_count == 0 else max(same)
  per_worker = [t.startup_s / t.worker_count for t in seen if t.worker_count]
  startup = ((max(per_worker) if per_worker else DEFAULT_STARTUP_PER_WORKER_S)
             * settings.worker_count)
  return startup + max((t.seconds - t.startup_s for t in seen), default=0.0)


def worker_floor(look: Look, trials: Sequence[Trial], usable: int) -> tuple[float, float, float]:
  """(seconds a batch, share of a core, CPU seconds a batch): the fastest
  workers could read, this process's least CPU time a batch over the usable
  cores at the share of a core a thread gets now (the serial read's CPU over
  its wall time: on a busy host a worker waits too), no faster than the step."""
  share = min(1.0, max(0.05, look.serial_cpu_s / look.serial_s))
  cpu_s = min([look.serial_cpu_s, *(t.cpu_s for t in trials if t.cpu_s is not None)])
  return max(look.step_s or 0.0, cpu_s / (usable * share)), share, cpu_s


def worker_trial_cost(space: Space, start: LoaderSettings, trials: Sequence[Trial],
                      window_s: float) -> float:
  """Seconds the cheapest worker trial takes: a process start for each of
  the fewest workers, and the longest trial body so far (else a window)."""
  others = [w for w in space.values["worker_count"] if w != start.worker_count]
  fewest = min(w for w in others if w > 0) if any(w > 0 for w in others) else 0
  body_s = max((t.seconds - t.startup_s for t in trials), default=window_s)
  return DEFAULT_STARTUP_PER_WORKER_S * fewest + body_s


def thread_guess(start: LoaderSettings, space: Space, *, cores: int) -> list[LoaderSettings]:
  """The read-thread settings a search in this process measures first: none
  (the read in series, the incumbent), about one thread per core, and twice
  that (a thread waiting on the GIL or on I/O leaves its core to another),
  each the largest ladder value within it; `start` alone where the threads
  are not tuned.

  Example:
    >>> from tunedjax.input_pipeline._settings import search_space
    >>> space = search_space(LoaderSettings(), maxima={"worker_count": 0})
    >>> [s.read_threads for s in thread_guess(LoaderSettings(), space, cores=2)]
    [0, 2, 4]
  """
  ladder = space.values["read_threads"]
  if len(ladder) < 2:
    return [start]
  positive = [t for t in ladder if t > 0]

  def snap(threads: int) -> int:
    fit = [t for t in positive if t <= threads]
    return max(fit) if fit else min(positive)

  wanted = ([0] if 0 in ladder else []) + [snap(cores), snap(2 * cores)]
  out: list[LoaderSettings] = []
  for threads in wanted:
    settings = space.fit(start.replace(read_threads=threads))
    if settings not in out:
      out.append(settings)
  return out


def thread_neighbours(settings: LoaderSettings, ladder: Sequence[int]) -> list[LoaderSettings]:
  """`settings` with the read threads one rung down and one up the ladder."""
  i = ladder.index(settings.read_threads)
  return [settings.replace(read_threads=ladder[j]) for j in (i - 1, i + 1)
          if 0 <= j < len(ladder)]


def seed_settings(start: LoaderSettings, space: Space, *,
                  cpus: int | None = None) -> list[LoaderSettings]:
  """Worker counts doubling from 1, each with about one read thread per core.

  A climb that adds one worker at a time stalls on the plateau where a new
  worker process only takes the cores the read threads were using (measured:
  on 2 cores, 1 worker with 16 threads reads no faster than none, while 2
  workers with 1 thread read 1.36x faster). These settings sample the
  multi-process side of the plateau; the other knobs keep `start`'s values.

  Example:
    >>> from tunedjax.input_pipeline._settings import search_space
    >>> space = search_space(LoaderSettings(), maxima={"worker_count": 8})
    >>> [(s.worker_count, s.read_threads) for s in seed_settings(LoaderSettings(), space, cpus=8)]
    [(1, 8), (2, 4), (4, 2), (8, 1)]
  """
  cpus = cpus or usable_cores()
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


# --- the search ------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """One search under way: its first look, its trials and its clock."""

  bench: Bench
  start: LoaderSettings
  space: Space
  look: Look
  n: int  # the expected batches: the horizon
  budget_s: float
  margin: float
  usable: int  # usable cores
  clock: Callable[[], float]
  t0: float
  trials: list[Trial] = dataclasses.field(default_factory=list)
  scores: Scores = dataclasses.field(default_factory=Scores)

  def __post_init__(self) -> None:
    self.deadline = self.t0 + self.budget_s
    self.window_s = trial_window(self.look, self.n, self.usable)
    self.trial = self.bench.trial(self.window_s)  # a `Measure` with that window

  def record(self, trials: Sequence[Trial]) -> None:
    self.trials.extend(trials)
    self.scores.add(trials)

  def allowance(self, rate: float = 0.0) -> float:
    """The search's allowance at the pace of the best rate measured (or `rate`)."""
    best = max([*(self.scores.of(s) for s in self.scores), rate])
    pace_s = max(1.0 / best if best > 0 else self.look.serial_s, self.look.step_s or 0.0)
    return allowance_for(pace_s, self.n, self.budget_s)

  def left(self, rate: float = 0.0) -> float:
    """The allowance less what the search has spent."""
    return self.allowance(rate) - (self.clock() - self.t0)

  def from_now(self) -> Callable[[float], float]:
    """`left` as a climb that starts now counts it (from its own start)."""
    began = self.clock()
    return lambda rate: self.left(rate) + (self.clock() - began)

  def estimate(self, settings: LoaderSettings) -> float:
    return trial_estimate(settings, self.trials, self.look, usable=self.usable,
                          window_s=self.window_s)

  def done(self, settings: LoaderSettings, rate: float, stopped: str,
           reason: str) -> TuningResult:
    log.debug("dataloader tuning: %s", reason)
    return TuningResult(settings, batches_per_s=rate, start=self.start, trials=tuple(self.trials),
                        seconds=self.clock() - self.t0,
                        batches=self.look.batches + sum(t.batches for t in self.trials),
                        stopped=stopped, step_s=self.look.step_s, batch_s=self.look.serial_s,
                        reason=reason)


def search(bench: Bench, *, start: LoaderSettings, space: Space, budget_s: float,
           margin: float, expected_batches: int, usable: int,
           clock: Callable[[], float]) -> TuningResult:
  """Chooses the settings that read fastest, in the stages the module lists,
  from `start` within `space`, on `usable` cores; the tuning pays back within
  `expected_batches` and ends by `budget_s`."""
  t0 = clock()
  run = Run(bench, start, space, first_look(bench, budget_s=budget_s), n=expected_batches,
            budget_s=budget_s, margin=margin, usable=usable, clock=clock, t0=t0)
  if consumer_bound(run.look, margin):
    return check_contention(run)
  guess = thread_guess(start, space, cores=usable)
  stop = no_payback(run, guess)
  if stop is not None:
    return stop
  if start.worker_count == 0:
    best, stopped = search_threads(run, guess)
  else:
    best, stopped = climb_at_start_workers(run)
  if best not in run.scores:  # nothing measured: the first look stands for it
    return run.done(best, 1.0 / run.look.e2e_s, stopped,
                    f"chose {describe(best)}: no trial fitted in {OVERHEAD:.0%} of the "
                    f"{run.n} batches' time ({run.allowance():.3g} s)")
  if len(space.values["worker_count"]) < 2:
    return run.done(best, run.scores.of(best), stopped,
                    f"chose {describe(best)}: searched the read threads and buffer only")
  return search_workers(run, best)


def first_look(bench: Bench, *, budget_s: float) -> Look:
  """The step timed alone (`CONSUMER_CALLS`, within a tenth of the budget),
  then a few batches read here in series (`SERIAL_BATCHES`, within
  `SERIAL_LIMIT_S`), one after the other."""
  step_s = bench.step(CONSUMER_CALLS, max(0.0, budget_s / 10))
  serial_s, serial_cpu_s, batches = bench.serial(SERIAL_BATCHES,
                                                 min(SERIAL_LIMIT_S, budget_s / 100))
  return Look(serial_s, serial_cpu_s, batches, step_s)


def check_contention(run: Run) -> TuningResult:
  """The loader is not the bottleneck: keeps the start unless its read threads
  (or workers) slow the step they share the cores (and the GIL) with.

  Steps with their batches, end to end, at the start and read in series,
  `CONTENTION_ROUNDS` interleaved rounds of about `CONTENTION_STEPS` steps
  each; read in series wins if it beats the start by more than the margin.
  This runs only if it fits in `OVERHEAD` of the horizon's steps (and the
  budget).
  """
  look, start, series, clock = run.look, run.start, in_series(run.start, run.space), run.clock
  base = (f"a batch read in series takes {_ms(look.serial_s)}, the step {_ms(look.step_s)}: "
          f"batches cost the step at most {look.serial_s / look.step_s:.1%}")
  kept = f"kept {describe(start)}: the loader is not the bottleneck ({base})"
  if series is None or start == series:
    return run.done(start, 1.0 / look.e2e_s, "consumer-bound", kept)
  startup_s = startup_estimate(start, look.serial_s, run.usable)
  estimate_s = CONTENTION_ROUNDS * ((CONTENTION_STEPS + 1) * look.e2e_s * 2 + startup_s)
  allowance = min(run.deadline - run.t0, OVERHEAD * run.n * look.step_s)
  if estimate_s > allowance - (clock() - run.t0):
    return run.done(start, 1.0 / look.e2e_s, "consumer-bound",
                    f"{kept}; checking that its threads do not slow the step "
                    f"(~{estimate_s:.2g} s) does not fit in {OVERHEAD:.0%} of the {run.n} "
                    f"steps' time")
  trials, best, _ = compare(
      run.bench.trial((CONTENTION_STEPS - 0.5) * look.e2e_s), [start, series],
      rounds=CONTENTION_ROUNDS, left=lambda: allowance - (clock() - run.t0),
      estimate=lambda s: (CONTENTION_STEPS + 1) * look.e2e_s + (startup_s if s == start else 0.0),
      margin=run.margin, phase="contention", clock=clock)
  run.record(trials)
  if best is None:
    return run.done(start, 1.0 / look.e2e_s, "consumer-bound",
                    f"{kept}; the check of its threads against the step ran out of time")
  step_s = {s: 1.0 / run.scores.of(s) for s in (start, series)}
  steps = (f"a step with its batch takes {_ms(step_s[start])} at the start, "
           f"{_ms(step_s[series])} read in series")
  if best == series:
    return run.done(series, 1.0 / step_s[series], "consumer-bound",
                    f"chose {describe(series)}: the loader is not the bottleneck ({base}), "
                    f"but the start's threads slow the step ({steps})")
  return run.done(start, 1.0 / step_s[start], "consumer-bound",
                  f"kept {describe(start)}: the loader is not the bottleneck ({base}; {steps})")


def no_payback(run: Run, guess: Sequence[LoaderSettings]) -> TuningResult | None:
  """Reads in series without a trial where a tenth of `possible_saving` does
  not pay for the least comparison (one round of the first guesses; one
  trial from a start with workers); None where a search may pay back."""
  look, n = run.look, run.n
  save_s = possible_saving(look, n, run.usable)
  if run.start.worker_count == 0 and len(guess) > 1:
    least_s = sum(run.estimate(g) for g in guess)
    least = (f"one round of the first guesses ("
             f"{', '.join(str(g.read_threads) for g in guess)} read threads: "
             f"~{_ms(least_s)})")
  else:
    least_s = run.window_s + 2 * look.e2e_s
    least = f"one trial (~{_ms(least_s)})"
  if OVERHEAD * save_s >= least_s:
    return None
  series = in_series(run.start, run.space)
  chosen = series if series is not None else run.start
  return run.done(chosen, 1.0 / look.e2e_s, "no payback",
                  f"chose {describe(chosen)} without a trial: {n} batches read in series take "
                  f"{n * look.serial_s:.3g} s (one in {_ms(look.serial_s)}), so no setting can "
                  f"save more than {save_s:.3g} s over them, and {OVERHEAD:.0%} of that does "
                  f"not pay for {least}")


def search_threads(run: Run, guess: Sequence[LoaderSettings]) -> tuple[LoaderSettings, str]:
  """In this process: the first guesses compared in `GUESS_ROUNDS`
  interleaved rounds, then the ladder's neighbours of the winner against it
  (`ROUNDS` rounds) until none wins; rounds stop where the allowance ends.

  Returns:
    (the best setting, why the search stopped: "converged" or "budget").
  """
  ladder = run.space.values["read_threads"]
  new, best, _ = compare(run.trial, guess, rounds=GUESS_ROUNDS, left=run.left,
                         estimate=run.estimate, margin=run.margin, phase="guess",
                         clock=run.clock)
  run.record(new)
  tried = set(guess)
  while best is not None:
    near = [s for s in thread_neighbours(best, ladder) if s not in tried]
    if not near:
      break
    tried.update(near)
    new, winner, _ = compare(run.trial, [best, *near], rounds=ROUNDS, left=run.left,
                             estimate=run.estimate, margin=run.margin, phase="climb",
                             clock=run.clock)
    run.record(new)
    if winner is None:
      return best, "budget"
    if winner == best:
      break
    best = winner
  if best is None:  # not one whole round fitted: the best single trial, if any
    return (run.scores.best() if run.scores else guess[0]), "budget"
  return best, "converged"


def climb_at_start_workers(run: Run) -> tuple[LoaderSettings, str]:
  """From a start with workers: a climb over threads and buffer at its worker count."""
  here = dataclasses.replace(run.space, values={**run.space.values,
                                                "worker_count": [run.start.worker_count]})
  climb = hill_climb(run.trial, start=run.start, space=here,
                     budget_s=max(run.window_s, min(run.allowance(), run.deadline - run.clock())),
                     margin=run.margin, clock=run.clock, allowance=run.from_now())
  run.record(climb.trials)
  return climb.settings, climb.stopped


def search_workers(run: Run, best: LoaderSettings) -> TuningResult:
  """Worker processes, only if a tenth of what they could save over the
  horizon (down to `worker_floor`) pays for a worker trial and fits what is
  left of the allowance: then a climb over every knob from `best`, seeded."""
  n, best_s = run.n, 1.0 / run.scores.of(best)
  floor_s, share, cpu_s = worker_floor(run.look, run.trials, run.usable)
  gain_s = best_s - floor_s
  cost_s = worker_trial_cost(run.space, run.start, run.trials, run.window_s)
  payoff_s = gain_s * n
  where = f"{run.usable} cores at {share:.0%} of a core each"
  if gain_s <= run.margin * best_s:
    return run.done(best, run.scores.of(best), "converged",
                    f"chose {describe(best)}: worker processes cannot read faster (this "
                    f"process takes {_ms(cpu_s)} of CPU a batch, {_ms(floor_s)} over "
                    f"{where}; it reads one in {_ms(best_s)})")
  phase_s = min(OVERHEAD * payoff_s, run.left())
  if phase_s < cost_s:
    return run.done(best, run.scores.of(best), "converged",
                    f"chose {describe(best)}: worker processes could save at most "
                    f"{payoff_s:.2f} s over {n} batches (one in {_ms(best_s)} now, "
                    f"{_ms(floor_s)} at best over {where}); a worker trial (~{cost_s:.1f} s) "
                    f"does not fit in {OVERHEAD:.0%} of that or in what is left of "
                    f"{OVERHEAD:.0%} of the batches' time ({max(0.0, phase_s):.2f} s)")
  climbs_both = len(run.space.values["read_threads"]) > 1
  climb = hill_climb(run.trial, start=best, space=run.space,
                     budget_s=max(0.0, min(phase_s, run.deadline - run.clock())),
                     margin=run.margin, clock=run.clock, known=tuple(run.trials),
                     allowance=run.from_now(),
                     seeds=seed_settings(best, run.space, cpus=run.usable) if climbs_both else ())
  run.record(climb.trials)
  winner = keep_start(climb.settings, run.start, run.scores, run.margin)
  return run.done(winner, run.scores.of(winner), climb.stopped,
                  f"chose {describe(winner)} after the worker search (workers could save "
                  f"up to {payoff_s:.1f} s over {n} batches)")


# --- the two ways of comparing settings --------------------------------------------


def compare(measure: Measure, candidates: Sequence[LoaderSettings], *, rounds: int,
            left: Callable[[], float], estimate: Callable[[LoaderSettings], float],
            margin: float = NOISE_MARGIN, phase: str = "round",
            clock: Callable[[], float] = time.perf_counter,
            ) -> tuple[list[Trial], LoaderSettings | None, dict[LoaderSettings, float]]:
  """Times `candidates` (the incumbent first) side by side in interleaved rounds.

  Each round measures every candidate once, the order rotating, so that a
  host whose speed drifts slows every candidate of a round alike; a score is
  the median over the complete rounds of a candidate's rate over the
  incumbent's in the same round, and a challenger wins only if it beats 1.0
  by more than `margin`. A round starts only if its `estimate`s fit in
  `left()` seconds, a trial only if its own does (a round cut short keeps its
  trials, unscored). The trials get `phase`.

  Returns:
    (trials, the winner or None where no round was complete, the scores).
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
  return trials, best if beats(scores[best], 1.0, margin) else incumbent, scores


@dataclasses.dataclass
class _Climb:
  """One climb under way: its trials, scores, and why it stopped."""

  measure: Measure
  budget_s: float
  allowance: Callable[[float], float] | None
  known: Sequence[Trial]
  clock: Callable[[], float]
  t0: float
  trials: list[Trial] = dataclasses.field(default_factory=list)
  scores: Scores = dataclasses.field(default_factory=Scores)
  stopped: str = "converged"

  def run(self, settings: LoaderSettings, phase: str) -> bool:
    """Measures `settings` if its trial fits what is left; else stops the climb."""
    spent = self.clock() - self.t0
    budget = self.budget_s
    if self.allowance is not None and self.scores:
      budget = min(budget, self.allowance(max(self.scores.of(s) for s in self.scores)))
    if spent >= budget or spent + climb_estimate(settings, [*self.known, *self.trials]) > budget:
      self.stopped = "budget"
      return False
    trial = dataclasses.replace(self.measure(settings, self.t0 + budget), phase=phase)
    self.trials.append(trial)
    self.scores.add([trial])
    log.debug("dataloader tuning trial %d (%s): %s %.2f batches/s (%.4f s/batch), "
              "startup %.2f s, %d batches", len(self.trials), phase, describe(settings),
              trial.batches_per_s,
              1.0 / trial.batches_per_s if trial.batches_per_s else float("inf"),
              trial.startup_s, trial.batches)
    return True

  def step_up(self, space: Space, current: LoaderSettings, margin: float) -> None:
    """Measures the untried neighbours of `current` and moves to the best of
    all while it beats `current` by more than `margin`."""
    while True:
      untried = [n for n in space.neighbours(current) if n not in self.scores]
      if not untried or not all(self.run(n, "climb") for n in untried):
        return  # all(): each in turn, until one does not fit
      best = self.scores.best()
      if not beats(self.scores.of(best), self.scores.of(current), margin):
        return
      current = best

  def confirm_top_two(self) -> list[LoaderSettings]:
    """Re-measures the two best settings alternately (`CONFIRM_ROUNDS`)."""
    top = sorted(self.scores, key=self.scores.of, reverse=True)[:2]
    for r in range(CONFIRM_ROUNDS if len(top) == 2 else 0):
      for settings in (top if r % 2 == 0 else top[::-1]):
        if not self.run(settings, "confirm"):
          break
    return top


def hill_climb(measure: Measure, *, start: LoaderSettings, space: Space, budget_s: float,
               margin: float = NOISE_MARGIN, seeds: Sequence[LoaderSettings] = (),
               known: Sequence[Trial] = (), allowance: Callable[[float], float] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> TuningResult:
  """Climbs from `start` to the best-measured setting within `space`.

  Measures `start` (unless among the `known` trials of an earlier stage,
  which count in the choice but are not in the result), then `seeds` (so it
  can reach a region a step-by-step climb would not cross into), and moves
  from the best of them to the best untried neighbour while it beats the
  current one by more than `margin`; then the two best are re-measured
  alternately, and the start stays unless beaten (`keep_start`). A trial
  starts only if the time spent plus its `climb_estimate` fits `budget_s` and
  `allowance(best batches/s so far)`; `measure` gets the deadline.
  """
  climb = _Climb(measure, budget_s, allowance, known, clock, t0=clock())
  climb.scores.add(known)
  log.debug("========= tunedjax DataLoader auto-tune =========")
  log.debug("start: %s; range: %s; memory bound: %s batches; budget %.1f s", describe(start),
            {k: list(v) for k, v in space.values.items()}, space.batches_in_memory, budget_s)
  if start not in climb.scores and not climb.run(start, "climb"):
    return TuningResult(start, batches_per_s=0.0, start=start, trials=(),
                        seconds=clock() - climb.t0, batches=0, stopped="no budget")
  seeded = all(s in climb.scores or climb.run(s, "seed") for s in seeds)  # until one misses
  if seeded:  # from the best so far, if it beats the start
    climb.step_up(space, keep_start(climb.scores.best(), start, climb.scores, margin), margin)
  winner = keep_start(max(climb.confirm_top_two(), key=climb.scores.of), start, climb.scores,
                      margin)
  result = TuningResult(winner, batches_per_s=climb.scores.of(winner), start=start,
                        trials=tuple(climb.trials), seconds=clock() - climb.t0,
                        batches=sum(t.batches for t in climb.trials), stopped=climb.stopped)
  log.debug("auto-tune dataloader best: %s (%.2f batches/s, start %.2f) after %d trials, "
            "%.1f s", describe(winner), result.batches_per_s, climb.scores.of(start),
            len(result.trials), result.seconds)
  return result
