"""Side-by-side timing for tunedjax benchmarks.

These machines are shared: the same timing moves by +-15% between runs. So
every benchmark here times its variants interleaved in rounds (each round runs
every variant once, in a rotated order), quotes the median of the per-round
ratios against the baseline, and times the baseline twice (an A/A control)
so the table shows how much the noise alone moves a ratio.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

CONTROL = "A/A control"


def rotated(names: Sequence[Any], r: int) -> list[Any]:
  """`names` in round `r`'s order: each round starts one later, so that no variant
  always runs after the same one."""
  names = list(names)
  k = r % len(names) if names else 0
  return names[k:] + names[:k]


def first_call(fn: Callable[[], Any]) -> float:
  """Seconds of one call (a program's first: tracing, compiling, running)."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Timings:
  """Seconds per run, `runs[variant][round]`, from `interleaved`."""

  runs: Mapping[str, list[float]]
  baseline: str
  cpu: Mapping[str, list[float]] | None = None  # with `interleaved(cpu_time=True)`

  def cpu_time(self) -> "Timings":
    """The same runs by this process's CPU time (user + system, every thread):
    a second view, less moved by waiting for a core on a shared machine."""
    if self.cpu is None:
      raise ValueError("timed without cpu_time=True")
    return Timings(self.cpu, self.baseline)

  def median(self, name: str) -> float:
    return statistics.median(self.runs[name])

  def ratio(self, name: str) -> float:
    """Median over rounds of (variant time / baseline time) in that round."""
    base = self.runs[self.baseline]
    return statistics.median(t / b for t, b in zip(self.runs[name], base))

  def ratio_to(self, name: str, other: str) -> float:
    """`ratio` with `other` as the baseline."""
    return Timings(self.runs, other).ratio(name)

  def spread(self, name: str) -> tuple[float, float]:
    """The smallest and largest per-round ratio."""
    base = self.runs[self.baseline]
    ratios = [t / b for t, b in zip(self.runs[name], base)]
    return min(ratios), max(ratios)


def interleaved(variants: Mapping[str, Callable[[], Any]], *, baseline: str,
                rounds: int = 7, warmup: int = 1, prime: bool | int = False,
                burst: int = 1, cpu_time: bool = False, self_timed: bool = False) -> Timings:
  """Times each variant once per round, rotating the order each round.

  The baseline is also timed a second time under the name `CONTROL`, as an
  A/A control. Each callable must finish its work before returning (call
  `block_until_ready` on JAX results).

  Args:
    variants: name to a zero-argument callable.
    baseline: the name ratios are taken against.
    rounds: timed rounds.
    warmup: untimed rounds first (compilation, caches).
    prime: call each variant once (or this many times), untimed, right
      before timing it, so that it is timed as part of a run of consecutive
      calls (a training loop's steady state) and not charged for what the
      previous variant left behind (after a PyTorch step its OpenMP threads
      spin for a few ms on the same cores; after 0.1 s without work, XLA:CPU's
      next few calls run up to 1.6x slower on these machines).
    burst: consecutive calls timed per round; the round's time is their mean.
    cpu_time: also record each run's process CPU time (`Timings.cpu_time`).
    self_timed: each callable times its own steady part and returns its
      seconds (a training loop timed inside, after its first steps); what
      it returns is recorded instead of its wall time.
  """
  names = [*variants, CONTROL]
  fns = {**variants, CONTROL: variants[baseline]}
  runs: dict[str, list[float]] = {n: [] for n in names}
  cpu: dict[str, list[float]] = {n: [] for n in names}
  for r in range(warmup + rounds):
    for name in rotated(names, r):
      gc.collect()  # a collection triggered by an earlier variant is not charged to this one
      for _ in range(int(prime)):
        fns[name]()
      start_cpu = time.process_time() if cpu_time else 0.0
      start, own = time.perf_counter(), 0.0
      for _ in range(burst):
        seconds = fns[name]()
        own += seconds if self_timed else 0.0
      elapsed = (own if self_timed else time.perf_counter() - start) / burst
      if r >= warmup:
        runs[name].append(elapsed)
        if cpu_time:
          cpu[name].append((time.process_time() - start_cpu) / burst)
  return Timings(runs, baseline, cpu if cpu_time else None)
