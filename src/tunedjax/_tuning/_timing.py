"""Side-by-side timing of alternatives, the way every tuner here measures.

One function, `time_interleaved`, is shared by the kernel tuner and the layout
pass's measure mode: each candidate is warmed up (compiled) first, then timed in
rounds whose order rotates, so that a slow stretch of a shared machine hits
every candidate alike. Results are per-call seconds; callers compare medians.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax

from tunedjax._errors import TunedJaxError


def _run(fn: Callable[[], Any], clock: Callable[[], float]) -> float:
  start = clock()
  jax.block_until_ready(fn())
  return clock() - start


def time_interleaved(candidates: Mapping[str, Callable[[], Any]], *,
                     rounds: int = 5, warmup: int = 1,
                     budget_s: float | None = None,
                     clock: Callable[[], float] = time.perf_counter,
                     stop: Callable[[Mapping[str, Sequence[float]]], bool] | None = None,
                     ) -> dict[str, list[float]]:
  """Times zero-argument callables against each other in rotated rounds.

  Each candidate is called `warmup` times untimed (the first call compiles),
  then `rounds` times timed; round ``r`` starts at candidate ``r mod n``, so
  no candidate always runs first or last. Each result goes through
  `jax.block_until_ready`. As `timeit` does, Python's garbage collector is
  off while the candidates run (and restored after), so a collection never
  lands inside one candidate's time; no collection is forced either, since
  one full collection of a process holding traced programs can take longer
  than the work being timed.

  Args:
    candidates: ``{name: fn}``; each ``fn()`` runs the work once.
    rounds: timed calls per candidate (at least 1).
    warmup: untimed calls per candidate before the first round.
    budget_s: stop after the round during which this many seconds (warm-up
      included) have passed; at least one round is always timed.
    clock: the time source (seconds); tests pass a fake one.
    stop: called with the timings so far after each round; True ends the
      measurement early (a caller whose decision is already clear).

  Returns:
    ``{name: [seconds of each timed call]}``, in the order of `candidates`.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((64, 64))
    >>> t = time_interleaved({"dot": lambda: x @ x, "add": lambda: x + x}, rounds=3)
    >>> sorted(t), len(t["dot"])
    (['add', 'dot'], 3)
  """
  if rounds < 1:
    raise TunedJaxError(f"time_interleaved needs rounds >= 1, got {rounds!r}.")
  if warmup < 0:
    raise TunedJaxError(f"time_interleaved needs warmup >= 0, got {warmup!r}.")
  names = list(candidates)
  times: dict[str, list[float]] = {name: [] for name in names}
  if not names:
    return times
  start = clock()
  collecting = gc.isenabled()
  gc.disable()
  try:
    for name in names:
      for _ in range(warmup):
        _run(candidates[name], clock)
    for r in range(rounds):
      for i in range(len(names)):
        name = names[(r + i) % len(names)]
        times[name].append(_run(candidates[name], clock))
      if budget_s is not None and clock() - start >= budget_s:
        break
      if stop is not None and r + 1 < rounds and stop(times):
        break
  finally:
    if collecting:
      gc.enable()
  return times


def median(xs: Sequence[float]) -> float:
  """The median of a non-empty sequence of timings.

  Example:
    >>> median([3.0, 1.0, 2.0])
    2.0
  """
  if not xs:
    raise TunedJaxError("median of no timings: time at least one round first.")
  return float(statistics.median(xs))
