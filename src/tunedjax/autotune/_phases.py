"""Tuning phases and statistics, as in Paddle's kernel auto-tuning.

A step counter (`step`, which the Trainer calls at the start of every
training step) splits a run into three phases by the config's
``kernel.tuning_range = [start, stop)``:

* **observe** (steps before ``start``): every convolution uses ``xla``; the
  first steps compile and warm up without paying for tuning;
* **tune** (``start <= step < stop``): a convolution whose bucket is not in
  the cache is tuned and the winner stored;
* **apply** (``step >= stop``): cached winners are used; a miss uses ``xla``.

Without any `step` call the counter is unset and buckets are tuned the first
time a function is traced. Kernel choices are made when a function is
traced, so a jitted function must be traced again when the phase moves from
observe to the others (`select_kernels(..., jit=True)` does that, keyed on
`phase_key`).

`stats` gives the cache hits and misses (per step inside the tuning window,
and in total), the hit rate and the seconds spent tuning; `step` logs the
finished step's numbers at INFO, like Paddle's ``cache_hit_rate`` lines.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from tunedjax._config import get_config

logger = logging.getLogger("tunedjax.autotune")

OBSERVE, TUNE, APPLY = "observe", "tune", "apply"
_MAX_STEPS_KEPT = 10_000


@dataclasses.dataclass(frozen=True)
class StepStats:
  """Cache lookups made while tracing during one step.

  Attributes:
    step: the step index (None: before the first `step` call).
    phase: ``"observe"``, ``"tune"`` or ``"apply"``.
    hits: lookups answered by the cache.
    misses: lookups the cache could not answer (tuned, or ``xla`` when applying).
    tuning_s: seconds spent tuning in this step.
  """

  step: int | None
  phase: str
  hits: int = 0
  misses: int = 0
  tuning_s: float = 0.0

  @property
  def hit_rate(self) -> float:
    """hits / (hits + misses); 0.0 without lookups."""
    total = self.hits + self.misses
    return self.hits / total if total else 0.0


@dataclasses.dataclass(frozen=True)
class Stats:
  """What kernel selection did in this process (from `stats`).

  Attributes:
    step: the current step (None when `step` was never called).
    phase: the current phase.
    hits: cache hits in total.
    misses: cache misses in total.
    tuning_s: seconds spent tuning in total.
    buckets_tuned: how many buckets were tuned.
    per_step: a `StepStats` for every step that looked anything up.
  """

  step: int | None
  phase: str
  hits: int
  misses: int
  tuning_s: float
  buckets_tuned: int
  per_step: tuple[StepStats, ...]

  @property
  def hit_rate(self) -> float:
    """hits / (hits + misses); 0.0 without lookups."""
    total = self.hits + self.misses
    return self.hits / total if total else 0.0

  def window(self) -> tuple[StepStats, ...]:
    """The `per_step` entries whose step lies in the tuning window."""
    return tuple(s for s in self.per_step if s.phase == TUNE)


class _Counter:
  """The process's step counter and lookup statistics (thread-safe)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.step: int | None = None
    self.per_step: dict[int | None, list[Any]] = {}
    self.buckets_tuned = 0

  def entry(self, phase: str) -> list[Any]:
    row = self.per_step.get(self.step)
    if row is None:
      row = self.per_step[self.step] = [phase, 0, 0, 0.0]
      while len(self.per_step) > _MAX_STEPS_KEPT:
        del self.per_step[next(iter(self.per_step))]
    return row


_COUNTER = _Counter()


def phase_of(step_index: int | None, tuning_range: tuple[int, int]) -> str:
  """The phase of `step_index` for ``tuning_range = (start, stop)``.

  Example:
    >>> [phase_of(s, (1, 3)) for s in (None, 0, 1, 2, 3)]
    ['tune', 'observe', 'tune', 'tune', 'apply']
  """
  if step_index is None:
    return TUNE
  start, stop = tuning_range
  if step_index < start:
    return OBSERVE
  return TUNE if step_index < stop else APPLY


def current_step() -> int | None:
  """The current step index, or None when `step` was never called."""
  with _COUNTER.lock:
    return _COUNTER.step


def current_phase(config: Any = None) -> str:
  """The phase now: ``"observe"``, ``"tune"`` or ``"apply"``.

  Example:
    >>> reset()
    >>> current_phase()
    'tune'
  """
  config = get_config() if config is None else config
  return phase_of(current_step(), config.kernel.tuning_range)


def phase_key(config: Any = None) -> str:
  """What a traced program depends on: ``"observe"`` (all ``xla``) or ``"select"``.

  Tune and apply make the same choices for buckets tuned in the window, so
  a program traced in the tune phase need not be traced again to apply.
  """
  return "observe" if current_phase(config) == OBSERVE else "select"


def step(index: int | None = None) -> int:
  """Starts the next training step and returns its index (0 on the first call).

  Logs the step that just ended at INFO when it lay in the tuning window.

  Args:
    index: the index of the step starting now, for a run that resumes at a
      later step (default: one more than the last, or 0).

  Example:
    >>> reset()
    >>> step(), step(), step(index=10), step()
    (0, 1, 10, 11)
  """
  if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
    raise ValueError(f"autotune.step(index=...) must be an int >= 0, got {index!r}.")
  config = get_config()
  with _COUNTER.lock:
    ended = _COUNTER.step
    row = _COUNTER.per_step.get(ended)
    _COUNTER.step = index if index is not None else (0 if ended is None else ended + 1)
    new = _COUNTER.step
  if row is not None and row[0] == TUNE:
    total = row[1] + row[2]
    logger.info("autotune step %s: %d lookups, %d hits, %d misses, cache hit rate "
                "%.1f%%, %.2fs tuning", ended, total, row[1], row[2],
                100.0 * row[1] / total if total else 0.0, row[3])
  if phase_of(new, config.kernel.tuning_range) != phase_of(ended, config.kernel.tuning_range):
    logger.info("autotune: step %d enters the %s phase (tuning_range %s)", new,
                phase_of(new, config.kernel.tuning_range), list(config.kernel.tuning_range))
  return new


def record(*, hit: bool | None = None, tuning_s: float = 0.0, tuned: bool = False,
           config: Any = None) -> None:
  """Counts one cache lookup (and the tuning it caused) in the current step.

  Args:
    hit: True for a hit, False for a miss, None for no lookup.
    tuning_s: seconds spent tuning for it.
    tuned: whether a bucket was tuned.
    config: the config (for the phase); default `get_config()`.
  """
  config = get_config() if config is None else config
  with _COUNTER.lock:
    row = _COUNTER.entry(phase_of(_COUNTER.step, config.kernel.tuning_range))
    if hit is True:
      row[1] += 1
    elif hit is False:
      row[2] += 1
    row[3] += tuning_s
    _COUNTER.buckets_tuned += int(tuned)


def stats() -> Stats:
  """Kernel selection's cache hits, misses, hit rate and tuning seconds so far.

  Example:
    >>> reset()
    >>> s = stats()
    >>> s.hits, s.misses, s.hit_rate, s.tuning_s
    (0, 0, 0.0, 0.0)
  """
  config = get_config()
  with _COUNTER.lock:
    rows = [StepStats(k, row[0], row[1], row[2], row[3])
            for k, row in _COUNTER.per_step.items()]
    current = _COUNTER.step
    tuned = _COUNTER.buckets_tuned
  return Stats(step=current, phase=phase_of(current, config.kernel.tuning_range),
               hits=sum(r.hits for r in rows), misses=sum(r.misses for r in rows),
               tuning_s=float(sum(r.tuning_s for r in rows)), buckets_tuned=tuned,
               per_step=tuple(rows))


def reset() -> None:
  """Forgets the step counter and the statistics (the cache is kept).

  Example:
    >>> reset(); step(); reset(); current_step() is None
    0
    True
  """
  with _COUNTER.lock:
    _COUNTER.step = None
    _COUNTER.per_step.clear()
    _COUNTER.buckets_tuned = 0
