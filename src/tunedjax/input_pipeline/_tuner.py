"""Measures (worker processes, read threads) for a pipeline and picks the best.

Like PaddlePaddle's DataLoader autotune, this hill-climbs from the user's
setting and times real batches; unlike it, it climbs over two knobs (grain's
worker processes *and* its read threads: tuning workers alone misses the best
setting), skips each trial's warm-up (worker start, buffers filling), bounds
its total time and batches, re-measures the two best settings alternately
before choosing, can include the training step in the measurement (the step
competes for the same cores), and keeps the choice in the persistent tuning
cache so that a restart measures nothing.

Tuning reads its own random subset of the records through a separate
pipeline: it never advances, or changes, the training stream.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunedjax._config import get_config
from tunedjax._errors import ConfigError
from tunedjax._errors import did_you_mean
from tunedjax._errors import format_choices
from tunedjax import _tuning
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _processes

log = logging.getLogger("tunedjax.input_pipeline")

NAMESPACE = "dataloader"
THREAD_LADDER = (0, 1, 2, 4, 8, 16)
DEFAULT_READ_THREADS = 16  # grain's ReadOptions default
DEFAULT_STARTUP_PER_WORKER_S = 1.5  # until one is measured
NOISE_MARGIN = 0.05
# A pipeline already this fast (batches/s, or steps/s with a consumer) is no
# bottleneck for any training step: worker processes cannot pay for themselves.
FAST_ENOUGH = 1000.0
KNOBS = ("workers", "read_threads")


@dataclasses.dataclass(frozen=True)
class Trial:
  """One timed run of one setting.

  Attributes:
    worker_count: worker processes.
    read_threads: read threads per process.
    batches_per_s: batches (or end-to-end steps) per second in the window.
    batches: batches read, warm-up included.
    startup_s: seconds until the first batch (worker start).
    seconds: the whole trial, start to close.
    phase: "climb", "seed" (see `seed_settings`) or "confirm" (the alternating
      re-measurement).
  """

  worker_count: int
  read_threads: int
  batches_per_s: float
  batches: int
  startup_s: float
  seconds: float
  phase: str = "climb"

  @property
  def setting(self) -> tuple[int, int]:
    return (self.worker_count, self.read_threads)


@dataclasses.dataclass(frozen=True)
class TuningResult:
  """What the tuner measured and chose.

  Attributes:
    worker_count: the chosen worker processes.
    read_threads: the chosen read threads per process.
    batches_per_s: the median throughput of the chosen setting (batches, or
      end-to-end steps when a consumer was measured, per second).
    start: the (worker_count, read_threads) the climb started from.
    trials: every trial, in order.
    seconds: the time spent tuning (0 on a cache hit).
    batches: the batches read while tuning (0 on a cache hit).
    stopped: why the climb ended: "converged", "budget", "max_batches",
      "fast enough" (the start already reads over `FAST_ENOUGH` batches/s),
      "cache" (reused a stored choice) or "no budget".
    from_cache: whether the choice came from the persistent cache.

  Example:
    >>> r = TuningResult(worker_count=2, read_threads=0, batches_per_s=25.0,
    ...                  start=(0, 16), trials=(), seconds=0.0, batches=0,
    ...                  stopped="cache", from_cache=True)
    >>> r.setting
    (2, 0)
  """

  worker_count: int
  read_threads: int
  batches_per_s: float
  start: tuple[int, int]
  trials: tuple[Trial, ...]
  seconds: float
  batches: int
  stopped: str
  from_cache: bool = False

  @property
  def setting(self) -> tuple[int, int]:
    return (self.worker_count, self.read_threads)

  def table(self) -> str:
    """The trials as a plain-text table, the chosen setting marked."""
    lines = ["workers  threads  batches/s  startup(s)  phase"]
    for t in self.trials:
      mark = "  <- chosen" if t.setting == self.setting else ""
      lines.append(f"{t.worker_count:7d}  {t.read_threads:7d}  {t.batches_per_s:9.2f}  "
                   f"{t.startup_s:10.2f}  {t.phase}{mark}")
    lines.append(f"chose workers={self.worker_count} read_threads={self.read_threads} "
                 f"({self.batches_per_s:.2f}/s) in {self.seconds:.1f} s, "
                 f"{self.batches} batches; stopped: {self.stopped}")
    return "\n".join(lines)


Measure = Callable[[tuple[int, int], float], Trial]


def _ladder(max_workers: int) -> list[int]:
  steps = [w for w in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if w <= max_workers]
  if max_workers not in steps:
    steps.append(max_workers)
  return steps


def _step(ladder: Sequence[int], value: int, direction: int) -> int | None:
  """The next value on `ladder` from `value` (which may be off the ladder)."""
  if direction > 0:
    above = [v for v in ladder if v > value]
    return above[0] if above else None
  below = [v for v in ladder if v < value]
  return below[-1] if below else None


def neighbours(setting: tuple[int, int], *, worker_choices: Sequence[int],
               thread_choices: Sequence[int]) -> list[tuple[int, int]]:
  """The settings one step away: threads down/up, then workers down/up.

  Also the jump to the fewest threads (a synchronous read): thread hand-offs
  cost more than they give on a light pipeline, but the settings in between
  are often worse than both ends, which would stop a plain climb.

  Example:
    >>> neighbours((0, 16), worker_choices=[0, 1, 2], thread_choices=THREAD_LADDER)
    [(0, 8), (0, 0), (1, 16)]
  """
  w, t = setting
  out = []
  for t2 in (_step(thread_choices, t, -1), _step(thread_choices, t, +1),
             min(thread_choices)):
    if t2 is not None and t2 != t and (w, t2) not in out:
      out.append((w, t2))
  for w2 in (_step(worker_choices, w, -1), _step(worker_choices, w, +1)):
    if w2 is not None:
      out.append((w2, t))
  return out


def seed_settings(worker_choices: Sequence[int], thread_choices: Sequence[int], *,
                  cpus: int | None = None) -> list[tuple[int, int]]:
  """Worker counts doubling from 1, each with about one read thread per core.

  A climb that adds one worker at a time stalls on the plateau where a new
  worker process only takes the cores the read threads were using (measured:
  on 2 cores, 1 worker with 16 threads reads no faster than none, while 2
  workers with 1 thread read 1.36x faster). These settings sample the
  multi-process side of the plateau; their number grows with log2(workers).

  Example:
    >>> seed_settings([0, 1, 2], THREAD_LADDER, cpus=2)
    [(1, 2), (2, 1)]
    >>> seed_settings([0, 1, 2, 3, 4, 6, 8], THREAD_LADDER, cpus=8)
    [(1, 8), (2, 4), (4, 2), (8, 1)]
  """
  cpus = cpus or os.cpu_count() or 1
  positive = [t for t in thread_choices if t > 0] or list(thread_choices)
  seeds, w = [], 1
  while w <= max(worker_choices, default=0):
    if w in worker_choices:
      fit = [t for t in positive if t <= max(1, cpus // w)]
      seeds.append((w, max(fit) if fit else min(positive)))
    w *= 2
  return seeds


def choices(start: tuple[int, int], *, max_workers: int, max_read_threads: int,
            tune: Sequence[str] = ("workers", "read_threads")
            ) -> tuple[list[int], list[int]]:
  """The worker and thread values to climb over; a knob not in `tune` stays.

  Example:
    >>> choices((0, 16), max_workers=3, max_read_threads=4, tune=("workers",))
    ([0, 1, 2, 3], [16])
  """
  for knob in tune:
    if knob not in KNOBS:
      raise ConfigError(f"tune={tuple(tune)!r}: unknown knob {knob!r}"
                        f"{did_you_mean(str(knob), KNOBS)}; valid: {format_choices(KNOBS)}.")
  workers = _ladder(max_workers) if "workers" in tune else [start[0]]
  threads = ([t for t in THREAD_LADDER if t <= max_read_threads] if "read_threads" in tune
             else [start[1]])
  return workers, threads


def hill_climb(measure: Measure, *, start: tuple[int, int], worker_choices: Sequence[int],
               thread_choices: Sequence[int], budget_s: float, max_batches: int | None,
               trial_batches: Callable[[tuple[int, int]], int],
               margin: float = NOISE_MARGIN, confirm_rounds: int = 2,
               fast_enough: float = float("inf"),
               seeds: Sequence[tuple[int, int]] = (),
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
    measure: `measure(setting, deadline) -> Trial`.
    start: the (workers, read threads) to start from (always measured first).
    worker_choices: the worker counts it may try.
    thread_choices: the read-thread counts it may try.
    budget_s: seconds the whole climb may take.
    max_batches: batches all trials together may read (None: no limit).
    trial_batches: batches one trial of a setting reads.
    margin: the relative gain that counts as better than noise.
    confirm_rounds: re-measurements of each of the two best settings.
    fast_enough: stop after the first trial if it reads this fast.
    seeds: settings measured right after `start`, before climbing; the
      climb starts from the best of them all (see `seed_settings`), so it
      can reach a region a step-by-step climb would not cross into.
    clock: seconds, monotonic (a fake one in tests).

  Returns:
    A `TuningResult` with every trial.

  Example:
    >>> speed = {(0, 16): 10.0, (0, 8): 9.0, (1, 16): 15.0, (1, 8): 14.0,
    ...          (2, 16): 12.0, (1, 4): 13.0}
    >>> def measure(s, deadline):
    ...   return Trial(*s, batches_per_s=speed.get(s, 1.0), batches=10,
    ...                startup_s=0.0, seconds=0.1)
    >>> hill_climb(measure, start=(0, 16), worker_choices=[0, 1, 2],
    ...            thread_choices=THREAD_LADDER, budget_s=60, max_batches=1000, trial_batches=lambda s: 10).setting
    (1, 16)
  """
  t0 = clock()
  trials: list[Trial] = []
  scores: dict[tuple[int, int], list[float]] = {}
  batches = 0
  stopped = "converged"

  def estimate(setting: tuple[int, int]) -> float:
    same = [t.seconds for t in trials if t.worker_count == setting[0]]
    if same:
      return max(same)
    per_worker = [t.startup_s / t.worker_count for t in trials if t.worker_count]
    startup = (max(per_worker) if per_worker else DEFAULT_STARTUP_PER_WORKER_S) * setting[0]
    body = max((t.seconds - t.startup_s for t in trials), default=0.0)
    return startup + body

  def run(setting: tuple[int, int], phase: str) -> bool:
    nonlocal batches, stopped
    if max_batches is not None and batches + trial_batches(setting) > max_batches:
      stopped = "max_batches"
      return False
    spent = clock() - t0
    if spent >= budget_s or spent + estimate(setting) > budget_s:
      stopped = "budget"
      return False
    trial = dataclasses.replace(measure(setting, t0 + budget_s), phase=phase)
    trials.append(trial)
    batches += trial.batches
    scores.setdefault(setting, []).append(trial.batches_per_s)
    log.debug("dataloader tuning trial %d (%s): workers=%d read_threads=%d "
              "%.2f batches/s (%.4f s/batch), startup %.2f s, %d batches",
              len(trials), phase, setting[0], setting[1], trial.batches_per_s,
              1.0 / trial.batches_per_s if trial.batches_per_s else float("inf"),
              trial.startup_s, trial.batches)
    return True

  def score(setting: tuple[int, int]) -> float:
    return statistics.median(scores[setting])

  log.debug("========= tunedjax DataLoader auto-tune =========")
  log.debug("start: workers=%d read_threads=%d; range: workers %s, read_threads %s; "
            "budget %.1f s, %s batches", start[0], start[1], list(worker_choices),
            list(thread_choices), budget_s, max_batches)
  if not run(start, "climb"):
    return TuningResult(*start, batches_per_s=0.0, start=start, trials=(),
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
    untried = [n for n in neighbours(current, worker_choices=worker_choices,
                                     thread_choices=thread_choices)
               if n not in scores]
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
    for setting in (top if r % 2 == 0 else top[::-1]):
      if not run(setting, "confirm"):
        break
  winner = max(top, key=score)
  if winner != start and score(winner) <= score(start) * (1 + margin):
    winner = start
  result = TuningResult(*winner, batches_per_s=score(winner), start=start,
                        trials=tuple(trials), seconds=clock() - t0, batches=batches,
                        stopped=stopped)
  log.debug("auto-tune dataloader best: workers=%d read_threads=%d (%.2f batches/s, "
            "start %.2f) after %d trials, %.1f s", winner[0], winner[1],
            score(winner), score(start), len(trials), result.seconds)
  return result


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


def _validate(value: dict[str, Any]) -> None:
  for field in ("worker_count", "read_threads"):
    v = value.get(field)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
      raise ValueError(f"{field} must be an int >= 0, got {v!r}")
  if not isinstance(value.get("batches_per_s"), (int, float)):
    raise TypeError(f"batches_per_s must be a number, got {value.get('batches_per_s')!r}")


_tuning.register_validator(NAMESPACE, _validate)


def _measure_real(ds: Any, *, warmup: int, window: int, max_window_s: float,
                  consumer: Callable[[Any], Any] | None, consumer_s: float | None,
                  clock: Callable[[], float]) -> Measure:
  def consume(batch: Any) -> None:
    if consumer is not None:
      _block(consumer(batch))
    elif consumer_s:
      time.sleep(consumer_s)

  def measure(setting: tuple[int, int], deadline: float) -> Trial:
    start = clock()
    iterator = _processes.open_iterator(ds, workers=setting[0], read_threads=setting[1])
    read = 0
    try:
      consume(next(iterator))
      read = 1
      startup = clock() - start
      for _ in range(warmup - 1):
        if clock() >= deadline:  # a slow consumer: the budget beats draining buffers
          break
        consume(next(iterator))
        read += 1
      window_start = clock()
      window_end = min(deadline, window_start + max_window_s)
      timed = 0
      while timed < window:
        consume(next(iterator))
        timed += 1
        if clock() >= window_end and timed >= 2:
          break
      elapsed = max(clock() - window_start, 1e-9)
    finally:
      _processes.close_quietly(iterator)
    return Trial(*setting, batches_per_s=timed / elapsed, batches=read + timed,
                 startup_s=startup, seconds=clock() - start)

  return measure


def _block(value: Any) -> None:
  try:
    import jax  # pylint: disable=g-import-not-at-top
    jax.block_until_ready(value)
  except Exception:  # pylint: disable=broad-except
    pass


def trial_sizes(tuning_steps: int, setting: tuple[int, int]) -> tuple[int, int]:
  """(warm-up, window) batches of one trial of `setting`: `tuning_steps` in all.

  As in Paddle, `tuning_steps` batches are read per trial. The warm-up drains
  what the prefetch buffers hold once the workers are up (at most half the
  batches), so that the window times the pipeline, not the buffers.

  Example:
    >>> trial_sizes(500, (2, 4))
    (21, 479)
  """
  warmup = max(1, min(_processes.buffered_batches(*setting) + 1, tuning_steps // 2))
  return warmup, max(1, tuning_steps - warmup)


def tune_worker_count(source: Any, *, batch_size: int, transforms: Sequence[Any] = (),
                      shuffle: bool = True, seed: int = 0, drop_remainder: bool = True,
                      worker_count: int | None = None, read_threads: int | None = None,
                      max_workers: int | None = None,
                      max_read_threads: int = DEFAULT_READ_THREADS,
                      tuning_steps: int | None = None, budget_s: float = 60.0,
                      consumer: Callable[[Any], Any] | None = None,
                      consumer_s: float | None = None, margin: float = NOISE_MARGIN,
                      cache: Any = True,
                      tune: Sequence[str] = KNOBS,
                      clock: Callable[[], float] = time.perf_counter) -> TuningResult:
  """Finds the (worker processes, read threads) that read a pipeline fastest.

  Hill-climbs from (`worker_count`, `read_threads`) over worker processes
  (0 to `max_workers`) and read threads (0 to `max_read_threads`), timing
  each setting on a random subset of the records: a warm-up, then a window
  that ends after `tuning_steps` batches in all or a time slice of the
  budget, whichever comes first; the whole tuning stays within `budget_s`. With `consumer` (e.g. the
  compiled training step) or `consumer_s` (its duration, slept: a step that
  runs on an accelerator), it measures end-to-end steps per second. The
  choice is stored in the persistent tuning cache under this host and this
  pipeline, and reused without measuring. Trials are logged at DEBUG on the
  ``tunedjax.input_pipeline`` logger.

  Args:
    source: a random-access source (grain data source, sequence, arrays).
    batch_size: records per batch.
    transforms: per-record transforms (grain Map/RandomMap or callables).
    shuffle: shuffle records (as the loader will).
    seed: picks the random subset the tuner reads.
    drop_remainder: as the loader will.
    worker_count: the setting to start from (None: 0, no workers).
    read_threads: the read threads to start from (None: grain's 16).
    max_workers: the most workers to try (None: config, else the CPU count).
    max_read_threads: the most read threads to try.
    tuning_steps: batches one trial reads at most, warm-up included (as
      Paddle's; None: the config's value).
    budget_s: seconds the tuning may take.
    consumer: called on each timed batch (its result is waited for).
    consumer_s: seconds per step to simulate when there is no consumer.
    margin: relative gain that counts as better than noise.
    cache: True or None for the default tuning cache, False for none, a
      `Cache` or a folder (`tunedjax._tuning.resolve_cache`).
    tune: the knobs to climb over ("workers", "read_threads"); the others
      stay at their start value.
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
  for name, value, low in (("max_workers", max_workers, 0), ("tuning_steps", tuning_steps, 1),
                           ("max_read_threads", max_read_threads, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ConfigError(f"tune_worker_count({name}=...) must be an int >= {low}, got {value!r}.")
  start = (0 if worker_count is None else worker_count,
           DEFAULT_READ_THREADS if read_threads is None else read_threads)
  start = (min(start[0], max_workers) if "workers" in tune else start[0],
           min(start[1], max_read_threads) if "read_threads" in tune else start[1])
  source = _dataset.as_source(source)
  transforms = _dataset.check_transforms(transforms)

  store = _tuning.resolve_cache(cache)
  key = {"host": host_fingerprint(),
         "pipeline": pipeline_fingerprint(source, batch_size=batch_size, transforms=transforms,
                                          shuffle=shuffle, drop_remainder=drop_remainder),
         "max_workers": max_workers, "max_read_threads": max_read_threads,
         "tune": sorted(tune), "start": list(start),
         "consumer": (_dataset.name_of(consumer) if consumer is not None
                      else (f"sleep {consumer_s:.3g} s" if consumer_s else None))}
  if store is not None:
    hit = store.get(NAMESPACE, key)
    if hit is not None:
      log.debug("dataloader tuning: cache hit, workers=%d read_threads=%d",
                hit["worker_count"], hit["read_threads"])
      return TuningResult(hit["worker_count"], hit["read_threads"],
                          batches_per_s=float(hit["batches_per_s"]), start=start,
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
  if consumer is not None:
    # A training step's first call compiles it: once, before the clock starts,
    # so the budget measures the pipeline and not XLA.
    _block(consumer(ds[0]))

  def measure_setting(setting: tuple[int, int], deadline: float) -> Trial:
    warmup, window = trial_sizes(tuning_steps, setting)
    return _measure_real(ds, warmup=warmup, window=window,
                         max_window_s=min(2.0, max(0.25, budget_s / 15)), consumer=consumer,
                         consumer_s=consumer_s, clock=clock)(setting, deadline)

  worker_choices, thread_choices = choices(start, max_workers=max_workers,
                                           max_read_threads=max_read_threads, tune=tune)
  result = hill_climb(measure_setting, start=start, worker_choices=worker_choices,
                      thread_choices=thread_choices, budget_s=budget_s,
                      max_batches=None, fast_enough=FAST_ENOUGH,
                      trial_batches=lambda s: sum(trial_sizes(tuning_steps, s)),
                      margin=margin, clock=clock,
                      seeds=(seed_settings(worker_choices, thread_choices)
                             if len(worker_choices) > 1 and len(thread_choices) > 1 else ()))
  if store is not None and result.trials:
    store.put(NAMESPACE, key, {
        "worker_count": result.worker_count, "read_threads": result.read_threads,
        "batches_per_s": result.batches_per_s, "seconds": result.seconds,
        "trials": [[t.worker_count, t.read_threads, round(t.batches_per_s, 3)]
                   for t in result.trials]})
  return result


