"""What kernel selection chose in one trace, as a typed report.

Example:
  >>> r = KernelReport((KernelChoice("conv", "depthwise", "hit", 2),
  ...                   KernelChoice("conv", "xla", "observe", 1)), tuning_s=0.0)
  >>> r.hits, r.misses, r.observed, dict(r.counts())
  (2, 0, True, {'conv depthwise (hit)': 2, 'conv xla (observe)': 1})
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Mapping

# Why a site got its kernel.
HINT, ONLY_DEFAULT, OBSERVE, HIT, TUNED, MISS, NOT_APPLICABLE, RECEIVED, FAILED = (
    "hint", "only xla", "observe", "hit", "tuned", "miss", "not applicable", "received",
    "failed at trace")
REASONS = (HINT, ONLY_DEFAULT, OBSERVE, HIT, TUNED, MISS, NOT_APPLICABLE, RECEIVED, FAILED)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """How many sites of one op family got one kernel, for one reason.

  Attributes:
    op: the op family (``"conv"``, ``"attention"``).
    kernel: the kernel that runs.
    why: ``"hint"``, ``"only xla"`` (nothing else applies), ``"observe"``,
      ``"hit"`` (from the cache), ``"tuned"``, ``"miss"`` (apply phase: the
      default), ``"not applicable"``, ``"received"`` (from process 0), or
      ``"failed at trace"`` (the chosen kernel raised; the default runs).
    count: how many sites.
  """

  op: str
  kernel: str
  why: str
  count: int = 1

  def __str__(self) -> str:
    return f"{self.op} {self.kernel} ({self.why})"


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """The kernel-selection pass's report for one trace.

  Attributes:
    choices: one `KernelChoice` per (op, kernel, why), in first-seen order.
    tuning_s: seconds spent tuning buckets during this trace.
  """

  choices: tuple[KernelChoice, ...] = ()
  tuning_s: float = 0.0
  name = "kernel_selection"

  def _count(self, *whys: str) -> int:
    return sum(c.count for c in self.choices if c.why in whys)

  @property
  def hits(self) -> int:
    """Sites whose bucket was found in the cache."""
    return self._count(HIT)

  @property
  def misses(self) -> int:
    """Sites whose bucket was not in the cache (tuned now, or the default when applying)."""
    return self._count(TUNED, MISS)

  @property
  def tuned(self) -> int:
    """Sites whose bucket was tuned during this trace."""
    return self._count(TUNED)

  @property
  def observed(self) -> bool:
    """Whether this trace ran in the observe phase (every site on its default)."""
    return any(c.why == OBSERVE for c in self.choices)

  def ops(self) -> tuple[str, ...]:
    """The op families with sites in this trace."""
    return tuple(dict.fromkeys(c.op for c in self.choices))

  def of(self, op: str) -> tuple[KernelChoice, ...]:
    """The choices of one op family."""
    return tuple(c for c in self.choices if c.op == op)

  def counts(self) -> Mapping[str, int]:
    """``{"<op> <kernel> (<why>)": count}``, for display."""
    return {str(c): c.count for c in self.choices}

  def __str__(self) -> str:
    parts = ", ".join(f"{c}: {c.count}" for c in self.choices) or "no kernel sites"
    return f"{parts}; cache hits {self.hits}, misses {self.misses}, tuning {self.tuning_s:.1f} s"


class Tally:
  """Collects `KernelChoice` counts while one program is traced (thread-safe)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
    self._tuning_s = 0.0

  def add(self, op: str, kernel: str, why: str) -> None:
    """Counts one site of `op` that runs `kernel` because of `why`."""
    with self._lock:
      self._counts[(op, kernel, why)] += 1

  def add_tuning(self, seconds: float) -> None:
    """Adds seconds spent tuning a bucket."""
    with self._lock:
      self._tuning_s += float(seconds)

  def report(self) -> KernelReport:
    with self._lock:
      return KernelReport(tuple(KernelChoice(op, k, why, n)
                                for (op, k, why), n in self._counts.items()),
                          tuning_s=self._tuning_s)
