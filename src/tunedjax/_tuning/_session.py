"""Tuning sessions: the phase, the step counter, the statistics and what was measured.

As in Paddle's kernel auto-tuning, a step counter splits a run into three
phases by the config's ``kernel.tuning_range = [start, stop)``:

* **observe** (steps before ``start``): nothing is tuned: every kernel site
  uses its family's default (``xla``), or, in a program the whole-program
  check has seen before, its bucket's cached winner; the first steps compile
  and warm up without tuning;
* **tune** (``start <= step < stop``): a site whose bucket is not in the
  cache is tuned and the winner stored;
* **apply** (``step >= stop``): cached winners are used; a miss uses the default.

A session with no step yet tunes at once. The state lives in a
`TuningSession` owned by whoever drives steps: each `tunedjax.Trainer` has
its own, `tunedjax.jit(..., session=...)` takes one, and the module-level
`tunedjax.autotune.step` drives `default_session()` for users of `tj.jit`
alone. While a program is traced, `using_session` makes a session current,
so the tuners (`current_session()`) read its phase and record into it.

A session also remembers what its tuners measured (`lookup`/`store`: an
in-process memo over the persistent `Cache`, so a readonly or unwritable
cache still serves what this run measured) and which warnings it gave.

Its **horizon** is how many times the tuned program is expected to run (the
`Trainer` sets it to the steps of each fit; None, the default, means
unbounded). Kernel selection tunes a bucket only when what tuning it could
save within the horizon exceeds what tuning it is expected to cost; the
session keeps the measured cost of past buckets (`record_tuning_cost`), per
platform, so that the estimate follows what tuning takes on the device it is
made for (`tuning_costs`, `tuning_cost_factor`): what tuning cost on the CPU
never stands for a GPU's.

Example:
  >>> import tunedjax as tj
  >>> s = TuningSession()
  >>> with tj.config_context({"kernel": {"tuning_range": [1, 3]}}):
  ...   [(s.step(), s.phase()) for _ in range(4)]
  [(0, 'observe'), (1, 'tune'), (2, 'tune'), (3, 'apply')]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import statistics
import threading
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

from tunedjax._config import get_config
from tunedjax._tuning._platform import canonical_platform

logger = logging.getLogger("tunedjax.autotune")

OBSERVE, TUNE, APPLY = "observe", "tune", "apply"
PHASES = (OBSERVE, TUNE, APPLY)
_MAX_STEPS_KEPT = 10_000
# Past buckets whose measured tuning cost corrects the next estimate.
_COST_SAMPLES = 16


@dataclasses.dataclass(frozen=True)
class StepStats:
  """Cache lookups made while tracing during one step.

  Attributes:
    step: the step index (None: before the first `TuningSession.step`).
    phase: ``"observe"``, ``"tune"`` or ``"apply"``.
    hits: lookups answered by the cache.
    misses: lookups the cache could not answer (tuned, or the default when applying).
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
  """What kernel selection did in one session (from `TuningSession.stats`).

  Attributes:
    step: the current step (None before the first step).
    phase: the current phase.
    hits: cache hits in total.
    misses: cache misses in total.
    tuning_s: seconds spent tuning in total.
    buckets_tuned: how many buckets were tuned.
    per_step: a `StepStats` for every step that looked anything up.
    buckets_kept: how many buckets kept their default without tuning
      because tuning them could not pay back within the horizon.
  """

  step: int | None
  phase: str
  hits: int
  misses: int
  tuning_s: float
  buckets_tuned: int
  per_step: tuple[StepStats, ...]
  buckets_kept: int = 0

  @property
  def hit_rate(self) -> float:
    """hits / (hits + misses); 0.0 without lookups."""
    total = self.hits + self.misses
    return self.hits / total if total else 0.0

  def window(self) -> tuple[StepStats, ...]:
    """The `per_step` entries whose step lies in the tuning window."""
    return tuple(s for s in self.per_step if s.phase == TUNE)


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


def _check_horizon(value: Any) -> int | None:
  if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
    return value
  raise ValueError("TuningSession.horizon must be None (unbounded) or an int >= 1 (the runs "
                   f"the tuned program is expected to make), got {value!r}.")


def _memo_key(cache: Any, namespace: str, key: Mapping[str, Any],
              platform: str | None) -> tuple[str, str, str, str]:
  where = str(getattr(cache, "path", None) or id(cache))
  return (where, str(platform), namespace, json.dumps(key, sort_keys=True, default=str))


class TuningSession:
  """The tuning state of one run: phase, step counter, statistics, measurements.

  Thread-safe. Create one per training run (the `Trainer` does); pass it to
  `tunedjax.jit(..., session=...)`, and call `step` at the start of every
  training step.

  Args:
    name: a label for logs and ``repr``.
    horizon: how many times the tuned program is expected to run (an int
      >= 1), or None for unbounded (see `horizon`).

  Example:
    >>> s = TuningSession("run-a", horizon=48)
    >>> s.step(), s.step(), s.step(index=10), s.current_step(), s.horizon
    (0, 1, 10, 10, 48)
    >>> s.reset(); s.current_step() is None
    True
  """

  def __init__(self, name: str = "session", *, horizon: int | None = None):
    self.name = str(name)
    self._lock = threading.RLock()
    self._horizon = _check_horizon(horizon)
    self._step: int | None = None
    self._per_step: dict[int | None, list[Any]] = {}
    self._buckets_tuned = 0
    self._buckets_kept = 0
    self._costs: dict[str, list[float]] = {}
    self._measured: dict[tuple[str, str, str], dict[str, Any]] = {}
    self._warned: set[Hashable] = set()
    self._observe_done = False

  def __repr__(self) -> str:
    return f"TuningSession({self.name!r}, step={self.current_step()})"

  # -- the tuning horizon -------------------------------------------------------

  @property
  def horizon(self) -> int | None:
    """How many times the tuned program is expected to run; None: unbounded.

    Kernel selection keeps a bucket's default kernel, untuned, when even a
    kernel taking no time at all could not save within this many runs what
    tuning the bucket is expected to cost. None (the default, and what
    `tunedjax.jit` alone gets) tunes every bucket. The `Trainer` sets it to
    the number of steps each `fit` runs. Setting it raises `ValueError` on
    anything but None or an int >= 1. It is read when a program is traced:
    `tunedjax.jit` re-traces when the phase moves, not when the horizon
    changes, so a program traced in an earlier, shorter fit keeps its
    choices in a later one (a new process re-decides from the cache).

    Example:
      >>> s = TuningSession()
      >>> s.horizon is None
      True
      >>> s.horizon = 100; s.horizon
      100
      >>> s.horizon = 0
      Traceback (most recent call last):
      ...
      ValueError: TuningSession.horizon must be None (unbounded) or an int >= 1 (the runs the tuned program is expected to make), got 0.
    """
    with self._lock:
      return self._horizon

  @horizon.setter
  def horizon(self, value: int | None) -> None:
    value = _check_horizon(value)
    with self._lock:
      self._horizon = value

  # -- steps and phases ---------------------------------------------------------

  def step(self, index: int | None = None) -> int:
    """Starts the next step and returns its index (0 on the first call).

    Logs the step that just ended at INFO when it lay in the tuning window.

    Args:
      index: the index of the step starting now, for a run that resumes at a
        later step (default: one more than the last, or 0).
    """
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)
                              or index < 0):
      raise ValueError(f"step(index=...) must be an int >= 0, got {index!r}.")
    tuning_range = get_config().kernel.tuning_range
    with self._lock:
      ended = self._step
      row = self._per_step.get(ended)
      self._step = index if index is not None else (0 if ended is None else ended + 1)
      new = self._step
    if row is not None and row[0] == TUNE:
      total = row[1] + row[2]
      logger.info("autotune %s step %s: %d lookups, %d hits, %d misses, cache hit rate "
                  "%.1f%%, %.2fs tuning", self.name, ended, total, row[1], row[2],
                  100.0 * row[1] / total if total else 0.0, row[3])
    if phase_of(new, tuning_range) != phase_of(ended, tuning_range):
      logger.info("autotune %s: step %d enters the %s phase (tuning_range %s)", self.name,
                  new, phase_of(new, tuning_range), list(tuning_range))
    return new

  def current_step(self) -> int | None:
    """The current step index, or None before the first `step`."""
    with self._lock:
      return self._step

  def phase(self, config: Any = None) -> str:
    """The phase now: ``"observe"``, ``"tune"`` or ``"apply"``."""
    config = get_config() if config is None else config
    with self._lock:
      step, skip_observe = self._step, self._observe_done
    phase = phase_of(step, config.kernel.tuning_range)
    return TUNE if phase == OBSERVE and skip_observe else phase

  def end_observe(self) -> None:
    """Ends the observe phase early: steps before the tuning window tune (or apply) too.

    The Trainer calls this when it tunes the kernels before step 0 (with the
    loader's tuning), so the steps before ``tuning_range`` run the tuned
    program instead of compiling an all-default one to observe.

    Example:
      >>> import tunedjax as tj
      >>> s = TuningSession()
      >>> with tj.config_context({"kernel": {"tuning_range": [2, 4]}}):
      ...   _ = s.step(); before = s.phase(); s.end_observe(); after = s.phase()
      >>> before, after
      ('observe', 'tune')
    """
    with self._lock:
      self._observe_done = True

  def quick_phase_key(self, config: Any) -> str:
    """`phase_key`, read without the lock (`tunedjax.jit` asks on every call).

    Example:
      >>> import tunedjax as tj
      >>> s = TuningSession()
      >>> with tj.config_context({"kernel": {"tuning_range": [1, 3]}}) as cfg:
      ...   [(s.step(), s.quick_phase_key(cfg))[1] for _ in range(3)]
      ['observe', 'select', 'select']
    """
    if self._observe_done:
      return "select"
    step = self._step
    observing = step is not None and step < config.kernel.tuning_range[0]
    return "observe" if observing else "select"

  def phase_key(self, config: Any = None) -> str:
    """What a traced program depends on: ``"observe"`` (all defaults) or ``"select"``.

    Tune and apply make the same choices for buckets tuned in the window, so
    a program traced in the tune phase need not be traced again to apply.
    """
    return "observe" if self.phase(config) == OBSERVE else "select"

  # -- statistics ---------------------------------------------------------------

  def record(self, *, hit: bool | None = None, tuning_s: float = 0.0, tuned: bool = False,
             kept: bool = False, config: Any = None) -> None:
    """Counts one cache lookup (and the tuning it caused) in the current step.

    Args:
      hit: True for a hit, False for a miss, None for no lookup.
      tuning_s: seconds spent tuning for it.
      tuned: whether a bucket was tuned.
      kept: whether a bucket kept its default because tuning it could not
        pay back within the horizon.
      config: the config (for the phase); default `get_config()`.
    """
    config = get_config() if config is None else config
    with self._lock:
      row = self._per_step.get(self._step)
      if row is None:
        row = self._per_step[self._step] = [
            phase_of(self._step, config.kernel.tuning_range), 0, 0, 0.0]
        while len(self._per_step) > _MAX_STEPS_KEPT:
          del self._per_step[next(iter(self._per_step))]
      if hit is True:
        row[1] += 1
      elif hit is False:
        row[2] += 1
      row[3] += tuning_s
      self._buckets_tuned += int(tuned)
      self._buckets_kept += int(kept)

  def record_tuning_cost(self, estimated_s: float, measured_s: float, *,
                         platform: str | None = None) -> None:
    """Remembers what tuning one bucket was estimated to cost and what it took.

    Args:
      estimated_s: the estimate made before tuning (> 0).
      measured_s: the seconds the tuning then took.
      platform: the platform the bucket was tuned on (``"cpu"``, ``"gpu"``,
        ``"tpu"``; None: JAX's default backend). Each platform's costs are
        kept apart.
    """
    if not (estimated_s > 0 and measured_s >= 0):
      return
    platform = canonical_platform(platform)
    with self._lock:
      costs = self._costs.setdefault(platform, [])
      costs.append(measured_s / estimated_s)
      del costs[:-_COST_SAMPLES]

  def tuning_costs(self, platform: str | None = None) -> tuple[float, ...]:
    """The last buckets' measured tuning cost over its estimate on `platform`, oldest first.

    Only that platform's: a GPU's tuning is never costed by what the CPU's took.

    Example:
      >>> s = TuningSession()
      >>> s.record_tuning_cost(1.0, 2.0, platform="cpu")
      >>> s.tuning_costs("cpu"), s.tuning_costs("gpu")
      ((2.0,), ())
    """
    platform = canonical_platform(platform)
    with self._lock:
      return tuple(self._costs.get(platform, ()))

  def tuning_cost_factor(self, platform: str | None = None) -> float:
    """How much the last buckets' tuning on `platform` cost over its estimate (the
    median; 1.0 before two). Kernel selection uses its own rule for a platform
    with fewer than two (`tunedjax.autotune._payback.cost_factor`).

    Example:
      >>> s = TuningSession()
      >>> s.tuning_cost_factor("cpu")
      1.0
      >>> for est, took in ((1.0, 2.0), (1.0, 3.0), (2.0, 5.0)):
      ...   s.record_tuning_cost(est, took, platform="cpu")
      >>> s.tuning_cost_factor("cpu"), s.tuning_cost_factor("gpu")
      (2.5, 1.0)
    """
    costs = self.tuning_costs(platform)
    return float(statistics.median(costs)) if len(costs) >= 2 else 1.0

  def stats(self, config: Any = None) -> Stats:
    """Cache hits, misses, hit rate and tuning seconds so far.

    Example:
      >>> s = TuningSession()
      >>> st = s.stats()
      >>> st.hits, st.misses, st.hit_rate, st.tuning_s, st.phase
      (0, 0, 0.0, 0.0, 'tune')
    """
    config = get_config() if config is None else config
    with self._lock:
      rows = [StepStats(k, row[0], row[1], row[2], row[3])
              for k, row in self._per_step.items()]
      current, tuned, kept = self._step, self._buckets_tuned, self._buckets_kept
    return Stats(step=current, phase=phase_of(current, config.kernel.tuning_range),
                 hits=sum(r.hits for r in rows), misses=sum(r.misses for r in rows),
                 tuning_s=float(sum(r.tuning_s for r in rows)), buckets_tuned=tuned,
                 per_step=tuple(rows), buckets_kept=kept)

  def reset(self) -> None:
    """Forgets the step counter, the statistics and the measurements (caches and
    the horizon are kept)."""
    with self._lock:
      self._step = None
      self._per_step.clear()
      self._buckets_tuned = 0
      self._buckets_kept = 0
      self._costs.clear()
      self._measured.clear()
      self._warned.clear()
      self._observe_done = False

  # -- what this session measured ----------------------------------------------

  def lookup(self, cache: Any, namespace: str, key: Mapping[str, Any], *,
             platform: str | None = None) -> dict[str, Any] | None:
    """A measured value: what this session stored first, then the persistent cache.

    Args:
      cache: a `Cache`, or None for this session's memory only.
      namespace: the tuner's namespace (``"conv"``, ``"layout"``, ...).
      key: the full key (JSON).
      platform: the platform the value was measured on, for a tuner that
        measures for several: this session's memory keeps them apart (as
        the cache does, one file per device) even without a cache.

    Returns:
      The value, or None on a miss.
    """
    memo = _memo_key(cache, namespace, key, platform)
    with self._lock:
      found = self._measured.get(memo)
    if found is not None or cache is None:
      return found
    found = cache.get(namespace, key)
    if found is not None:
      with self._lock:
        self._measured[memo] = found
    return found

  def store(self, cache: Any, namespace: str, key: Mapping[str, Any],
            value: Mapping[str, Any], *, platform: str | None = None) -> None:
    """Remembers `value` in this session and writes it to `cache` (if any).

    A cache that cannot be written (a read-only or full disk) warns once and
    keeps the value in memory (`Cache` never raises `OSError`); it is kept
    for this session either way. `platform` as for `lookup`.
    """
    with self._lock:
      self._measured[_memo_key(cache, namespace, key, platform)] = dict(value)
    if cache is not None:  # an unusable folder warns there and keeps the entry in memory
      cache.put(namespace, key, value)

  def forget_measured(self) -> None:
    """Forgets what this session measured (the cache files are kept)."""
    with self._lock:
      self._measured.clear()

  def first_time(self, what: Hashable) -> bool:
    """True the first time `what` is asked about in this session (warn-once keys)."""
    with self._lock:
      if what in self._warned:
        return False
      self._warned.add(what)
      return True


_DEFAULT = TuningSession("default")
_CURRENT: contextvars.ContextVar[TuningSession | None] = contextvars.ContextVar(
    "tunedjax_tuning_session", default=None)


def default_session() -> TuningSession:
  """The session that `tunedjax.autotune.step` drives, for `tj.jit` used alone."""
  return _DEFAULT


def current_session() -> TuningSession:
  """The session a trace reads and records into: the innermost `using_session`, or the default."""
  session = _CURRENT.get()
  return _DEFAULT if session is None else session


@contextlib.contextmanager
def using_session(session: TuningSession | None) -> Iterator[TuningSession]:
  """Makes `session` current inside the block (None: leave the current one).

  Example:
    >>> s = TuningSession("mine")
    >>> with using_session(s):
    ...   current_session() is s
    True
    >>> current_session() is default_session()
    True
  """
  if session is None:
    yield current_session()
    return
  if not isinstance(session, TuningSession):
    raise TypeError(f"session must be a tunedjax.autotune.TuningSession or None, got "
                    f"{session!r} (type {type(session).__name__}).")
  token = _CURRENT.set(session)
  try:
    yield session
  finally:
    _CURRENT.reset(token)
