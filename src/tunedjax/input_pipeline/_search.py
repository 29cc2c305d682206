"""The search behind `tune_worker_count`: the first look, the checks, the climb.

It measures through the functions `_tuner` passes in (grain iterators, the
consumer, the serial read) and decides: whether the loader is the bottleneck
(and whether the start's threads slow the step), whether any trial can pay
back over the horizon, and otherwise which setting reads fastest, within a
tenth of the horizon's time.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline._climb import DEFAULT_STARTUP_PER_WORKER_S
from tunedjax.input_pipeline._climb import Measure
from tunedjax.input_pipeline._climb import Trial
from tunedjax.input_pipeline._climb import TuningResult
from tunedjax.input_pipeline._climb import compare
from tunedjax.input_pipeline._climb import describe
from tunedjax.input_pipeline._climb import hill_climb
from tunedjax.input_pipeline._climb import seed_settings
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import Space

log = logging.getLogger("tunedjax.input_pipeline")

# Tuning aims to cost at most this fraction of the time the expected batches
# take at the start's speed (worker trials: at most what they can save).
OVERHEAD = 0.1
CONSUMER_CALLS = 3  # the consumer is timed alone on this many calls, at most
# The first estimate reads this many batches here, one after the other, at most
# (and stops after SERIAL_LIMIT_S): what a batch costs read in series.
SERIAL_BATCHES = 8
SERIAL_LIMIT_S = 0.02
MIN_ALLOWANCE_S = 0.02  # the least time a search may take, beyond the first estimate
MIN_WINDOW_S = 0.004  # the shortest timing window of a trial
# A search's trial windows: its allowance over this many (a window per trial of
# three rounds of three guesses and two rounds of two pairs, and some left).
WINDOWS_PER_ALLOWANCE = 20
# Interleaved rounds of the first guesses (the median of three is not moved by
# one slow round) and of each pair the climb compares after them.
GUESS_ROUNDS = 3
ROUNDS = 2
# What a read thread adds to a trial's start, until one is measured (1-2 ms on
# the project's loaded 2-core host).
THREAD_START_S = 0.002
# What any trial costs beyond its window and first wave (an iterator opened and
# closed, the last wave rounded up to): 2-9 ms measured on that host.
TRIAL_START_S = 0.002
# The contention check (a consumer-bound start with threads or workers): rounds
# of the start against reading in series, about this many steps per trial.
CONTENTION_ROUNDS = 2
CONTENTION_STEPS = 3


def _ms(seconds: float | None) -> str:
  return "?" if seconds is None else f"{seconds * 1e3:.3g} ms"


def search(ds: Any, first: Any, *, start: LoaderSettings, space: Space, tuning_steps: int,
           budget_s: float, consumer: Callable[[Any], Any] | None,
           consumer_s: float | None, margin: float, expected_batches: int, pool: Any,
           clock: Callable[[], float], usable: int, measure_real: Callable[..., Measure],
           time_serial: Callable[..., tuple[float, float, int]],
           time_consumer: Callable[..., float]) -> TuningResult:
  """The first look, the bottleneck and payback checks, then the search (see
  `tune_worker_count`), on `usable` cores; `measure_real`, `time_serial` and
  `time_consumer` are `_tuner`'s measurements (or a test's)."""
  t0 = clock()
  deadline = t0 + budget_s
  step_s = None
  if consumer is not None:
    step_s = time_consumer(consumer, first, calls=CONSUMER_CALLS,
                            limit_s=max(0.0, budget_s / 10), clock=clock)
  elif consumer_s:
    step_s = float(consumer_s)
  with_consumer = consumer is not None or bool(consumer_s)
  n = expected_batches

  def measurer(window_s: float, *, alone: bool = False) -> Measure:
    def measure(settings: LoaderSettings, deadline: float) -> Trial:
      warmup, window = trial_sizes(tuning_steps, settings)
      return measure_real(ds, warmup=warmup, window=window, max_window_s=window_s,
                           consumer=None if alone else consumer,
                           consumer_s=None if alone else consumer_s, clock=clock,
                           pool=pool)(settings, deadline)
    return measure

  # The first look, cheap: a few batches read here in series (no read threads,
  # no workers). It stands for the setting without threads, sizes the rest,
  # and a step slower than it by far needs no search at all.
  serial_s, serial_cpu_s, serial_n = time_serial(
      ds, batches=SERIAL_BATCHES, limit_s=min(SERIAL_LIMIT_S, budget_s / 100), clock=clock)
  batch_s = serial_s
  series_ok = 0 in space.values["worker_count"] and 0 in space.values["read_threads"]
  in_series = (space.fit(start.replace(worker_count=0, read_threads=0)) if series_ok
               else None)

  def done(settings: LoaderSettings, rate: float, trials: Sequence[Trial], stopped: str,
           reason: str) -> TuningResult:
    log.debug("dataloader tuning: %s", reason)
    return TuningResult(settings, batches_per_s=rate, start=start, trials=tuple(trials),
                        seconds=clock() - t0,
                        batches=serial_n + sum(t.batches for t in trials),
                        stopped=stopped, step_s=step_s, batch_s=batch_s, reason=reason)

  if step_s is not None and serial_s <= margin * step_s:
    return _check_contention(measurer, start=start, in_series=in_series, serial_s=serial_s,
                             step_s=step_s, n=n, t0=t0, deadline=deadline, usable=usable,
                             margin=margin, clock=clock, done=done)

  allowance = min(budget_s, max(OVERHEAD * n * max(serial_s, step_s or 0.0), MIN_ALLOWANCE_S))
  # Trial windows are sized for the fastest any setting could be (the step, or
  # this process's CPU time a batch over the usable cores), so that finding
  # it, and the allowance shrinking to its pace, leaves the trials done in it.
  fastest_s = max(step_s or 0.0, serial_cpu_s / usable)
  window_s = min(2.0, max(MIN_WINDOW_S, OVERHEAD * n * fastest_s / WINDOWS_PER_ALLOWANCE))
  trials: list[Trial] = []
  scores: dict[LoaderSettings, list[float]] = {}

  def record(new: Sequence[Trial]) -> None:
    trials.extend(new)
    for t in new:
      scores.setdefault(t.settings, []).append(t.batches_per_s)

  def rate_of(settings: LoaderSettings) -> float:
    return statistics.median(scores[settings])

  def pace_s(rate: float = 0.0) -> float:  # a batch (or step) at the best pace measured
    best_rate = max((rate_of(s) for s in scores), default=rate)
    best_rate = max(best_rate, rate)
    return max(1.0 / best_rate if best_rate > 0 else serial_s, step_s or 0.0)

  def left(rate: float = 0.0) -> float:  # the allowance at the best pace, less what was spent
    return (min(budget_s, max(OVERHEAD * n * pace_s(rate), MIN_ALLOWANCE_S))
            - (clock() - t0))

  def from_now() -> Callable[[float], float]:  # `left` as a climb starting now sees it
    began = clock()
    return lambda rate: left(rate) + (clock() - began)

  def estimate(settings: LoaderSettings) -> float:  # seconds, a trial in this process
    same = [t.seconds for t in trials if t.settings == settings]
    if same:
      return min(same)
    threads = settings.read_threads
    # Until the first batch: its wave, and the threads' start (the most a
    # thread took in the trials so far, else `THREAD_START_S`).
    per_thread = [t.startup_s / t.read_threads for t in trials if t.read_threads]
    wave_s = (serial_s * max(1.0, threads / usable)
              + max(per_thread, default=THREAD_START_S) * threads)
    return TRIAL_START_S + wave_s + max(window_s, 2 * (serial_s + (step_s or 0.0)))

  # Payback: the most any setting can save over reading in series is the
  # reading itself with a consumer (threads overlap it with the step), and
  # without one, what spreading its CPU time over the usable cores leaves.
  # When a tenth of that over the whole horizon does not pay for the least
  # comparison (one round of the first guesses; one trial from a start with
  # workers), no trial can pay back: stop.
  save_s = n * (serial_s if with_consumer
                else max(0.0, serial_s - serial_cpu_s / usable))
  guess = thread_guess(start, space, cores=usable)
  if start.worker_count == 0 and len(guess) > 1:
    least_s = sum(estimate(g) for g in guess)
    least = (f"one round of the first guesses ("
             f"{', '.join(str(g.read_threads) for g in guess)} read threads: "
             f"~{_ms(least_s)})")
  else:
    least_s = window_s + 2 * (serial_s + (step_s or 0.0))
    least = f"one trial (~{_ms(least_s)})"
  if OVERHEAD * save_s < least_s:
    chosen = in_series if in_series is not None else start
    return done(chosen, 1.0 / (serial_s + (step_s or 0.0)), (), "no payback",
                f"chose {describe(chosen)} without a trial: {n} batches read in series take "
                f"{n * serial_s:.3g} s (one in {_ms(serial_s)}), so no setting can save more "
                f"than {save_s:.3g} s over them, and {OVERHEAD:.0%} of that does not pay "
                f"for {least}")

  stopped = "converged"
  if start.worker_count == 0:
    # Phase 1, in this process: a model-based guess (no threads, about one
    # read thread per usable core, twice that), compared in interleaved
    # rounds, then the ladder's neighbours of the winner, a pair at a time.
    ladder = space.values["read_threads"]
    new, best, _ = compare(measurer(window_s), guess, rounds=GUESS_ROUNDS, left=left,
                           estimate=estimate, margin=margin, phase="guess", clock=clock)
    record(new)
    tried = set(guess)
    while best is not None:
      i = ladder.index(best.read_threads)
      near = [best.replace(read_threads=ladder[j]) for j in (i - 1, i + 1)
              if 0 <= j < len(ladder)]
      near = [s for s in near if s not in tried]
      if not near:
        break
      tried.update(near)
      new, winner, _ = compare(measurer(window_s), [best, *near], rounds=ROUNDS, left=left,
                               estimate=estimate, margin=margin, phase="climb", clock=clock)
      record(new)
      if winner is None:
        stopped = "budget"
        break
      if winner == best:
        break
      best = winner
    if best is None:  # not one whole round fitted: the best single trial, if any
      stopped = "budget"
      best = max(scores, key=rate_of) if scores else guess[0]
  else:
    # Phase 1 at the start's worker count: a climb over threads and buffer.
    here = dataclasses.replace(space, values={**space.values,
                                              "worker_count": [start.worker_count]})
    first_phase = hill_climb(
        measurer(window_s), start=start, space=here,
        budget_s=max(window_s, min(allowance, deadline - clock())), max_batches=None,
        trial_batches=lambda s: sum(trial_sizes(tuning_steps, s)), margin=margin,
        clock=clock, allowance=from_now())
    record(first_phase.trials)
    best, stopped = first_phase.settings, first_phase.stopped
  if best not in scores:  # nothing measured: the serial first look stands for it
    return done(best, 1.0 / (serial_s + (step_s or 0.0)), trials, stopped,
                f"chose {describe(best)}: no trial fitted in {OVERHEAD:.0%} of the "
                f"{n} batches' time ({allowance:.3g} s)")
  best_s = 1.0 / rate_of(best)
  if len(space.values["worker_count"]) < 2:
    return done(best, rate_of(best), trials, stopped,
                f"chose {describe(best)}: searched the read threads and buffer only")

  # Phase 2: worker processes, if a tenth of what they could save pays for a
  # worker trial. The fastest they could read: this process's CPU time per
  # batch spread over the usable cores, each at the share of a core a thread
  # gets now (the serial read's CPU time over its wall time: on a busy host a
  # worker waits for a core as this process does).
  share = min(1.0, max(0.05, serial_cpu_s / serial_s))
  cores = usable * share
  cpus = [serial_cpu_s, *(t.cpu_s for t in trials if t.cpu_s is not None)]
  floor_s = max(step_s or 0.0, min(cpus) / cores)
  gain_s = best_s - floor_s
  others = [w for w in space.values["worker_count"] if w != start.worker_count]
  fewest = min(w for w in others if w > 0) if any(w > 0 for w in others) else 0
  body_s = max((t.seconds - t.startup_s for t in trials), default=window_s)
  cost_s = DEFAULT_STARTUP_PER_WORKER_S * fewest + body_s
  payoff_s = gain_s * n
  where = f"{usable} cores at {share:.0%} of a core each"
  if gain_s <= margin * best_s:
    return done(best, rate_of(best), trials, "converged",
                f"chose {describe(best)}: worker processes cannot read faster (this "
                f"process takes {_ms(min(cpus))} of CPU a batch, {_ms(floor_s)} over "
                f"{where}; it reads one in {_ms(best_s)})")
  phase_s = min(OVERHEAD * payoff_s, left())
  if phase_s < cost_s:
    return done(best, rate_of(best), trials, "converged",
                f"chose {describe(best)}: worker processes could save at most "
                f"{payoff_s:.2f} s over {n} batches (one in {_ms(best_s)} now, "
                f"{_ms(floor_s)} at best over {where}); a worker trial (~{cost_s:.1f} s) "
                f"does not fit in {OVERHEAD:.0%} of that or in what is left of "
                f"{OVERHEAD:.0%} of the batches' time ({max(0.0, phase_s):.2f} s)")
  climbs_both = len(space.values["read_threads"]) > 1
  second_phase = hill_climb(
      measurer(window_s), start=best, space=space,
      budget_s=max(0.0, min(phase_s, deadline - clock())), max_batches=None,
      trial_batches=lambda s: sum(trial_sizes(tuning_steps, s)), margin=margin,
      clock=clock, known=tuple(trials), allowance=from_now(),
      seeds=seed_settings(best, space) if climbs_both else ())
  record(second_phase.trials)
  winner = second_phase.settings
  if winner != start and start in scores and rate_of(winner) <= rate_of(start) * (1 + margin):
    winner = start
  return done(winner, rate_of(winner), trials, second_phase.stopped,
              f"chose {describe(winner)} after the worker search (workers could save up to "
              f"{payoff_s:.1f} s over {n} batches)")


def thread_guess(start: LoaderSettings, space: Space, *, cores: int) -> list[LoaderSettings]:
  """The read-thread settings a search in this process measures first: none
  (the read in series, the incumbent), about one thread per core, and twice
  that (a thread waiting on the GIL or on I/O leaves its core to another),
  each the largest ladder value within it; `start` alone where the threads
  are not tuned.

  Example:
    >>> from tunedjax.input_pipeline._climb import search_space
    >>> space = search_space(LoaderSettings(), maxima={"worker_count": 0})
    >>> [s.read_threads for s in thread_guess(LoaderSettings(), space, cores=2)]
    [0, 2, 4]
    >>> [s.read_threads for s in thread_guess(LoaderSettings(), space, cores=16)]
    [0, 16]
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


def _check_contention(measurer: Callable[..., Measure], *, start: LoaderSettings,
                      in_series: LoaderSettings | None, serial_s: float, step_s: float,
                      n: int, t0: float, deadline: float, usable: int, margin: float,
                      clock: Callable[[], float],
                      done: Callable[..., TuningResult]) -> TuningResult:
  """The loader is not the bottleneck: keeps the start unless its read threads
  (or workers) slow the step they share the cores (and the GIL) with.

  Steps with their batches, end to end, at the start and read in series (no
  threads, no workers), `CONTENTION_ROUNDS` interleaved rounds of about
  `CONTENTION_STEPS` steps each; read in series wins if it beats the start by
  more than `margin`. This runs only if it fits in `OVERHEAD` of the
  horizon's steps (and the budget).
  """
  base = (f"a batch read in series takes {_ms(serial_s)}, the step {_ms(step_s)}: "
          f"batches cost the step at most {serial_s / step_s:.1%}")
  serial_rate = 1.0 / (step_s + serial_s)
  if in_series is None or start == in_series:
    return done(start, serial_rate, (), "consumer-bound",
                f"kept {describe(start)}: the loader is not the bottleneck ({base})")
  e2e_s = step_s + serial_s
  threads = start.read_threads * max(1, start.worker_count)
  startup_s = (DEFAULT_STARTUP_PER_WORKER_S * start.worker_count
               + THREAD_START_S * threads + serial_s * max(1.0, threads / usable))
  estimate_s = CONTENTION_ROUNDS * ((CONTENTION_STEPS + 1) * e2e_s * 2 + startup_s)
  allowance = min(deadline - t0, OVERHEAD * n * step_s)
  if estimate_s > allowance - (clock() - t0):
    return done(start, serial_rate, (), "consumer-bound",
                f"kept {describe(start)}: the loader is not the bottleneck ({base}); "
                f"checking that its threads do not slow the step (~{estimate_s:.2g} s) "
                f"does not fit in {OVERHEAD:.0%} of the {n} steps' time")

  def estimate(settings: LoaderSettings) -> float:
    return (CONTENTION_STEPS + 1) * e2e_s + (startup_s if settings == start else 0.0)

  trials, best, _ = compare(
      measurer((CONTENTION_STEPS - 0.5) * e2e_s), [start, in_series],
      rounds=CONTENTION_ROUNDS, left=lambda: allowance - (clock() - t0), estimate=estimate,
      margin=margin, phase="contention", clock=clock)

  def median_s(settings: LoaderSettings) -> float:
    return 1.0 / statistics.median(t.batches_per_s for t in trials if t.settings == settings)

  if best is None:
    return done(start, serial_rate, trials, "consumer-bound",
                f"kept {describe(start)}: the loader is not the bottleneck ({base}); the "
                f"check of its threads against the step ran out of time")
  rate = 1.0 / median_s(best)
  steps = (f"a step with its batch takes {_ms(median_s(start))} at the start, "
           f"{_ms(median_s(in_series))} read in series")
  if best == in_series:
    return done(in_series, rate, trials, "consumer-bound",
                f"chose {describe(in_series)}: the loader is not the bottleneck ({base}), "
                f"but the start's threads slow the step ({steps})")
  return done(start, rate, trials, "consumer-bound",
              f"kept {describe(start)}: the loader is not the bottleneck ({base}; {steps})")


def trial_sizes(tuning_steps: int, settings: LoaderSettings) -> tuple[int, int]:
  """(warm-up, window) batches of one trial of `settings`: `tuning_steps` in all.

  As in Paddle, `tuning_steps` batches are read per trial. The warm-up drains
  what the prefetch buffers hold once the workers are up (at most half the
  batches), so that the window times the pipeline, not the buffers. Read
  threads in this process need none: they start one batch each at once and
  the next wave only as the reader takes them, so the batches of a wave
  arrive together, the first of them after the start-up; the window, from
  the first batch to the end of a later wave (`_wave`), times whole waves.

  Example:
    >>> trial_sizes(500, LoaderSettings(worker_count=2, read_threads=4))
    (21, 479)
    >>> trial_sizes(500, LoaderSettings(worker_count=0, read_threads=16))
    (1, 499)
  """
  buffered = 0 if settings.worker_count == 0 else _processes.buffered_batches(settings)
  warmup = max(1, min(buffered + 1, tuning_steps // 2))
  return warmup, max(1, tuning_steps - warmup)

