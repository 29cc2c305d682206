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
from tunedjax.input_pipeline import _errors
from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline import _search
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline._climb import NOISE_MARGIN
from tunedjax.input_pipeline._climb import Measure
from tunedjax.input_pipeline._climb import Trial
from tunedjax.input_pipeline._climb import TuningResult
from tunedjax.input_pipeline._climb import describe
from tunedjax.input_pipeline._climb import search_space
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax.input_pipeline._settings import THREAD_LADDER as THREAD_LADDER
from tunedjax.input_pipeline._settings import TUNE_NAMES

log = logging.getLogger("tunedjax.input_pipeline")

NAMESPACE = "dataloader"
DEFAULT_READ_THREADS = LoaderSettings().read_threads  # grain's ReadOptions default
DEFAULT_MAX_PREFETCH_BUFFER = 16
DEFAULT_EXPECTED_BATCHES = 1000


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

  Tuning has to pay for itself: it costs at most a tenth (`_search.OVERHEAD`) of the
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
    result = _search.search(
        ds, first, start=start, space=space, tuning_steps=tuning_steps, budget_s=budget_s,
        consumer=consumer, consumer_s=consumer_s, margin=margin,
        expected_batches=expected_batches, pool=pool, clock=clock,
        usable=max(1, host_fingerprint()["usable_cpus"]), measure_real=_measure_real,
        time_serial=_time_serial, time_consumer=_time_consumer)
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


