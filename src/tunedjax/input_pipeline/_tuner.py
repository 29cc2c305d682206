"""`tune_worker_count`: measures a pipeline's `LoaderSettings`, keeps the choice.

The measuring side of the loader's tuner (`_search` chooses): like Paddle's
DataLoader autotune it times real batches, of grain iterators kept warm
(`_Pool`), with the training step when given (it competes for the cores),
from a random subset of the records in a pipeline of its own (the training
stream never moves); the choice goes to the persistent tuning cache.
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

from tunedjax import _tuning
from tunedjax._config import get_config
from tunedjax._errors import ConfigError
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _errors
from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline import _search
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline._result import Trial
from tunedjax.input_pipeline._result import TuningResult
from tunedjax.input_pipeline._result import describe
from tunedjax.input_pipeline._search import NOISE_MARGIN
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import TUNE_NAMES
from tunedjax.input_pipeline._settings import search_space

log = logging.getLogger("tunedjax.input_pipeline")

NAMESPACE = "dataloader"
DEFAULT_READ_THREADS = LoaderSettings().read_threads  # grain's ReadOptions default
DEFAULT_MAX_PREFETCH_BUFFER = 16
DEFAULT_EXPECTED_BATCHES = 1000


def tune_worker_count(source: Any, *, batch_size: int, transforms: Sequence[Any] = (),
                      shuffle: bool = True, seed: int = 0, drop_remainder: bool = True,
                      worker_count: int | None = None, read_threads: int | None = None,
                      prefetch_buffer: int | None = None, max_workers: int | None = None,
                      max_read_threads: int = DEFAULT_READ_THREADS,
                      max_prefetch_buffer: int = DEFAULT_MAX_PREFETCH_BUFFER,
                      memory_budget: int | None = None, tuning_steps: int | None = None,
                      budget_s: float = 60.0, consumer: Callable[[Any], Any] | None = None,
                      consumer_s: float | None = None, margin: float = NOISE_MARGIN,
                      expected_batches: int | None = None, cache: Any = True,
                      tune: Sequence[str] = TUNE_NAMES,
                      clock: Callable[[], float] = time.perf_counter) -> TuningResult:
  """Finds the `LoaderSettings` (worker processes, read threads, per-worker
  prefetch buffer) that read a pipeline fastest, in at most a tenth of the
  time the `expected_batches` take (the README's input pipeline section says
  how): no search where the step is the bottleneck (``stopped=
  "consumer-bound"``) or no trial could pay back (``stopped="no payback"``).
  The choice is cached per host and pipeline; a longer horizon tunes again.

  Args:
    source: a random-access source (grain data source, sequence, arrays).
    batch_size, transforms, shuffle, drop_remainder: as the loader will use.
    seed: picks the random subset of the records the tuner reads.
    worker_count, read_threads, prefetch_buffer: the settings to start from
      (None: no workers, grain's 16 threads, 2 batches).
    max_workers, max_read_threads, max_prefetch_buffer: the most to try of
      each (`max_workers=None`: the config's, else the CPU count).
    memory_budget: bytes the worker buffers may hold in all (None: a quarter
      of the memory available now).
    tuning_steps: batches a trial reads at most (None: the config's).
    budget_s: seconds the tuning may take.
    consumer: the training step, called on each timed batch (and timed alone).
    consumer_s: seconds per step to simulate without a consumer.
    margin: the relative gain that counts as better than noise.
    expected_batches: the horizon tuning pays back within (None: 1,000).
    cache: True or None for the default tuning cache, False for none, a
      `Cache` or a folder.
    tune: the knobs to search ("workers", "read_threads", "prefetch_buffer").
    clock: the timer.

  Example:
    >>> import tempfile, tunedjax as tj
    >>> with tj.config_context({"cache": {"dir": tempfile.mkdtemp()}}):
    ...   r = tune_worker_count(np.arange(64.0), batch_size=4, max_workers=0,
    ...                         max_read_threads=1, tuning_steps=64, budget_s=5)
    >>> r.worker_count, r.read_threads in (0, 1)
    (0, True)
  """
  start, maxima, tuning_steps, expected_batches = _resolve(
      {"worker_count": worker_count, "read_threads": read_threads,
       "prefetch_buffer": prefetch_buffer}, max_workers=max_workers, tuning_steps=tuning_steps,
      expected_batches=expected_batches, max_read_threads=max_read_threads,
      max_prefetch_buffer=max_prefetch_buffer, memory_budget=memory_budget, tune=tune)
  source, transforms = _dataset.as_source(source), _dataset.check_transforms(transforms)
  space = search_space(start, maxima=maxima, tune=tune)  # checks `tune`
  budget_bytes = _settings.default_memory_budget() if memory_budget is None else memory_budget
  store = _tuning.resolve_cache(cache)
  key = cache_key(source, batch_size=batch_size, transforms=transforms, shuffle=shuffle,
                  drop_remainder=drop_remainder, start=start, maxima=maxima, tune=tune,
                  consumer=consumer, consumer_s=consumer_s)
  hit = _from_cache(store, key, space, start=start, budget_bytes=budget_bytes,
                    expected_batches=expected_batches)
  if hit is not None:
    return hit
  ds = _tuning_dataset(source, batch_size=batch_size, transforms=transforms, shuffle=shuffle,
                       seed=seed, drop_remainder=drop_remainder, tuning_steps=tuning_steps)
  first = ds[0]
  batch_bytes = _settings.batch_nbytes(first)
  space = dataclasses.replace(
      space, batches_in_memory=_settings.batches_in_memory(batch_bytes, budget_bytes))
  if consumer is not None:  # its first call compiles: once, before the clock starts
    _block(consumer(first))
  with _Pool() as pool:
    bench = _bench(ds, first, tuning_steps=tuning_steps, consumer=consumer,
                   consumer_s=consumer_s, pool=pool, clock=clock)
    result = _search.search(bench, start=space.fit(start), space=space, budget_s=budget_s,
                            margin=margin, expected_batches=expected_batches,
                            usable=max(1, host_fingerprint()["usable_cpus"]), clock=clock)
  _store(store, key, result, batch_bytes=batch_bytes, expected_batches=expected_batches)
  return result


def _resolve(given: Mapping[str, int | None], *, max_workers: int | None,
             tuning_steps: int | None, expected_batches: int | None, max_read_threads: int,
             max_prefetch_buffer: int, memory_budget: int | float | None,
             tune: Sequence[str]) -> tuple[LoaderSettings, dict[str, int], int, int]:
  """(the start, each knob's maximum, tuning_steps, expected_batches), the
  config's defaults filled in and a tuned knob started within its maximum;
  a `ConfigError` names the first option that is out of range."""
  config = get_config().dataloader
  counts = {
      "max_workers": config.resolved_max_workers if max_workers is None else max_workers,
      "tuning_steps": config.tuning_steps if tuning_steps is None else tuning_steps,
      "expected_batches": (DEFAULT_EXPECTED_BATCHES if expected_batches is None
                           else expected_batches),
      "max_read_threads": max_read_threads, "max_prefetch_buffer": max_prefetch_buffer}
  least = {"max_workers": 0, "tuning_steps": 1, "expected_batches": 1, "max_read_threads": 0,
           "max_prefetch_buffer": 1}
  for name, value in counts.items():
    if not isinstance(value, int) or isinstance(value, bool) or value < least[name]:
      raise ConfigError(f"tune_worker_count({name}=...) must be an int >= {least[name]}, "
                        f"got {value!r}.")
  if memory_budget is not None and (isinstance(memory_budget, bool)
                                    or not isinstance(memory_budget, (int, float))
                                    or memory_budget <= 0):
    raise ConfigError(f"tune_worker_count(memory_budget=...) must be a number of bytes > 0 "
                      f"or None, got {memory_budget!r}.")
  try:
    start = LoaderSettings(**{k: v for k, v in given.items() if v is not None})
  except ValueError as err:
    raise ConfigError(f"tune_worker_count: {err}") from None
  maxima = {"worker_count": counts["max_workers"], "read_threads": max_read_threads,
            "prefetch_buffer": max_prefetch_buffer}
  for name in TUNE_NAMES:
    k = _settings.knob(name)
    if name in tune and getattr(start, k.name) > maxima[k.name]:
      start = start.replace(**{k.name: max(k.low, maxima[k.name])})
  return start, maxima, counts["tuning_steps"], counts["expected_batches"]


def _tuning_dataset(source: Any, *, batch_size: int, transforms: Sequence[Any], shuffle: bool,
                    seed: int, drop_remainder: bool, tuning_steps: int) -> Any:
  """The batches tuning reads: a random subset of the records, enough for a
  trial, in a pipeline of its own (the training stream never moves)."""
  rng = np.random.default_rng([seed, 0x7E57])
  subset = rng.choice(len(source), size=min(len(source), (tuning_steps + 1) * batch_size),
                      replace=False)
  ds = _dataset.build(source, batch_size=batch_size, transforms=transforms,
                      shuffle=shuffle, seed=seed, num_epochs=None,
                      drop_remainder=drop_remainder, indices=np.sort(subset))
  if len(ds) == 0:
    raise ConfigError(f"tune_worker_count: {len(source)} records make no batch of "
                      f"batch_size={batch_size} (drop_remainder={drop_remainder}).")
  return ds


# --- the cache entry ---------------------------------------------------------------


def _from_cache(store: Any, key: dict[str, Any], space: _settings.Space, *,
                start: LoaderSettings, budget_bytes: int | None,
                expected_batches: int) -> TuningResult | None:
  """The stored choice, fitted to the memory budget of the moment (it is not
  part of the key: it moves with the host's free memory); None where there
  is none, or where it was tuned for a shorter horizon (a longer one may pay
  for more trials, or workers: tune again, and replace it)."""
  hit = None if store is None else store.get(NAMESPACE, key)
  if hit is None:
    return None
  if stored_horizon(hit) < expected_batches:
    log.debug("dataloader tuning: the cached choice was tuned for %d batches, not %d: "
              "tuning again", stored_horizon(hit), expected_batches)
    return None
  batch_bytes = hit.get("batch_bytes")
  bound = (None if batch_bytes is None
           else _settings.batches_in_memory(batch_bytes, budget_bytes))
  chosen = dataclasses.replace(space, batches_in_memory=bound).fit(LoaderSettings.from_dict(hit))
  log.debug("dataloader tuning: cache hit, %s", describe(chosen))
  return TuningResult(chosen, batches_per_s=float(hit["batches_per_s"]), start=start,
                      trials=(), seconds=0.0, batches=0, stopped="cache", from_cache=True)


def _store(store: Any, key: dict[str, Any], result: TuningResult, *, batch_bytes: int,
           expected_batches: int) -> None:
  """Keeps a search's choice, or the finding that the step, not the loader,
  is the bottleneck or that no trial could pay back (no trials): either way
  a restart with this horizon need not measure again."""
  if store is None or not (result.trials or result.stopped in ("consumer-bound",
                                                               "no payback")):
    return
  store.put(NAMESPACE, key, {
      **result.settings.to_dict(),
      "batches_per_s": result.batches_per_s, "seconds": result.seconds,
      "batch_bytes": batch_bytes, "expected_batches": expected_batches,
      "trials": [{**t.settings.to_dict(), "batches_per_s": round(t.batches_per_s, 3)}
                 for t in result.trials]})


def host_fingerprint() -> dict[str, Any]:
  """What a data-loading timing depends on about this host.

  Example:
    >>> sorted(host_fingerprint())
    ['cpu', 'cpus', 'machine', 'usable_cpus']
  """
  cpu = _tuning.host_cpu().model or ""
  return {"cpu": cpu, "cpus": os.cpu_count() or 1, "usable_cpus": _search.usable_cores(),
          "machine": platform.machine()}


def pipeline_fingerprint(source: Any, *, batch_size: int, transforms: Sequence[Any],
                         shuffle: bool, drop_remainder: bool) -> dict[str, Any]:
  """What a timing depends on about the pipeline (names, not addresses).

  Example:
    >>> pipeline_fingerprint(np.arange(8), batch_size=4, transforms=[np.sqrt],
    ...                      shuffle=True, drop_remainder=True)["transforms"]
    ['numpy.sqrt']
  """
  return {"source": _errors.name_of(source), "num_records": len(source),
          "batch_size": batch_size, "transforms": [_errors.name_of(t) for t in transforms],
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
          "consumer": (_errors.name_of(consumer) if consumer is not None
                       else (f"sleep {consumer_s:.3g} s" if consumer_s else None))}


# --- the measurements ------------------------------------------------------------


def _bench(ds: Any, first: Any, *, tuning_steps: int, consumer: Callable[[Any], Any] | None,
           consumer_s: float | None, pool: _Pool, clock: Callable[[], float]) -> _search.Bench:
  """The search's measurements of `ds`: trials of grain iterators from
  `pool` (`trial_sizes` batches each), the consumer timed alone on `first`
  (or `consumer_s`), and batches read here in series."""

  def trial(window_s: float) -> _search.Measure:
    def measure(settings: LoaderSettings, deadline: float) -> Trial:
      warmup, window = trial_sizes(tuning_steps, settings)
      return _measure_real(ds, warmup=warmup, window=window, max_window_s=window_s,
                           consumer=consumer, consumer_s=consumer_s, clock=clock,
                           pool=pool)(settings, deadline)
    return measure

  def step(calls: int, limit_s: float) -> float | None:
    if consumer is not None:
      return _time_consumer(consumer, first, calls=calls, limit_s=limit_s, clock=clock)
    return float(consumer_s) if consumer_s else None

  def serial(batches: int, limit_s: float) -> tuple[float, float, int]:
    return _time_serial(ds, batches=batches, limit_s=limit_s, clock=clock)

  return _search.Bench(serial=serial, step=step, trial=trial)


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


class _Pool:
  """Iterators of measured worker settings, kept open between their trials.

  grain cannot change a started ``mp_prefetch`` iterator's settings, so each
  worker setting pays one process start, and its re-measurements read on
  from its warm workers. The `keep` most recent stay open; a close (grain
  joins the processes) runs in a background thread, and `close_all` (on
  leaving ``with``) waits for every one, so no worker outlives the tuning.
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

  def __enter__(self) -> _Pool:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close_all()


def _measure_real(ds: Any, *, warmup: int, window: int, max_window_s: float,
                  consumer: Callable[[Any], Any] | None, consumer_s: float | None,
                  clock: Callable[[], float], pool: _Pool) -> _search.Measure:
  """Trials of `ds` on iterators from `pool`: `warmup` batches (a slow
  consumer: until the deadline), then a window of `window` batches or
  `max_window_s`, whichever ends first, at the end of a wave (`_wave`);
  each batch goes to the consumer."""

  def consume(batch: Any) -> None:
    if consumer is not None:
      _block(consumer(batch))
    elif consumer_s:
      time.sleep(consumer_s)

  with_consumer = consumer is not None or bool(consumer_s)

  def measure(settings: LoaderSettings, deadline: float) -> Trial:
    start = clock()
    iterator, warm = pool.take(ds, settings)
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
    pool.give_back(settings, iterator)
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
