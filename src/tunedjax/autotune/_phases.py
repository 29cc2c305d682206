"""The default tuning session's step counter, for users of `tunedjax.jit` alone.

The Trainer drives its own `TuningSession`; a training loop written by hand
around `tunedjax.jit` calls `step` at the start of every step instead, which
drives the default session (see `tunedjax._tuning.TuningSession` for the
observe/tune/apply phases). `stats` reports that session's cache hits,
misses and tuning seconds; `step` logs each tuning-window step at INFO, like
Paddle's ``cache_hit_rate`` lines.

Example:
  >>> reset()
  >>> step(), step(), step(index=10), step()
  (0, 1, 10, 11)
  >>> reset()
"""

from __future__ import annotations

from tunedjax import _tuning


def step(index: int | None = None) -> int:
  """Starts the next training step of the default session and returns its index.

  Args:
    index: the index of the step starting now, for a run that resumes at a
      later step (default: one more than the last, or 0).

  Returns:
    The step's index (0 on the first call).
  """
  return _tuning.default_session().step(index)


def stats() -> _tuning.Stats:
  """The default session's cache hits, misses, hit rate and tuning seconds so far.

  Example:
    >>> reset()
    >>> s = stats()
    >>> s.hits, s.misses, s.hit_rate, s.tuning_s
    (0, 0, 0.0, 0.0)
  """
  return _tuning.default_session().stats()


def reset() -> None:
  """Forgets the default session's step counter, statistics and measurements (caches kept)."""
  _tuning.default_session().reset()
