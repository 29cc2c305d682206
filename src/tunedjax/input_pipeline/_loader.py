"""`Loader`: a deterministic, resumable grain pipeline that tunes itself."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tunedjax._config import get_config
from tunedjax._errors import ConfigError
from tunedjax._errors import TunedJaxError
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline import _state
from tunedjax.input_pipeline import _tuner
from tunedjax.input_pipeline._result import TuningResult
from tunedjax.input_pipeline._settings import LoaderSettings
from tunedjax._errors import is_int as _is_int
from tunedjax._errors import show_value as _show

log = logging.getLogger("tunedjax.input_pipeline")

AUTO = "auto"





def _check_int(name: str, value: Any, low: int, *, high: int | None = None,
               auto: bool = False, optional: bool = False, why: str = "") -> Any:
  """`value` as an int from `low` to `high`, or "auto"/None where allowed;
  otherwise a `ConfigError` that names the argument and the valid values."""
  if auto and isinstance(value, str) and value == AUTO:
    return value
  if optional and value is None:
    return value
  if _is_int(value) and value >= low and (high is None or value <= high):
    return int(value)
  allowed = f"an int >= {low}" + (f" and <= {high}" if high is not None else "")
  allowed += (" or 'auto'" if auto else "") + (" or None" if optional else "")
  raise ConfigError(f"Loader({name}=...) must be {allowed}{why}, got {_show(value)}.")


def _check_bool(name: str, value: Any) -> bool:
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise ConfigError(f"Loader({name}=...) must be True or False, got {_show(value)}.")


class Loader:
  """Batches from any random-access source, in an order no setting changes.

  A grain pipeline: records are shuffled (anew each epoch), transformed and
  batched on grain's `MapDataset` side, then read by `worker_count` worker
  processes with `read_threads` threads each, each worker keeping
  `prefetch_buffer` batches ready (together: its `settings`, a
  `LoaderSettings`). Because batch ``i`` is a pure function of ``i``, the
  same seed gives the same batches in the same order whatever the settings,
  and a checkpoint (`get_state`) is a position in global batches that
  restores under any worker count.

  When a knob is ``"auto"``, or the config's ``dataloader.enable`` is on, the
  loader measures the best `LoaderSettings` on a random subset of the
  records before the first batch (`tune_worker_count`, bounded by
  `tuning_budget_s`, reading at most `tuning_steps` batches per trial; the
  per-worker buffer also by the memory its batches take), or reuses the
  choice the persistent tuning cache holds for this host and pipeline.
  Integers with ``dataloader.enable`` off are used as given. The
  `prefetch_buffer` only matters with worker processes: ``"auto"`` tunes it
  along with the worker or thread count, and alone means 2 batches. Tuning
  never reads from, or moves, the training stream. Call `tune` first to
  include the training step in the measurement (`consumer=` / `consumer_s=`).

  Worker processes exit when the loader is closed (`close`, ``with``, garbage
  collection, interpreter exit) and when this process dies, even by SIGKILL.
  Worker processes are started with ``spawn``, so a script that uses workers
  needs the usual ``if __name__ == "__main__":`` guard.

  Args:
    source: a grain data source, a sequence (``__len__`` and ``__getitem__``),
      a NumPy array, or a dict/tuple of arrays (one row per record).
    batch_size: records per batch.
    transforms: per-record transforms applied in order: ``grain.transforms.Map``,
      ``grain.transforms.RandomMap`` (seeded per record) or callables.
    shuffle: shuffle the records, with a new order each epoch.
    seed: the seed of the shuffle and of random transforms.
    num_epochs: epochs to yield; None (default) for an endless stream.
    drop_remainder: drop each epoch's last, short batch.
    worker_count: worker processes (at most 1024), or "auto" to measure.
    read_threads: read threads per process (at most 256), or "auto" to measure.
    prefetch_buffer: batches each worker process keeps ready (grain's
      ``per_worker_buffer_size``, at most 1024), or "auto" to measure it
      with the others.
    tuning_steps: batches the tuner reads per trial, at most (None: the
      config's, 500 by default).
    max_workers: the most workers to try (None: config, else the CPU count;
      at most 1024).
    tuning_budget_s: seconds the tuner may take; 0 turns measuring off
      ("auto" then means 0 workers, 16 read threads and a buffer of 2).

  Example:
    >>> loader = Loader(np.arange(10), batch_size=4, shuffle=False, worker_count=0,
    ...                 read_threads=0, num_epochs=1)
    >>> [b.tolist() for b in loader]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> loader.get_state()["position"]
    2
  """

  def __init__(self, source: Any, *, batch_size: int, transforms: Sequence[Any] = (),
               shuffle: bool = True, seed: int = 0, num_epochs: int | None = None,
               drop_remainder: bool = True, worker_count: int | str = AUTO,
               read_threads: int | str = AUTO, prefetch_buffer: int | str = AUTO,
               tuning_steps: int | None = None,
               max_workers: int | None = None, tuning_budget_s: float = 60.0):
    self._iterator: Any = None
    self._closed = False
    self._source = _dataset.as_source(source)
    self._batch_size = _check_int("batch_size", batch_size, 1)
    self._transforms = _dataset.check_transforms(transforms)
    self._shuffle = _check_bool("shuffle", shuffle)
    self._seed = _check_int("seed", seed, 0, high=2**32 - 1)
    self._drop_remainder = _check_bool("drop_remainder", drop_remainder)
    given = {"worker_count": worker_count, "read_threads": read_threads,
             "prefetch_buffer": prefetch_buffer}
    self._requested = {k.name: _check_int(k.name, given[k.name], k.low, high=k.high,
                                          auto=True)
                       for k in _settings.KNOBS}
    self._tuning_steps = _check_int("tuning_steps", tuning_steps, 1, optional=True)
    self._max_workers = _check_int("max_workers", max_workers, 0,
                                   high=_settings.knob("worker_count").high, optional=True)
    if (isinstance(tuning_budget_s, bool) or not isinstance(tuning_budget_s, (int, float))
        or not tuning_budget_s >= 0):
      raise ConfigError(f"Loader(tuning_budget_s=...) must be a number of seconds >= 0 "
                        f"(0: no tuning), got {_show(tuning_budget_s)}.")
    self._tuning_budget_s = float(tuning_budget_s)
    self._per_epoch = (len(self._source) // self._batch_size if self._drop_remainder
                       else -(-len(self._source) // self._batch_size))
    if self._per_epoch == 0:
      raise ConfigError(
          f"Loader: {len(self._source)} records make no batch of batch_size="
          f"{self._batch_size} with drop_remainder={self._drop_remainder}; lower "
          "batch_size or pass drop_remainder=False.")
    # The stream's batches are indexed by a C ssize_t (grain's dataset length).
    self._num_epochs = _check_int(
        "num_epochs", num_epochs, 1, high=sys.maxsize // self._per_epoch, optional=True,
        why=f" (None: endless; all epochs' batches, {self._per_epoch} an epoch, must "
            "number at most 2**63 - 1)")
    self._dataset = _dataset.build(
        self._source, batch_size=self._batch_size, transforms=self._transforms,
        shuffle=self._shuffle, seed=self._seed, num_epochs=self._num_epochs,
        drop_remainder=self._drop_remainder)
    self._position = 0
    self._settings: LoaderSettings | None = None
    self._tuning: TuningResult | None = None

  # --- what the loader yields ------------------------------------------------

  @property
  def batch_size(self) -> int:
    """Records per batch."""
    return self._batch_size

  @property
  def batches_per_epoch(self) -> int:
    """Batches in one epoch (one pass over the source)."""
    return self._per_epoch

  @property
  def position(self) -> int:
    """Batches yielded since the start of the stream (all epochs)."""
    return self._position

  @property
  def epoch(self) -> int:
    """The epoch the next batch belongs to (0-based)."""
    return self._position // self._per_epoch

  def __len__(self) -> int:
    """All batches of all epochs; TypeError for an endless stream."""
    if self._num_epochs is None:
      raise TypeError("Loader(num_epochs=None) is endless and has no len(); use "
                      "loader.batches_per_epoch for the batches in one epoch.")
    return self._num_epochs * self._per_epoch

  # --- settings and tuning ---------------------------------------------------

  def _knobs_to_tune(self) -> tuple[str, ...]:
    if self._tuning_budget_s <= 0:
      return ()
    if get_config().dataloader.enable:
      return _settings.TUNE_NAMES
    auto = [k for k in _settings.KNOBS if self._requested[k.name] == AUTO]
    if not any(k.alone for k in auto):  # e.g. only the buffer: not worth a tuning
      return ()
    return tuple(k.tune_name for k in auto)

  @property
  def needs_tuning(self) -> bool:
    """Whether the settings are still to be chosen by `tune` (measured, or
    read from the cache) under the active config."""
    return self._settings is None and bool(self._knobs_to_tune())

  def _start_settings(self) -> LoaderSettings:
    return LoaderSettings(**{name: v for name, v in self._requested.items() if v != AUTO})

  def tune(self, *, consumer: Callable[[Any], Any] | None = None,
           consumer_s: float | None = None, expected_batches: int | None = None,
           cache: Any = True) -> TuningResult | None:
    """Chooses the settings now (measured, or from the cache).

    Runs by itself before the first batch; call it first to measure with the
    training step included. Returns None when nothing is tuned (the worker
    and thread counts given as ints and ``dataloader.enable`` off, or
    `tuning_budget_s` 0).
    The training stream does not move.

    Args:
      consumer: the training step, called on each timed batch.
      consumer_s: or its duration in seconds (slept).
      expected_batches: the batches this loader will be read for, which the
        tuning must pay back within (None: all its epochs when `num_epochs`
        is set, else at least one epoch and 1,000 batches); a cached choice
        tuned for fewer batches is measured again.
      cache: True (the default tuning cache), False, or a `Cache`.

    Returns:
      The `TuningResult`, or None.
    """
    knobs = self._knobs_to_tune()
    if not knobs:
      self._settings = self._start_settings()
      return None
    self._stop()
    self._tuning = _tuner.tune_worker_count(
        self._source, batch_size=self._batch_size, transforms=self._transforms,
        shuffle=self._shuffle, seed=self._seed, drop_remainder=self._drop_remainder,
        **self._start_settings().to_dict(),
        max_workers=self._max_workers, tuning_steps=self._tuning_steps,
        budget_s=self._tuning_budget_s, consumer=consumer, consumer_s=consumer_s,
        expected_batches=(expected_batches if expected_batches is not None else
                          len(self) if self._num_epochs is not None else
                          max(self._per_epoch, _tuner.DEFAULT_EXPECTED_BATCHES)),
        cache=cache, tune=knobs)
    self._settings = self._tuning.settings
    log.info("Loader: %s (%s)", self._settings,
             "cached" if self._tuning.from_cache else
             f"tuned in {self._tuning.seconds:.1f} s")
    return self._tuning

  @property
  def settings(self) -> LoaderSettings:
    """The `LoaderSettings` used (tunes first if needed)."""
    if self._settings is None:
      self.tune()
    assert self._settings is not None
    return self._settings

  @property
  def worker_count(self) -> int:
    """The worker processes used (tunes first if needed)."""
    return self.settings.worker_count

  @property
  def read_threads(self) -> int:
    """The read threads per process used (tunes first if needed)."""
    return self.settings.read_threads

  @property
  def prefetch_buffer(self) -> int:
    """The batches each worker keeps ready (tunes first if needed)."""
    return self.settings.prefetch_buffer

  @property
  def tuning(self) -> TuningResult | None:
    """What the tuner measured and chose, or None if it has not run."""
    return self._tuning

  # --- iteration ---------------------------------------------------------------

  def __iter__(self) -> Loader:
    return self

  def __next__(self) -> Any:
    if self._closed:
      raise TunedJaxError("This Loader was closed; make a new one, or restore a state "
                          "into a new Loader with set_state().")
    if self._iterator is None:
      if self._position >= len(self._dataset):
        raise StopIteration
      self._iterator = _processes.open_iterator(self._dataset[self._position:],
                                                self.settings)
      _processes.register(self)
    try:
      batch = next(self._iterator)
    except StopIteration:
      self._stop()
      raise
    except BaseException:
      self._stop()  # no worker outlives a failed read
      raise
    self._position += 1
    return batch

  # --- checkpoints -------------------------------------------------------------

  def _state(self) -> _state.LoaderState:
    return _state.LoaderState(position=self._position, num_records=len(self._source),
                              batch_size=self._batch_size, seed=self._seed,
                              shuffle=self._shuffle, drop_remainder=self._drop_remainder)

  def get_state(self) -> dict[str, Any]:
    """The position (batches consumed) and what identifies the stream.

    Independent of the settings (worker and thread counts, buffers): restore
    it into a loader with any. Plain ints and bools, for JSON or an orbax checkpoint.
    """
    return self._state().to_dict()

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Continues from a state of `get_state`; the next batch is the one after.

    Raises:
      StateError: the state comes from another stream (source length, batch
        size, seed, shuffle or drop_remainder differ) or is malformed.
    """
    restored = _state.LoaderState.from_dict(state)
    restored.check_matches(self._state())
    self._stop()
    self._position = restored.position

  # --- processes -----------------------------------------------------------------

  def _stop(self) -> None:
    iterator, self._iterator = self._iterator, None
    if iterator is not None:
      _processes.close_quietly(iterator)
      _processes.unregister(self)

  def close(self) -> None:
    """Stops the worker processes; the loader cannot be iterated afterwards."""
    self._stop()
    self._closed = True

  def __enter__(self) -> Loader:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __del__(self) -> None:
    if getattr(self, "_iterator", None) is not None and not sys.is_finalizing():
      self._stop()

  def __repr__(self) -> str:
    setting = ("untuned" if self._settings is None else
               ", ".join(f"{k}={v}" for k, v in self._settings.to_dict().items()))
    return (f"Loader({len(self._source)} records, batch_size={self._batch_size}, "
            f"position={self._position}, {setting})")
