"""What the loader's tuner measured and chose: `Trial` and `TuningResult`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline._settings import LoaderSettings

_FIELDS = tuple(f.name for f in dataclasses.fields(LoaderSettings))


def describe(settings: LoaderSettings) -> str:
  """The knobs as ``tune=`` names and values, for logs.

  Example:
    >>> describe(LoaderSettings(worker_count=2, read_threads=1))
    'workers=2 read_threads=1 prefetch_buffer=2'
  """
  return " ".join(f"{_settings.knob(f).tune_name}={getattr(settings, f)}" for f in _FIELDS)


def _with_knobs(cls: type) -> type:
  """Gives `cls` (which has a `settings` field) one read-only attribute per
  knob, and the ``(worker_count, read_threads)`` pair of earlier versions."""
  for k in _settings.KNOBS:
    setattr(cls, k.name, property(
        lambda self, name=k.name: getattr(self.settings, name),
        doc=f"``settings.{k.name}`` (see `LoaderSettings`)."))
  cls.setting = property(
      lambda self: (self.settings.worker_count, self.settings.read_threads),
      doc="``(worker_count, read_threads)``, as earlier versions gave it; `settings` "
          "has every knob.")
  return cls


def _set(obj: object, settings: LoaderSettings | Sequence[int] | None,
         knobs: dict[str, int], **fields: object) -> None:
  object.__setattr__(obj, "settings", LoaderSettings.of(settings, **knobs))
  for name, value in fields.items():
    object.__setattr__(obj, name, value)


@_with_knobs
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
    phase: "guess" (the model-based first guesses), "climb" (a step of a
      climb), "seed" (see `_search.seed_settings`), "confirm" (the two best
      re-measured alternately) or "contention" (a consumer-bound start
      against reading in series, end to end).
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
    _set(self, settings, knobs, batches_per_s=batches_per_s, batches=batches,
         startup_s=startup_s, seconds=seconds, phase=phase, cpu_s=cpu_s)


@_with_knobs
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
    start: the `LoaderSettings` the search started from.
    trials: every trial, in order.
    seconds: the time spent tuning (0 on a cache hit).
    batches: the batches read while tuning (0 on a cache hit).
    stopped: why the tuning ended: "converged", "budget" (the allowance
      ended), "no budget" (not one trial fitted), "consumer-bound" (the
      loader is not the bottleneck: no search; the start is kept unless
      reading in series made the steps faster), "no payback" (over the
      horizon no setting could save enough to pay for a trial: read in
      series without one) or "cache" (reused a stored choice).
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
    _set(self, settings, knobs, batches_per_s=batches_per_s, start=LoaderSettings.of(start),
         trials=tuple(trials), seconds=seconds, batches=batches, stopped=stopped,
         from_cache=from_cache, step_s=step_s, batch_s=batch_s, reason=reason)

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
