"""Measures `LoaderSettings` for a pipeline and picks the best.

Like PaddlePaddle's DataLoader autotune, this hill-climbs from the user's
setting and times real batches; unlike it, it climbs over every knob of
`LoaderSettings` (grain's worker processes *and* its read threads: tuning
workers alone misses the best setting; and the batches each worker keeps
ready, bounded by the memory they take), skips each trial's warm-up (worker
start, buffers filling), bounds its total time and batches, re-measures the
two best settings alternately before choosing, can include the training step
in the measurement (the step competes for the same cores), and keeps the
choice in the persistent tuning cache so that a restart measures nothing.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tunedjax._config import get_config
from tunedjax._errors import ConfigError
from tunedjax._errors import did_you_mean
from tunedjax._errors import format_choices
from tunedjax.autotune import _cache as _cache_mod
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import Space
from tunedjax.input_pipeline._settings import THREAD_LADDER as THREAD_LADDER
from tunedjax.input_pipeline._settings import TUNE_NAMES

log = logging.getLogger("tunedjax.input_pipeline")

NAMESPACE = "dataloader"
DEFAULT_READ_THREADS = LoaderSettings().read_threads  # grain's ReadOptions default
DEFAULT_MAX_PREFETCH_BUFFER = 16
DEFAULT_STARTUP_PER_WORKER_S = 1.5  # until one is measured
NOISE_MARGIN = 0.05
# A pipeline already this fast (batches/s, or steps/s with a consumer) is no
# bottleneck for any training step: worker processes cannot pay for themselves.
FAST_ENOUGH = 1000.0
KNOBS = TUNE_NAMES  # the names `tune=` takes


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
    phase: "climb", "seed" (see `seed_settings`) or "confirm" (the alternating
      re-measurement).

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

  def __init__(self, settings: LoaderSettings | Sequence[int] | None = None, *,
               batches_per_s: float, batches: int, startup_s: float, seconds: float,
               phase: str = "climb", **knobs: int):
    object.__setattr__(self, "settings", LoaderSettings.of(settings, **knobs))
    object.__setattr__(self, "batches_per_s", batches_per_s)
    object.__setattr__(self, "batches", batches)
    object.__setattr__(self, "startup_s", startup_s)
    object.__setattr__(self, "seconds", seconds)
    object.__setattr__(self, "phase", phase)

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
    stopped: why the climb ended: "converged", "budget", "max_batches",
      "fast enough" (the start already reads over `FAST_ENOUGH` batches/s),
      "cache" (reused a stored choice) or "no budget".
    from_cache: whether the choice came from the persistent cache.

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

  def __init__(self, settings: LoaderSettings | Sequence[int] | None = None, *,
               batches_per_s: float, start: LoaderSettings | Sequence[int],
               trials: tuple[Trial, ...], seconds: float, batches: int, stopped: str,
               from_cache: bool = False, **knobs: int):
    object.__setattr__(self, "settings", LoaderSettings.of(settings, **knobs))
    object.__setattr__(self, "batches_per_s", batches_per_s)
    object.__setattr__(self, "start", LoaderSettings.of(start))
    object.__setattr__(self, "trials", tuple(trials))
    object.__setattr__(self, "seconds", seconds)
    object.__setattr__(self, "batches", batches)
    object.__setattr__(self, "stopped", stopped)
    object.__setattr__(self, "from_cache", from_cache)

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
  batches = 0
  stopped = "converged"

  def estimate(settings: LoaderSettings) -> float:
    same = [t.seconds for t in trials if t.worker_count == settings.worker_count]
    if same:
      return max(same)
    per_worker = [t.startup_s / t.worker_count for t in trials if t.worker_count]
    startup = ((max(per_worker) if per_worker else DEFAULT_STARTUP_PER_WORKER_S)
               * settings.worker_count)
    body = max((t.seconds - t.startup_s for t in trials), default=0.0)
    return startup + body

  def run(settings: LoaderSettings, phase: str) -> bool:
    nonlocal batches, stopped
    if max_batches is not None and batches + trial_batches(settings) > max_batches:
      stopped = "max_batches"
      return False
    spent = clock() - t0
    if spent >= budget_s or spent + estimate(settings) > budget_s:
      stopped = "budget"
      return False
    trial = dataclasses.replace(measure(settings, t0 + budget_s), phase=phase)
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
  if not run(start, "climb"):
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


def host_fingerprint() -> dict[str, Any]:
  """What a data-loading timing depends on about this host.

  Example:
    >>> sorted(host_fingerprint())
    ['cpu', 'cpus', 'machine', 'usable_cpus']
  """
  cpu = platform.processor() or ""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
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


_cache_mod.register_validator(NAMESPACE, _validate)


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


def _measure_real(ds: Any, *, warmup: int, window: int, max_window_s: float,
                  consumer: Callable[[Any], Any] | None, consumer_s: float | None,
                  clock: Callable[[], float]) -> Measure:
  def consume(batch: Any) -> None:
    if consumer is not None:
      _block(consumer(batch))
    elif consumer_s:
      time.sleep(consumer_s)

  def measure(settings: LoaderSettings, deadline: float) -> Trial:
    start = clock()
    iterator = _processes.open_iterator(ds, settings)
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
    return Trial(settings, batches_per_s=timed / elapsed, batches=read + timed,
                 startup_s=startup, seconds=clock() - start)

  return measure


def _block(value: Any) -> None:
  try:
    import jax  # pylint: disable=g-import-not-at-top
    jax.block_until_ready(value)
  except Exception:  # pylint: disable=broad-except
    pass


def trial_sizes(tuning_steps: int, settings: LoaderSettings) -> tuple[int, int]:
  """(warm-up, window) batches of one trial of `settings`: `tuning_steps` in all.

  As in Paddle, `tuning_steps` batches are read per trial. The warm-up drains
  what the prefetch buffers hold once the workers are up (at most half the
  batches), so that the window times the pipeline, not the buffers.

  Example:
    >>> trial_sizes(500, LoaderSettings(worker_count=2, read_threads=4))
    (21, 479)
  """
  warmup = max(1, min(_processes.buffered_batches(settings) + 1, tuning_steps // 2))
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
                      cache: Any = True,
                      tune: Sequence[str] = TUNE_NAMES,
                      clock: Callable[[], float] = time.perf_counter) -> TuningResult:
  """Finds the `LoaderSettings` (worker processes, read threads, per-worker
  prefetch buffer) that read a pipeline fastest.

  Hill-climbs from (`worker_count`, `read_threads`, `prefetch_buffer`) over
  worker processes (0 to `max_workers`), read threads (0 to
  `max_read_threads`) and the batches each worker keeps ready (1 to
  `max_prefetch_buffer`, and at most `memory_budget` // (workers x one
  batch's bytes)), timing each setting on a random subset of the records: a
  warm-up, then a window that ends after `tuning_steps` batches in all or a
  time slice of the budget, whichever comes first; the whole tuning stays
  within `budget_s`. With `consumer` (e.g. the compiled training step) or
  `consumer_s` (its duration, slept: a step that runs on an accelerator), it
  measures end-to-end steps per second. The choice is stored in the
  persistent tuning cache under this host and this pipeline, and reused
  without measuring. Trials are logged at DEBUG on the
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
    cache: True for the default tuning cache, False for none, or a `Cache`.
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
  for name, value, low in (("max_workers", max_workers, 0), ("tuning_steps", tuning_steps, 1),
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

  store = _resolve_cache(cache)
  key = cache_key(source, batch_size=batch_size, transforms=transforms, shuffle=shuffle,
                  drop_remainder=drop_remainder, start=start, maxima=maxima, tune=tune,
                  consumer=consumer, consumer_s=consumer_s)
  if store is not None:
    hit = store.get(NAMESPACE, key)
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

  def measure_settings(settings: LoaderSettings, deadline: float) -> Trial:
    warmup, window = trial_sizes(tuning_steps, settings)
    return _measure_real(ds, warmup=warmup, window=window,
                         max_window_s=min(2.0, max(0.25, budget_s / 15)), consumer=consumer,
                         consumer_s=consumer_s, clock=clock)(settings, deadline)

  climbs_both = (len(space.values["worker_count"]) > 1
                 and len(space.values["read_threads"]) > 1)
  result = hill_climb(measure_settings, start=start, space=space, budget_s=budget_s,
                      max_batches=None, fast_enough=FAST_ENOUGH,
                      trial_batches=lambda s: sum(trial_sizes(tuning_steps, s)),
                      margin=margin, clock=clock,
                      seeds=seed_settings(start, space) if climbs_both else ())
  if store is not None and result.trials:
    store.put(NAMESPACE, key, {
        **result.settings.to_dict(),
        "batches_per_s": result.batches_per_s, "seconds": result.seconds,
        "batch_bytes": batch_bytes,
        "trials": [{**t.settings.to_dict(), "batches_per_s": round(t.batches_per_s, 3)}
                   for t in result.trials]})
  return result


def _resolve_cache(cache: Any) -> Any:
  if cache is False or cache is None:
    return None
  if cache is True:
    return _cache_mod.default_cache()
  return cache
