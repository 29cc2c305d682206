"""`LoaderSettings`: the loader's tuned knobs, and the one table that describes them.

Each knob is a field of `LoaderSettings` and a row of `KNOBS`: its name in
``tune=``, its lowest value, the values a climb steps over, how neighbours
step it, whether it matters without worker processes, the memory bound on it
and the grain option it sets. The tuner (its neighbours, search space, trial
records and cache values), the measurement and the `Loader` read knobs only
through this table, so a new knob is a field and a row here (and, if users
set it, a keyword of `Loader` and `tune_worker_count`).

The knobs (field, ``tune=`` name, values climbed over, grain option):

* ``read_threads``, "read_threads": 0 1 2 4 8 16 up to the maximum, and a
  jump to 0; ``ReadOptions(num_threads=n, prefetch_buffer_size=max(1, 2n))``.
* ``worker_count``, "workers": 0 1 2 3 4 6 8 12 16 24 ... up to the maximum,
  and the maximum; ``MultiprocessingOptions(num_workers=n)`` (0: no
  ``mp_prefetch``, read in this process).
* ``prefetch_buffer``, "prefetch_buffer": 1 2 4 8 16 ... up to the maximum,
  stepped only with workers, and at most ``batches_in_memory // workers``
  (workers x buffer x one batch's bytes within the memory budget);
  ``MultiprocessingOptions(per_worker_buffer_size=n)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tunedjax._errors import ConfigError
from tunedjax._errors import did_you_mean
from tunedjax._errors import format_choices
from tunedjax._errors import is_int as _is_int
from tunedjax._errors import show_value as _show

# The fraction of the host's available memory the per-worker prefetch buffers
# may fill: workers x prefetch_buffer x one batch's bytes stays below it.
MEMORY_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class LoaderSettings:
  """The loader's knobs: what `tune_worker_count` chooses and `Loader` runs with.

  A batch does not depend on any of them: they change speed and memory only.

  Attributes:
    worker_count: worker processes (grain's ``MultiprocessingOptions.num_workers``;
      0 reads in this process).
    read_threads: read threads per process (grain's ``ReadOptions.num_threads``).
    prefetch_buffer: batches each worker process keeps ready (grain's
      ``MultiprocessingOptions.per_worker_buffer_size``); unused without workers.

  Example:
    >>> s = LoaderSettings(worker_count=2, read_threads=1)
    >>> s
    LoaderSettings(worker_count=2, read_threads=1, prefetch_buffer=2)
    >>> s.replace(prefetch_buffer=4).to_dict()
    {'worker_count': 2, 'read_threads': 1, 'prefetch_buffer': 4}
    >>> LoaderSettings.from_dict({"worker_count": 2, "read_threads": 1}) == s
    True
  """

  worker_count: int = 0
  read_threads: int = 16  # grain's ReadOptions default
  prefetch_buffer: int = 2

  def __post_init__(self) -> None:
    for knob in KNOBS:
      value = getattr(self, knob.name)
      if not _is_int(value) or not knob.low <= value <= knob.high:
        raise ValueError(f"LoaderSettings({knob.name}=...) must be {knob.describe_range()}, "
                         f"got {_show(value)}.")
      object.__setattr__(self, knob.name, int(value))

  def replace(self, **changes: int) -> LoaderSettings:
    """A copy with some knobs changed."""
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, int]:
    """The knobs as plain ints, by field name (for JSON and the tuning cache)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def from_dict(cls, values: Mapping[str, Any], *,
                missing: LoaderSettings | None = None) -> LoaderSettings:
    """Reads `to_dict`'s form; a knob it lacks takes its value from `missing`.

    An entry written before a knob existed lacks it: it was measured with
    the knob's default (`missing`'s default), the value every earlier version
    used. Other keys are ignored.

    Raises:
      ValueError: a knob's value is not an int within its bounds.
    """
    missing = cls() if missing is None else missing
    return cls(**{f.name: values.get(f.name, getattr(missing, f.name))
                  for f in dataclasses.fields(cls)})

  @classmethod
  def of(cls, value: LoaderSettings | Sequence[int] | Mapping[str, int] | None = None,
         **knobs: int) -> LoaderSettings:
    """`value` (settings, a tuple in field order, or a dict) with `knobs` on top.

    A tuple may be shorter than the fields, as the ``(worker_count,
    read_threads)`` pairs of earlier versions are; the rest keep defaults.

    Example:
      >>> LoaderSettings.of((2, 1), prefetch_buffer=4)
      LoaderSettings(worker_count=2, read_threads=1, prefetch_buffer=4)
    """
    if value is None:
      base = cls()
    elif isinstance(value, cls):
      base = value
    elif isinstance(value, Mapping):
      base = cls.from_dict(value)
    else:
      names = [f.name for f in dataclasses.fields(cls)]
      values = tuple(value)
      if len(values) > len(names):
        raise ValueError(f"LoaderSettings.of({values!r}): at most {len(names)} values "
                         f"({', '.join(names)}).")
      base = cls(**dict(zip(names, values)))
    return base.replace(**knobs) if knobs else base

  def grain_kwargs(self) -> dict[str, dict[str, int]]:
    """The keyword arguments of grain's option classes these settings give.

    Example:
      >>> LoaderSettings(worker_count=2, read_threads=1, prefetch_buffer=4).grain_kwargs()
      {'ReadOptions': {'num_threads': 1, 'prefetch_buffer_size': 2}, \
'MultiprocessingOptions': {'num_workers': 2, 'per_worker_buffer_size': 4}}
    """
    out: dict[str, dict[str, int]] = {"ReadOptions": {}, "MultiprocessingOptions": {}}
    for knob in KNOBS:
      for cls_name, kwargs in knob.grain(getattr(self, knob.name)).items():
        out[cls_name].update(kwargs)
    return out


@dataclasses.dataclass(frozen=True)
class Knob:
  """One row of the knob table: how the tuner treats one `LoaderSettings` field.

  Attributes:
    name: the `LoaderSettings` field (and the `Loader` keyword).
    tune_name: its name in ``tune=`` (and the cache key).
    low: the smallest valid value.
    high: the largest valid value: far above any useful setting, it turns a
      typo such as ``2**64`` into a clear error instead of a loader that
      starts that many threads or processes, or prefetches for ever.
    values: the values a climb steps over, given the most it may try.
    jump_to_lowest: whether neighbours include the lowest value (the ends of
      a knob can both beat the values in between).
    alone: whether ``"auto"`` on this knob alone starts tuning in `Loader`;
      otherwise it is tuned only along with another knob, else its default.
    applies: whether the knob changes anything under some settings (the
      climb does not step it where it does not).
    cap: the most it may be, given the settings and the batches the memory
      budget holds (None: no memory bound).
    grain: its value as grain option keywords, ``{class name: {kwarg: value}}``.
  """

  name: str
  tune_name: str
  low: int
  high: int
  values: Callable[[int], list[int]]
  grain: Callable[[int], dict[str, dict[str, int]]]
  jump_to_lowest: bool = False
  alone: bool = True
  applies: Callable[[LoaderSettings], bool] = lambda settings: True
  cap: Callable[[LoaderSettings, int], int] | None = None

  @property
  def default(self) -> int:
    """The `LoaderSettings` default of this knob."""
    return getattr(LoaderSettings(), self.name)

  def describe_range(self) -> str:
    """The valid values in words, for error messages: "an int >= 0 and <= 256"."""
    return f"an int >= {self.low} and <= {self.high}"


THREAD_LADDER = (0, 1, 2, 4, 8, 16)
# The largest valid value of each knob (`Knob.high`): grain starts that many
# read threads (and prefetches twice as many batches), worker processes, or
# keeps that many batches per worker.
MAX_READ_THREADS = 256
MAX_WORKER_COUNT = 1024
MAX_PREFETCH_BUFFER = 1024
WORKER_LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
BUFFER_LADDER = (1, 2, 4, 8, 16, 32, 64)


def _up_to(ladder: Sequence[int], most: int, *, with_most: bool = False) -> list[int]:
  values = [v for v in ladder if v <= most]
  if with_most and most not in values:
    values.append(most)
  return values


# In the order neighbours step them.
KNOBS: tuple[Knob, ...] = (
    Knob("read_threads", "read_threads", low=0, high=MAX_READ_THREADS,
         values=lambda most: _up_to(THREAD_LADDER, most), jump_to_lowest=True,
         grain=lambda n: {"ReadOptions": {"num_threads": n,
                                          "prefetch_buffer_size": max(1, 2 * n)}}),
    Knob("worker_count", "workers", low=0, high=MAX_WORKER_COUNT,
         values=lambda most: _up_to(WORKER_LADDER, most, with_most=True),
         grain=lambda n: {"MultiprocessingOptions": {"num_workers": n}}),
    Knob("prefetch_buffer", "prefetch_buffer", low=1, high=MAX_PREFETCH_BUFFER,
         values=lambda most: _up_to(BUFFER_LADDER, most), alone=False,
         applies=lambda s: s.worker_count > 0,
         cap=lambda s, batches: batches // max(1, s.worker_count),
         grain=lambda n: {"MultiprocessingOptions": {"per_worker_buffer_size": n}}),
)
TUNE_NAMES = tuple(k.tune_name for k in KNOBS)


def knob(name: str) -> Knob:
  """The row of a field name or a ``tune=`` name."""
  for k in KNOBS:
    if name in (k.name, k.tune_name):
      return k
  raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class Space:
  """Where a climb may go: each knob's values and the memory the buffers may take.

  Attributes:
    values: field name -> the sorted values the knob may take.
    batches_in_memory: batches the memory budget holds (None: no bound); a
      knob with a `Knob.cap` is kept at or below it (see `fit`).

  Example:
    >>> space = Space({"worker_count": (0, 1, 2, 4), "read_threads": (1,),
    ...                "prefetch_buffer": (1, 2, 4, 8)}, batches_in_memory=8)
    >>> space.fit(LoaderSettings(4, 1, 8))      # 4 workers x 2 batches fill the 8
    LoaderSettings(worker_count=4, read_threads=1, prefetch_buffer=2)
    >>> [s.to_dict() for s in space.neighbours(LoaderSettings(1, 1, 4))]
    [{'worker_count': 0, 'read_threads': 1, 'prefetch_buffer': 4}, \
{'worker_count': 2, 'read_threads': 1, 'prefetch_buffer': 4}, \
{'worker_count': 1, 'read_threads': 1, 'prefetch_buffer': 2}, \
{'worker_count': 1, 'read_threads': 1, 'prefetch_buffer': 8}]
  """

  values: Mapping[str, Sequence[int]]
  batches_in_memory: int | None = None

  def fit(self, settings: LoaderSettings) -> LoaderSettings:
    """`settings` with each capped knob lowered to its largest value within the cap.

    The memory rule: ``worker_count x prefetch_buffer x batch bytes`` stays
    within the budget, i.e. the buffer is at most ``batches_in_memory //
    worker_count``. Where even the knob's smallest value is over the cap, it
    takes that smallest value (grain needs one batch per worker); a knob the
    climb does not tune (one value) is left as given.
    """
    if self.batches_in_memory is None:
      return settings
    for k in KNOBS:
      if k.cap is None or not k.applies(settings):
        continue
      values = sorted(self.values.get(k.name, ()))
      limit = k.cap(settings, self.batches_in_memory)
      value = getattr(settings, k.name)
      if len(values) < 2 or value <= limit:
        continue
      fitting = [v for v in values if v <= limit]
      settings = settings.replace(**{k.name: fitting[-1] if fitting else values[0]})
    return settings

  def neighbours(self, settings: LoaderSettings) -> list[LoaderSettings]:
    """The settings one step away, knob by knob in `KNOBS` order: down, up,
    then (for a knob with `jump_to_lowest`) its lowest value, each fitted to
    the memory bound; a knob that does not apply to `settings` is not stepped.
    """
    out: list[LoaderSettings] = []
    for k in KNOBS:
      values = sorted(self.values.get(k.name, ()))
      if len(values) < 2 or not k.applies(settings):
        continue
      value = getattr(settings, k.name)
      steps = [_step(values, value, -1), _step(values, value, +1)]
      if k.jump_to_lowest:
        steps.append(values[0])
      for v in steps:
        if v is None or v == value:
          continue
        n = self.fit(settings.replace(**{k.name: v}))
        if n != settings and n not in out:
          out.append(n)
    return out



def search_space(start: LoaderSettings, *, maxima: Mapping[str, int],
                 tune: Sequence[str] = TUNE_NAMES,
                 batches_in_memory: int | None = None) -> Space:
  """The values each knob may take: its ladder up to `maxima`, or, for a knob
  not in `tune`, its `start` value alone.

  Args:
    start: the settings the search starts from.
    maxima: field name -> the most the knob may be (a knob not named: its
      start value, or its default if higher).
    tune: the ``tune=`` names of the knobs to search over.
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
  for k in KNOBS:
    here = getattr(start, k.name)
    most = maxima.get(k.name, max(here, k.default))
    values[k.name] = k.values(most) if k.tune_name in tune else [here]
  return Space(values, batches_in_memory=batches_in_memory)

def _step(values: Sequence[int], value: int, direction: int) -> int | None:
  """The next of the sorted `values` from `value` (which may be off them)."""
  if direction > 0:
    above = [v for v in values if v > value]
    return above[0] if above else None
  below = [v for v in values if v < value]
  return below[-1] if below else None


def batch_nbytes(batch: Any) -> int:
  """The bytes one batch takes: the sum of its arrays' ``nbytes``.

  Example:
    >>> import numpy as np
    >>> batch_nbytes({"x": np.zeros((4, 3), np.float32), "y": np.arange(4)})
    80
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  return int(sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(batch)))


def available_memory() -> int | None:
  """Bytes of memory available to new allocations on this host, or None if unknown.

  Reads ``MemAvailable`` from ``/proc/meminfo`` (Linux), else asks `os.sysconf`.

  Example:
    >>> (available_memory() or 1) > 0
    True
  """
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return None


def batches_in_memory(batch_bytes: int, memory_budget: int | None) -> int | None:
  """How many batches of `batch_bytes` fit the `memory_budget` (None: no bound).

  Example:
    >>> batches_in_memory(10 * 2**20, 2**30)    # 10 MiB batches, 1 GiB budget
    102
  """
  if memory_budget is None:
    return None
  return int(memory_budget // max(1, batch_bytes))


def default_memory_budget() -> int | None:
  """`MEMORY_FRACTION` of the memory available now, or None if unknown."""
  available = available_memory()
  return None if available is None else int(available * MEMORY_FRACTION)
