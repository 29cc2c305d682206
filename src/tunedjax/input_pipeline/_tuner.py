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
from tunedjax.input_pipeline._climb import NOISE_MARGIN
from tunedjax.input_pipeline._climb import Measure
from tunedjax.input_pipeline._climb import Trial
from tunedjax.input_pipeline._climb import TuningResult
from tunedjax.input_pipeline._climb import describe
from tunedjax.input_pipeline._climb import hill_climb
from tunedjax.input_pipeline._climb import search_space
from tunedjax.input_pipeline._climb import seed_settings
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import THREAD_LADDER as THREAD_LADDER
from tunedjax.input_pipeline._settings import TUNE_NAMES

log = logging.getLogger("tunedjax.input_pipeline")

NAMESPACE = "dataloader"
DEFAULT_READ_THREADS = LoaderSettings().read_threads  # grain's ReadOptions default
DEFAULT_MAX_PREFETCH_BUFFER = 16
# A pipeline already this fast (batches/s, or steps/s with a consumer) is no
# bottleneck for any training step: worker processes cannot pay for themselves.
FAST_ENOUGH = 1000.0


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

  store = _tuning.resolve_cache(cache)
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


