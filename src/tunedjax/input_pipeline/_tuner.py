"""Measures `LoaderSettings` for a pipeline and picks the best.

Like PaddlePaddle's DataLoader autotune, this times real batches; unlike it,
it searches every knob of `LoaderSettings` (grain's worker processes *and*
its read threads: tuning workers alone misses the best setting; and the
batches each worker keeps ready, bounded by the memory they take), pays for
itself (at most a tenth of the expected batches' time: a cheap first look in
series, no search where the loader is not the bottleneck or where no trial
could pay back), starts in this process from a model-based guess compared in
interleaved rounds, skips each trial's warm-up (worker start, buffers
filling), can include the training step in the measurement (the step
competes for the same cores), and keeps the choice, with the horizon it was
tuned for, in the persistent tuning cache so that a restart measures
nothing.

Tuning reads its own random subset of the records through a separate
pipeline: it never advances, or changes, the training stream.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tunedjax._config import get_config
from tunedjax._errors import ConfigError
from tunedjax import _tuning
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline._climb import DEFAULT_STARTUP_PER_WORKER_S
from tunedjax.input_pipeline._climb import NOISE_MARGIN
from tunedjax.input_pipeline._climb import Measure
from tunedjax.input_pipeline._climb import Trial
from tunedjax.input_pipeline._climb import TuningResult
from tunedjax.input_pipeline._climb import compare
from tunedjax.input_pipeline._climb import describe
from tunedjax.input_pipeline._climb import hill_climb
from tunedjax.input_pipeline._climb import search_space
from tunedjax.input_pipeline._climb import seed_settings
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import Space
from tunedjax.input_pipeline._settings import THREAD_LADDER as THREAD_LADDER
from tunedjax.input_pipeline._settings import TUNE_NAMES

log = logging.getLogger("tunedjax.input_pipeline")

NAMESPACE = "dataloader"
DEFAULT_READ_THREADS = LoaderSettings().read_threads  # grain's ReadOptions default
DEFAULT_MAX_PREFETCH_BUFFER = 16
# Tuning aims to cost at most this fraction of the time the expected batches
# take at the start's speed (worker trials: at most what they can save).
OVERHEAD = 0.1
DEFAULT_EXPECTED_BATCHES = 1000
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


def host_fingerprint() -> dict[str, Any]:
  """What a data-loading timing depends on about this host.

  Example:
    >>> sorted(host_fingerprint())
    ['cpu', 'cpus', 'machine', 'usable_cpus']
  """
  cpu = _tuning.host_cpu().model or ""
  try:
    usable = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    usable = os.cpu_count() or 1
  return {"cpu": cpu, "cpus": os.cpu_count() or 1, "usable_cpus": usable,
          "machine": platform.machine()}


def pipeline_fingerprint(source: Any, *, batch_size: int, transforms: Sequence[Any],
                         shuffle: bool, drop_remainder: bool) -> dict[str, Any]:
  """What a timing depends on about the pipeline (names, not addresses).

  Example:
    >>> pipeline_fingerprint(np.arange(8), batch_size=4, transforms=[np.sqrt],
    ...                      shuffle=True, drop_remainder=True)["transforms"]
    ['numpy.sqrt']
  """
  return {"source": _dataset.name_of(source), "num_records": len(source),
          "batch_size": batch_size, "transforms": [_dataset.name_of(t) for t in transforms],
          "shuffle": bool(shuffle), "drop_remainder": bool(drop_remainder)}


# Knobs every cache entry has held; an entry lacking a later knob was measured
# with its default (see `LoaderSettings.from_dict`).
_REQUIRED_IN_CACHE = ("worker_count", "read_threads")


def _validate(value: dict[str, Any]) -> None:
  for field in _REQUIRED_IN_CACHE:
    if field not in value:
      raise KeyError(f"the entry lacks {field!r}")
  LoaderSettings.from_dict(value)  # ValueError on a bad knob
  if not isinstance(value.get("batches_per_s"), (int, float)):
    raise TypeError(f"batches_per_s must be a number, got {value.get('batches_per_s')!r}")
  batch_bytes = value.get("batch_bytes")
  if batch_bytes is not None and (not isinstance(batch_bytes, int) or batch_bytes < 0):
    raise ValueError(f"batch_bytes must be an int >= 0, got {batch_bytes!r}")
  horizon = value.get("expected_batches")
  if horizon is not None and (not isinstance(horizon, int) or isinstance(horizon, bool)
                              or horizon < 1):
    raise ValueError(f"expected_batches must be an int >= 1, got {horizon!r}")


def stored_horizon(value: Mapping[str, Any]) -> int:
  """The `expected_batches` a cached choice was tuned for (an entry from
  before the horizon was stored: `DEFAULT_EXPECTED_BATCHES`).

  Example:
    >>> stored_horizon({"expected_batches": 50}), stored_horizon({})
    (50, 1000)
  """
  return int(value.get("expected_batches", DEFAULT_EXPECTED_BATCHES))


_tuning.register_validator(NAMESPACE, _validate)


def cache_key(source: Any, *, batch_size: int, transforms: Sequence[Any], shuffle: bool,
              drop_remainder: bool, start: LoaderSettings, maxima: Mapping[str, int],
              tune: Sequence[str], consumer: Callable[[Any], Any] | None,
              consumer_s: float | None) -> dict[str, Any]:
  """The tuning cache key: this host, this pipeline, the start, the bounds.

  The memory budget is not part of it (it moves with the host's free
  memory): a stored choice is fitted to the budget of the moment instead.
  """
  return {"host": host_fingerprint(),
          "pipeline": pipeline_fingerprint(source, batch_size=batch_size,
                                           transforms=transforms, shuffle=shuffle,
                                           drop_remainder=drop_remainder),
          "maxima": dict(maxima), "tune": sorted(tune), "start": start.to_dict(),
          "consumer": (_dataset.name_of(consumer) if consumer is not None
                       else (f"sleep {consumer_s:.3g} s" if consumer_s else None))}


class _Pool:
  """Iterators of measured worker settings, kept open between their trials.

  grain cannot change a started ``mp_prefetch`` iterator's worker count,
  read threads or buffer, so each worker setting pays one process start; its
  re-measurements (the confirm rounds) read on from its warm workers instead
  of starting new ones. At most `keep` worker settings stay open (the most
  recently measured); closing one (grain joins its processes) runs in a
  background thread, and `close_all` waits for every close, so no worker
  outlives the tuning.
  """

  def __init__(self, keep: int = 2):
    self.keep = keep
    self._open: dict[LoaderSettings, Any] = {}
    self._closing: list[threading.Thread] = []

  def take(self, ds: Any, settings: LoaderSettings) -> tuple[Any, bool]:
    """An iterator of `settings`, and whether it was already started."""
    iterator = self._open.pop(settings, None)
    if iterator is not None:
      return iterator, True
    return _processes.open_iterator(ds, settings), False

  def give_back(self, settings: LoaderSettings, iterator: Any) -> None:
    """Keeps a worker setting's iterator open; closes an in-process one."""
    if settings.worker_count == 0 or self.keep == 0:
      self._close_later(iterator)
      return
    self._open[settings] = iterator
    while len(self._open) > self.keep:
      oldest = next(iter(self._open))
      self._close_later(self._open.pop(oldest))

  def _close_later(self, iterator: Any) -> None:
    thread = threading.Thread(target=_processes.close_quietly, args=(iterator,),
                              daemon=True, name="tunedjax-tuner-close")
    thread.start()
    self._closing.append(thread)

  def close_all(self) -> None:
    """Closes every open iterator and waits for all closes to finish."""
    while self._open:
      self._close_later(self._open.pop(next(iter(self._open))))
    for thread in self._closing:
      thread.join()
    self._closing.clear()


def _measure_real(ds: Any, *, warmup: int, window: int, max_window_s: float,
                  consumer: Callable[[Any], Any] | None, consumer_s: float | None,
                  clock: Callable[[], float], pool: _Pool | None = None) -> Measure:
  def consume(batch: Any) -> None:
    if consumer is not None:
      _block(consumer(batch))
    elif consumer_s:
      time.sleep(consumer_s)

  with_consumer = consumer is not None or bool(consumer_s)

  def measure(settings: LoaderSettings, deadline: float) -> Trial:
    start = clock()
    owner = pool if pool is not None else _Pool(keep=0)
    iterator, warm = owner.take(ds, settings)
    read = 0
    try:
      consume(next(iterator))
      read = 1
      startup = 0.0 if warm else clock() - start
      for _ in range(warmup - 1):
        # A slow consumer: the budget beats draining buffers. Alone, the drain
        # always ends (a window that read the buffer would time nothing).
        if with_consumer and clock() >= deadline:
          break
        consume(next(iterator))
        read += 1
      window_start = clock()
      cpu_start = time.process_time()
      window_end = min(deadline, window_start + max_window_s)
      wave = 1 if with_consumer else _wave(settings)
      timed = 0
      while timed < window:
        consume(next(iterator))
        timed += 1
        if clock() >= window_end and timed >= max(2, wave) and timed % wave == 0:
          break
      elapsed = max(clock() - window_start, 1e-9)
      cpu = time.process_time() - cpu_start
    except BaseException:
      _processes.close_quietly(iterator)
      raise
    owner.give_back(settings, iterator)
    if pool is None:
      owner.close_all()
    alone = consumer is None and not consumer_s and settings.worker_count == 0
    return Trial(settings, batches_per_s=timed / elapsed, batches=read + timed,
                 startup_s=startup, seconds=clock() - start,
                 cpu_s=cpu / timed if alone else None)

  return measure


def _wave(settings: LoaderSettings) -> int:
  """Batches that arrive together: read threads start a batch each at once
  (and again each time the reader has taken a wave), so a window timed
  from the end of one wave must end at the end of another, or it times
  batches that were ready before it began."""
  if settings.worker_count:
    return settings.worker_count
  return max(1, settings.read_threads)


def _block(value: Any) -> None:
  try:
    import jax  # pylint: disable=g-import-not-at-top
    jax.block_until_ready(value)
  except Exception:  # pylint: disable=broad-except
    pass


def _time_consumer(consumer: Callable[[Any], Any], batch: Any, *, calls: int,
                   limit_s: float, clock: Callable[[], float]) -> float:
  """The consumer's median seconds per call on a ready batch (its first call,
  the compile, has run)."""
  times = []
  while len(times) < calls:
    t = clock()
    _block(consumer(batch))
    times.append(clock() - t)
    if sum(times) >= limit_s:
      break
  return statistics.median(times)


def _time_serial(ds: Any, *, batches: int, limit_s: float,
                 clock: Callable[[], float]) -> tuple[float, float, int]:
  """(wall, CPU) seconds per batch of `ds` read here in series (no threads, no
  workers: what ``read_threads=0`` reads), and the batches read. Batch 0 was
  read before (the first read pays one-off costs); batches 1, 2, ... are
  timed one by one, at least two and at most `batches`, until `limit_s` has
  passed. Each is the median over the batches: on a shared host one batch
  in a few waits a scheduler slice (~4 ms) for its core, which would
  double a sub-millisecond mean.
  """
  t0 = clock()
  walls, cpus = [], []
  while len(walls) < batches:
    t, cpu = clock(), time.process_time()
    ds[1 + len(walls) % max(1, len(ds) - 1)]
    cpus.append(time.process_time() - cpu)
    walls.append(max(clock() - t, 1e-9))
    if len(walls) >= 2 and clock() - t0 >= limit_s:
      break
  return statistics.median(walls), statistics.median(cpus), len(walls)


def _ms(seconds: float | None) -> str:
  return "?" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _search(ds: Any, first: Any, *, start: LoaderSettings, space: Space, tuning_steps: int,
            budget_s: float, consumer: Callable[[Any], Any] | None,
            consumer_s: float | None, margin: float, expected_batches: int, pool: _Pool,
            clock: Callable[[], float]) -> TuningResult:
  """The first look, the bottleneck and payback checks, then the search (see
  `tune_worker_count`)."""
  t0 = clock()
  deadline = t0 + budget_s
  step_s = None
  if consumer is not None:
    step_s = _time_consumer(consumer, first, calls=CONSUMER_CALLS,
                            limit_s=max(0.0, budget_s / 10), clock=clock)
  elif consumer_s:
    step_s = float(consumer_s)
  with_consumer = consumer is not None or bool(consumer_s)
  n = expected_batches

  def measurer(window_s: float, *, alone: bool = False) -> Measure:
    def measure(settings: LoaderSettings, deadline: float) -> Trial:
      warmup, window = trial_sizes(tuning_steps, settings)
      return _measure_real(ds, warmup=warmup, window=window, max_window_s=window_s,
                           consumer=None if alone else consumer,
                           consumer_s=None if alone else consumer_s, clock=clock,
                           pool=pool)(settings, deadline)
    return measure

  # The first look, cheap: a few batches read here in series (no read threads,
  # no workers). It stands for the setting without threads, sizes the rest,
  # and a step slower than it by far needs no search at all.
  serial_s, serial_cpu_s, serial_n = _time_serial(
      ds, batches=SERIAL_BATCHES, limit_s=min(SERIAL_LIMIT_S, budget_s / 100), clock=clock)
  batch_s = serial_s
  usable = max(1, host_fingerprint()["usable_cpus"])
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


def tune_worker_count(source: Any, *, batch_size: int, transforms: Sequence[Any] = (),
                      shuffle: bool = True, seed: int = 0, drop_remainder: bool = True,
                      worker_count: int | None = None, read_threads: int | None = None,
                      prefetch_buffer: int | None = None,
                      max_workers: int | None = None,
                      max_read_threads: int = DEFAULT_READ_THREADS,
                      max_prefetch_buffer: int = DEFAULT_MAX_PREFETCH_BUFFER,
                      memory_budget: int | None = None,
                      tuning_steps: int | None = None, budget_s: float = 60.0,
                      consumer: Callable[[Any], Any] | None = None,
                      consumer_s: float | None = None, margin: float = NOISE_MARGIN,
                      expected_batches: int | None = None,
                      cache: Any = True,
                      tune: Sequence[str] = TUNE_NAMES,
                      clock: Callable[[], float] = time.perf_counter) -> TuningResult:
  """Finds the `LoaderSettings` (worker processes, read threads, per-worker
  prefetch buffer) that read a pipeline fastest.

  Tuning has to pay for itself: it costs at most a tenth (`OVERHEAD`) of the
  time the `expected_batches` take. It first reads a few batches here in
  series (`SERIAL_BATCHES`, the median of each): the first look, which sizes
  the rest and stands for the setting without read threads. Then:

  * With `consumer` (e.g. the compiled training step, timed alone on a ready
    batch) or `consumer_s` (its duration, slept: a step that runs on an
    accelerator), when reading in series costs the step at most `margin`, the
    loader is not the bottleneck (``stopped="consumer-bound"``). The start's
    read threads or workers may still slow the step (they share its cores
    and the GIL), so steps with their batches are timed end to end at the
    start and read in series (`CONTENTION_ROUNDS` interleaved rounds of about
    `CONTENTION_STEPS` steps, when that fits in a tenth of the horizon's
    steps), and reading in series is chosen if it beats the start by more
    than `margin`. The result gives both times (`TuningResult.step_s`,
    `batch_s`) and the reason.
  * The payback rule: no setting can save more over the horizon than
    `expected_batches` x the serial read (with a consumer, which read threads
    hide behind the step) or, without one, x what spreading its CPU time over
    the usable cores leaves of it. If a tenth of that does not pay for one
    round of the first guesses (one trial from a start with workers), it
    reads in series without a trial (``stopped="no payback"``).
  * Otherwise it searches, the allowance shrinking to the pace of the fastest
    setting measured. A start without workers is searched in this process
    first: a model-based guess (`thread_guess`: no threads, about one per
    usable core, twice that) compared in `GUESS_ROUNDS` interleaved rounds
    (`compare`: a host that drifts slows every candidate of a round alike),
    then the ladder's neighbours of the winner against it (`ROUNDS` rounds),
    until none wins; rounds stop where the allowance ends.
    Trial windows are sized for the fastest setting the model allows, and
    time whole waves of read threads. A start with workers is hill-climbed
    over threads and buffer at its worker count. Then worker processes (0 to
    `max_workers`), only if a tenth of what they could save pays for a worker
    trial: the fastest they could read is this process's CPU time per batch
    spread over the usable cores, each at the share of a core a thread gets
    now (on a busy host a worker waits for a core too), and the time that
    could save over `expected_batches`, a tenth of it, must exceed a trial's
    cost (a process start per worker) and fit what is left of the allowance.
    Each worker setting starts its processes once: its re-measurements read
    on from the same warm workers (`_Pool`).

  The read threads range over 0 to `max_read_threads`, the per-worker buffer
  over 1 to `max_prefetch_buffer` and at most `memory_budget` // (workers x
  one batch's bytes). Each trial reads a random subset of the records: a
  warm-up (the worker buffers; none for read threads, whose windows time
  whole waves), then a window that ends after `tuning_steps` batches in all
  or a time slice, whichever comes first; the whole tuning stays within
  `budget_s`. With a consumer it measures end-to-end steps per second. The
  choice is stored in the persistent tuning cache under this host and this
  pipeline, with `expected_batches`: a later call with the same or a shorter
  horizon reuses it without measuring, a longer one tunes again (it may pay
  for more trials, or workers) and replaces it. Trials are logged at DEBUG on
  the ``tunedjax.input_pipeline`` logger.

  Args:
    source: a random-access source (grain data source, sequence, arrays).
    batch_size: records per batch.
    transforms: per-record transforms (grain Map/RandomMap or callables).
    shuffle: shuffle records (as the loader will).
    seed: picks the random subset the tuner reads.
    drop_remainder: as the loader will.
    worker_count: the setting to start from (None: 0, no workers).
    read_threads: the read threads to start from (None: grain's 16).
    prefetch_buffer: the per-worker buffer to start from (None: 2 batches).
    max_workers: the most workers to try (None: config, else the CPU count).
    max_read_threads: the most read threads to try.
    max_prefetch_buffer: the most batches per worker buffer to try.
    memory_budget: bytes the worker buffers may hold in all (None: a quarter
      of the memory available now, `MEMORY_FRACTION`); one batch is built to
      measure its bytes.
    tuning_steps: batches one trial reads at most, warm-up included (as
      Paddle's; None: the config's value).
    budget_s: seconds the tuning may take.
    consumer: called on each timed batch (its result is waited for).
    consumer_s: seconds per step to simulate when there is no consumer.
    margin: relative gain that counts as better than noise.
    expected_batches: the batches the chosen setting will read (None:
      `DEFAULT_EXPECTED_BATCHES`, a 1,000-step epoch): the horizon tuning
      must pay back within (`Trainer.fit` passes the steps of the fit); a
      cached choice tuned for fewer is measured again.
    cache: True or None for the default tuning cache, False for none, a
      `Cache` or a folder (`tunedjax._tuning.resolve_cache`).
    tune: the knobs to climb over ("workers", "read_threads",
      "prefetch_buffer"); the others stay at their start value.
    clock: the timer.

  Returns:
    A `TuningResult`.

  Example:
    >>> import tempfile, tunedjax as tj
    >>> with tj.config_context({"cache": {"dir": tempfile.mkdtemp()}}):
    ...   r = tune_worker_count(np.arange(64.0), batch_size=4, max_workers=0,
    ...                         max_read_threads=1, tuning_steps=64, budget_s=5)
    >>> r.worker_count, r.read_threads in (0, 1)
    (0, True)
  """
  config = get_config().dataloader
  max_workers = config.resolved_max_workers if max_workers is None else max_workers
  tuning_steps = config.tuning_steps if tuning_steps is None else tuning_steps
  expected_batches = (DEFAULT_EXPECTED_BATCHES if expected_batches is None
                      else expected_batches)
  for name, value, low in (("max_workers", max_workers, 0), ("tuning_steps", tuning_steps, 1),
                           ("expected_batches", expected_batches, 1),
                           ("max_read_threads", max_read_threads, 0),
                           ("max_prefetch_buffer", max_prefetch_buffer, 1)):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ConfigError(f"tune_worker_count({name}=...) must be an int >= {low}, got {value!r}.")
  if memory_budget is not None and (isinstance(memory_budget, bool)
                                    or not isinstance(memory_budget, (int, float))
                                    or memory_budget <= 0):
    raise ConfigError(f"tune_worker_count(memory_budget=...) must be a number of bytes > 0 "
                      f"or None, got {memory_budget!r}.")
  given = {"worker_count": worker_count, "read_threads": read_threads,
           "prefetch_buffer": prefetch_buffer}
  try:
    start = LoaderSettings(**{k: v for k, v in given.items() if v is not None})
  except ValueError as err:
    raise ConfigError(f"tune_worker_count: {err}") from None
  maxima = {"worker_count": max_workers, "read_threads": max_read_threads,
            "prefetch_buffer": max_prefetch_buffer}
  for name in TUNE_NAMES:  # a tuned knob starts within its maximum
    k = _settings.knob(name)
    if name in tune and getattr(start, k.name) > maxima[k.name]:
      start = start.replace(**{k.name: max(k.low, maxima[k.name])})
  source = _dataset.as_source(source)
  transforms = _dataset.check_transforms(transforms)
  space = search_space(start, maxima=maxima, tune=tune)  # checks `tune`
  budget_bytes = _settings.default_memory_budget() if memory_budget is None else memory_budget

  store = _tuning.resolve_cache(cache)
  key = cache_key(source, batch_size=batch_size, transforms=transforms, shuffle=shuffle,
                  drop_remainder=drop_remainder, start=start, maxima=maxima, tune=tune,
                  consumer=consumer, consumer_s=consumer_s)
  if store is not None:
    hit = store.get(NAMESPACE, key)
    if hit is not None and stored_horizon(hit) < expected_batches:
      # Tuned for a shorter horizon: a longer one may pay for more trials (or
      # workers). Tune again; the new choice replaces the stored one.
      log.debug("dataloader tuning: the cached choice was tuned for %d batches, not %d: "
                "tuning again", stored_horizon(hit), expected_batches)
      hit = None
    if hit is not None:
      batch_bytes = hit.get("batch_bytes")
      bound = (None if batch_bytes is None
               else _settings.batches_in_memory(batch_bytes, budget_bytes))
      chosen = dataclasses.replace(space, batches_in_memory=bound).fit(
          LoaderSettings.from_dict(hit))
      log.debug("dataloader tuning: cache hit, %s", describe(chosen))
      return TuningResult(chosen, batches_per_s=float(hit["batches_per_s"]), start=start,
                          trials=(), seconds=0.0, batches=0, stopped="cache",
                          from_cache=True)

  rng = np.random.default_rng([seed, 0x7E57])
  subset = rng.choice(len(source), size=min(len(source), (tuning_steps + 1) * batch_size),
                      replace=False)
  ds = _dataset.build(source, batch_size=batch_size, transforms=transforms,
                      shuffle=shuffle, seed=seed, num_epochs=None,
                      drop_remainder=drop_remainder, indices=np.sort(subset))
  if len(ds) == 0:
    raise ConfigError(f"tune_worker_count: {len(source)} records make no batch of "
                      f"batch_size={batch_size} (drop_remainder={drop_remainder}).")
  first = ds[0]
  batch_bytes = _settings.batch_nbytes(first)
  space = dataclasses.replace(
      space, batches_in_memory=_settings.batches_in_memory(batch_bytes, budget_bytes))
  start = space.fit(start)
  if consumer is not None:
    # A training step's first call compiles it: once, before the clock starts,
    # so the budget measures the pipeline and not XLA.
    _block(consumer(first))
  pool = _Pool()
  try:
    result = _search(ds, first, start=start, space=space, tuning_steps=tuning_steps,
                     budget_s=budget_s, consumer=consumer, consumer_s=consumer_s,
                     margin=margin, expected_batches=expected_batches, pool=pool,
                     clock=clock)
  finally:
    pool.close_all()
  # A search's result, or the finding that the step, not the loader, is the
  # bottleneck or that no trial could pay back (no trials): either way a
  # restart with this horizon need not measure again.
  if store is not None and (result.trials or result.stopped in ("consumer-bound",
                                                                "no payback")):
    store.put(NAMESPACE, key, {
        **result.settings.to_dict(),
        "batches_per_s": result.batches_per_s, "seconds": result.seconds,
        "batch_bytes": batch_bytes, "expected_batches": expected_batches,
        "trials": [{**t.settings.to_dict(), "batches_per_s": round(t.batches_per_s, 3)}
                   for t in result.trials]})
  return result


