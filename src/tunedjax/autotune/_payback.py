"""Whether tuning a bucket can pay for itself within a tuning horizon.

A tuning horizon is how many times the tuned program is expected to run
(`TuningSession.horizon`; the Trainer sets the steps of its fit). `Payback`
holds it with the bucket's sites and the session's cost correction, and
decides from the default kernel's measured compile and call whether tuning the
other candidates can pay back; `still_cannot_pay_back` re-checks a cached
"cannot pay back" decision against a new horizon; `validate_payback` checks
the record a decision leaves in a cache value (`TuneResult.payback`).

Costs belong to a platform (`for_platform`): the correction is what tuning
took on the platform the bucket is tuned for, in this session; until it has
measured that, a rule for the platform stands in (`UNMEASURED_COST_FACTOR`),
and the decision's reason says so. A CPU's measured costs never cost a GPU's
tuning.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from tunedjax._errors import AutotuneError
from tunedjax.autotune._report import CANNOT_PAY_BACK

# CANNOT_PAY_BACK: the reason a bucket kept its default without tuning (the
# report's `why`); `TuneResult.reason` starts with it.
__all__ = ["CANNOT_PAY_BACK", "MEASURED_SAMPLES", "Payback", "UNMEASURED_COST_FACTOR",
           "for_platform", "is_number", "still_cannot_pay_back", "validate_payback"]

# Each candidate's compile and timing are expected to cost the default's own
# compile and call times this factor, until this session has measured tuning
# on the platform (`MEASURED_SAMPLES` buckets; then the median of measured over
# estimated). On a CPU a candidate is an XLA program of the default's size, as
# cheap to compile. On a GPU or TPU a candidate may be a Pallas kernel that
# Triton or Mosaic compiles, and XLA autotunes the GEMMs and convolutions of
# every candidate as it compiles it, so each is presumed to cost twice the
# default's, which keeps a first call from tuning what may not pay back; the
# platform's own measurements replace the rule as soon as there are two.
UNMEASURED_COST_FACTOR = {"cpu": 1.0, "gpu": 2.0, "tpu": 2.0}
# Measured buckets a platform needs before its median replaces the rule.
MEASURED_SAMPLES = 2


def is_number(x: Any) -> bool:
  """A finite int or float (not a bool): what a cache value's numbers must be."""
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_PAYBACK_COUNTS = ("horizon", "sites")
_PAYBACK_SECONDS = ("default_s", "cost_s", "estimate_s", "decided_s")


def validate_payback(record: Any) -> None:
  """Checks a cache value's ``payback`` record (absent in entries written before it)."""
  if not isinstance(record, Mapping):
    raise TypeError(f"cache entry 'payback' must be a dict, got {type(record).__name__}.")
  if not record:
    return
  known = {*_PAYBACK_COUNTS, *_PAYBACK_SECONDS, "kept"}
  if set(record) != known:
    raise ValueError(f"cache entry 'payback' must have the fields {sorted(known)}, got "
                     f"{sorted(record)}.")
  for field in _PAYBACK_COUNTS:
    v = record[field]
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
      raise TypeError(f"cache entry payback[{field!r}] must be an int >= 1, got {v!r}.")
  for field in _PAYBACK_SECONDS:
    if not (is_number(record[field]) and record[field] >= 0):
      raise TypeError(f"cache entry payback[{field!r}] must be seconds >= 0, got "
                      f"{record[field]!r}.")
  if not isinstance(record["kept"], bool):
    raise TypeError(f"cache entry payback['kept'] must be a bool, got {record['kept']!r}.")


@dataclasses.dataclass(frozen=True)
class Payback:
  """Whether tuning a bucket can pay for itself within a tuning horizon.

  After the default kernel's first timed call (``default_s``), the most any
  candidate could save is ``default_s * sites * horizon`` (a kernel taking
  no time at all). Tuning the other candidates is expected to cost
  ``(default's compile + its call) * candidates * cost_factor``: the
  default's own costs stand for each candidate's compile and timing (or,
  where a prediction has them, each candidate's own compile time), and
  ``cost_factor`` corrects that with what past buckets of this session
  actually took (`TuningSession.tuning_cost_factor`). When the most saved
  is below the cost, the bucket keeps its default untuned.

  Attributes:
    horizon: how many times the program is expected to run (>= 1).
    sites: calls of the bucket per run of the program, as far as known when
      it is decided (>= 1).
    cost_factor: measured tuning cost over the estimate in this session (> 0).
    basis: where `cost_factor` comes from, for the decision's reason: empty
      when measured on this platform in this session, else the rule that
      stands in (`for_platform`).

  Example:
    >>> p = Payback(horizon=48)
    >>> p.most_saved(0.002)  # a 2 ms convolution, 48 steps
    0.096
    >>> round(p.expected_cost(compile_s=0.05, call_s=0.002, candidates=4), 3)
    0.208
    >>> p.pays(default_s=0.002, cost_s=0.208), Payback(horizon=1000).pays(0.002, 0.208)
    (False, True)
  """

  horizon: int
  sites: int = 1
  cost_factor: float = 1.0
  basis: str = ""

  def __post_init__(self):
    for field in ("horizon", "sites"):
      v = getattr(self, field)
      if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise AutotuneError(f"Payback.{field} must be an int >= 1, got {v!r}.")
    if not (is_number(self.cost_factor) and self.cost_factor > 0):
      raise AutotuneError(f"Payback.cost_factor must be a number > 0, got "
                          f"{self.cost_factor!r}.")

  def most_saved(self, default_s: float) -> float:
    """Seconds the best possible kernel could save within the horizon."""
    return default_s * self.sites * self.horizon

  def expected_cost(self, *, compile_s: float, call_s: float, candidates: int,
                    compile_each: Sequence[float] | None = None) -> float:
    """Seconds compiling and timing `candidates` more kernels is expected to take.

    Each is expected to compile for `compile_s` (the default's compile) and
    be called for `call_s`; with `compile_each` (each candidate's own
    compile time, as predicted from what compiling it took before) those
    compiles stand instead.

    Example:
      >>> p = Payback(horizon=48)
      >>> round(p.expected_cost(compile_s=0.5, call_s=0.01, candidates=2,
      ...                       compile_each=[0.02, 2.0]), 3)
      2.04
    """
    compiles = compile_s * candidates if compile_each is None else float(sum(compile_each))
    return (compiles + call_s * candidates) * self.cost_factor

  def pays(self, default_s: float, cost_s: float) -> bool:
    """Whether tuning costing `cost_s` can pay back against a default taking `default_s`."""
    return self.most_saved(default_s) >= cost_s


def for_platform(session: Any, platform: str, *, horizon: int, sites: int = 1) -> Payback:
  """The `Payback` of a bucket tuned for `platform`, costed by that platform's numbers.

  The cost factor is the median of what tuning took over its estimate on
  `platform` in this session (`TuningSession.tuning_costs`), once it has
  `MEASURED_SAMPLES`; before that `UNMEASURED_COST_FACTOR`'s rule for the
  platform stands in (the largest of them for a platform it does not name),
  and `Payback.basis` names it. Another platform's measurements are never used.

  Example:
    >>> from tunedjax._tuning import TuningSession
    >>> s = TuningSession()
    >>> for est, took in ((1.0, 0.5), (1.0, 0.7)):
    ...   s.record_tuning_cost(est, took, platform="cpu")
    >>> cpu, gpu = (for_platform(s, p, horizon=10) for p in ("cpu", "gpu"))
    >>> cpu.cost_factor, cpu.basis
    (0.6, '')
    >>> gpu.cost_factor, gpu.basis
    (2.0, "nothing tuned on gpu yet: each candidate costed as 2x the default's compile and call (gpu's rule)")
  """
  measured = session.tuning_costs(platform)
  if len(measured) >= MEASURED_SAMPLES:
    return Payback(horizon=horizon, sites=sites,
                   cost_factor=float(statistics.median(measured)))
  factor = UNMEASURED_COST_FACTOR.get(platform, max(UNMEASURED_COST_FACTOR.values()))
  return Payback(horizon=horizon, sites=sites, cost_factor=factor, basis=(
      f"nothing tuned on {platform} yet: each candidate costed as {factor:g}x the "
      f"default's compile and call ({platform}'s rule)"))


def still_cannot_pay_back(value: Mapping[str, Any], *, horizon: int | None,
                          sites: int = 1) -> bool:
  """Whether a cached "cannot pay back" decision holds for this horizon and site count.

  It holds when the new horizon is bounded and the bucket's default, as
  measured then, still could not save what tuning was expected to cost:
  an equal or shorter horizon reuses the decision at no cost; a longer one
  (or None, unbounded) may tune the bucket after all. False for a value
  that is not such a decision.

  Example:
    >>> value = {"winner": "xla", "payback": {"horizon": 48, "sites": 1, "default_s": 0.002,
    ...          "cost_s": 0.2, "estimate_s": 0.2, "decided_s": 0.06, "kept": True}}
    >>> [still_cannot_pay_back(value, horizon=h) for h in (1, 48, 99, 1000, None)]
    [True, True, True, False, False]
  """
  record = value.get("payback") or {}
  if not record.get("kept") or horizon is None:
    return False
  return not Payback(horizon=horizon, sites=max(1, int(sites))).pays(
      record["default_s"], record["cost_s"])
