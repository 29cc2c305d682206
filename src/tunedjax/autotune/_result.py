"""The record of one bucket's tuning: `TuneResult`, the value the cache keeps, and its check.

A cache file can be old, hand-edited or written by another version, so every
value is checked (`validate_value`) before it can select a kernel: the
winner must name a registered kernel and every field must have its type.

Example:
  >>> r = TuneResult(winner="xla", reason="only xla applies")
  >>> validate_value(r.to_value(), "conv", known={"xla"})
  >>> TuneResult.from_value(r.to_value()) == r
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tunedjax.autotune._payback import is_number, validate_payback


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """What tuning one bucket measured and chose (stored as the cache value).

  Attributes:
    winner: the chosen kernel's name (``"xla"`` unless another beat it).
    reason: one line saying why.
    timings: seconds per timed call, ``{name: [round 0, round 1, ...]}``.
    ratios: median over rounds of each candidate's time / ``xla``'s time.
    errors: ``{name: "ExceptionType: message"}`` of candidates that failed.
    rejected: ``{name: relative error}`` of candidates that gave wrong results.
    skipped: candidates not tried because the time budget ran out.
    measured_at: when, as an ISO 8601 UTC timestamp.
    tuning_s: seconds the tuning took.
    temp_bytes: ``{name: bytes}``: the temporaries each compiled candidate
      needs (XLA's `memory_analysis`), where the backend reports them.
    payback: with a tuning horizon, the numbers the decision to tune was
      made from (`Payback.record`): ``horizon``, ``sites``, ``default_s``
      (the default's first call), ``cost_s`` (what tuning the others was
      expected to cost), ``estimate_s`` (that estimate before the session's
      correction), ``decided_s`` (seconds before the decision), and
      ``kept`` (True: the default was kept untuned). Empty without a horizon.
    compile_s: ``{name: seconds}`` compiling each candidate took (side by
      side in threads, so each includes its share of a loaded machine).
    predicted: ``{name: time ratio to the default}`` predicted before
      anything was compiled (the default's 1.0 included); empty when the
      bucket was tuned without a prediction.
    pruned: ``{name: reason}`` of the candidates the prediction ruled out:
      never compiled or timed.
    error_ratios: ``{name: ratio}`` of each candidate checked against the
      bucket's high-precision reference (`autotune._accuracy`): its error
      over the default's; above `ERROR_RATIO_LIMIT` (3) it was rejected.
      Empty when nothing was checked, where there was no higher precision
      (float64 buckets), and in entries written before the rule.

  Example:
    >>> r = TuneResult(winner="xla", reason="only xla applies")
    >>> TuneResult.from_value(r.to_value()) == r
    True
  """

  winner: str
  reason: str
  timings: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)
  ratios: Mapping[str, float] = dataclasses.field(default_factory=dict)
  errors: Mapping[str, str] = dataclasses.field(default_factory=dict)
  rejected: Mapping[str, float] = dataclasses.field(default_factory=dict)
  skipped: Sequence[str] = ()
  measured_at: str = ""
  tuning_s: float = 0.0
  temp_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  payback: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  compile_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
  predicted: Mapping[str, float] = dataclasses.field(default_factory=dict)
  pruned: Mapping[str, str] = dataclasses.field(default_factory=dict)
  error_ratios: Mapping[str, float] = dataclasses.field(default_factory=dict)

  @property
  def kept(self) -> bool:
    """Whether the default was kept untuned because tuning could not pay back."""
    return bool(self.payback.get("kept", False))

  @property
  def decided(self) -> str:
    """How the bucket was decided: ``"kept"`` (tuning could not pay back),
    ``"predicted"`` (only the candidates that could win were compiled) or
    ``"timed"`` (every candidate)."""
    return decided(self.to_value())

  @property
  def regret(self) -> float | None:
    """The predicted winner's measured time over the best measured time (1.0:
    the prediction was right), where both are known; else None."""
    return regret(self.to_value())

  def to_value(self) -> dict[str, Any]:
    """The JSON dict stored in the cache (``payback`` only when there is one)."""
    extra = {"payback": dict(self.payback)} if self.payback else {}
    if self.compile_s:
      extra["compile_s"] = {k: float(v) for k, v in self.compile_s.items()}
    if self.predicted:
      extra["predicted"] = {k: float(v) for k, v in self.predicted.items()}
    if self.pruned:
      extra["pruned"] = dict(self.pruned)
    if self.error_ratios:
      extra["error_ratios"] = {k: float(v) for k, v in self.error_ratios.items()}
    return {
        "winner": self.winner,
        "reason": self.reason,
        "timings": {k: [float(t) for t in v] for k, v in self.timings.items()},
        "ratios": {k: float(v) for k, v in self.ratios.items()},
        "errors": dict(self.errors),
        "rejected": {k: float(v) for k, v in self.rejected.items()},
        "skipped": list(self.skipped),
        "measured_at": self.measured_at,
        "tuning_s": float(self.tuning_s),
        "temp_bytes": {k: int(v) for k, v in self.temp_bytes.items()},
        **extra,
    }

  @classmethod
  def from_value(cls, value: Mapping[str, Any]) -> TuneResult:
    """Reads a cache value back (call `validate_value` first)."""
    return cls(
        winner=value["winner"], reason=value.get("reason", ""),
        timings={k: tuple(v) for k, v in value.get("timings", {}).items()},
        ratios=dict(value.get("ratios", {})), errors=dict(value.get("errors", {})),
        rejected=dict(value.get("rejected", {})), skipped=tuple(value.get("skipped", ())),
        measured_at=value.get("measured_at", ""), tuning_s=float(value.get("tuning_s", 0.0)),
        temp_bytes={k: int(v) for k, v in value.get("temp_bytes", {}).items()},
        payback=dict(value.get("payback", {})),
        compile_s=dict(value.get("compile_s", {})), predicted=dict(value.get("predicted", {})),
        pruned=dict(value.get("pruned", {})),
        error_ratios=dict(value.get("error_ratios", {})))

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, TuneResult):
      return NotImplemented
    return self.to_value() == other.to_value()

  def __hash__(self) -> int:
    return hash((self.winner, self.measured_at, self.tuning_s))


def validate_value(value: Any, op: str, known: Collection[str]) -> None:
  """Checks a cache value of op family `op` before it is used; raises on a bad one.

  The winner must name a registered kernel and every field must have its
  type, so a tampered or stale file can never select unknown code.

  Args:
    value: the cache value.
    op: the op family (for messages).
    known: the family's registered kernel names.

  Raises:
    ValueError, TypeError: what is wrong with the value.

  Example:
    >>> validate_value({"winner": "no_such_kernel", "timings": {}}, "conv", {"xla"})
    Traceback (most recent call last):
    ...
    ValueError: cache entry names unknown conv kernel 'no_such_kernel'...
  """
  if not isinstance(value, Mapping):
    raise TypeError(f"a {op} cache value must be a dict, got {type(value).__name__}.")
  winner = value.get("winner")
  if not isinstance(winner, str):
    raise TypeError(f"cache entry 'winner' must be a string, got {winner!r}.")
  if winner not in known:
    raise ValueError(f"cache entry names unknown {op} kernel {winner!r}; known: "
                     f"{sorted(known)}.")
  for field, check, what in (
      ("timings", lambda v: isinstance(v, list) and all(is_number(t) and t >= 0 for t in v),
       "a list of seconds"),
      ("ratios", lambda v: is_number(v) and v >= 0, "a number"),
      ("errors", lambda v: isinstance(v, str), "a string"),
      ("rejected", is_number, "a number"),
      ("temp_bytes", lambda v: is_number(v) and v >= 0, "a number of bytes"),
      ("compile_s", lambda v: is_number(v) and v >= 0, "seconds >= 0"),
      ("predicted", lambda v: is_number(v) and v > 0, "a time ratio > 0"),
      ("pruned", lambda v: isinstance(v, str), "a reason string"),
      ("error_ratios", lambda v: is_number(v) and v >= 0, "an error ratio >= 0"),
  ):
    sub = value.get(field, {})
    if not isinstance(sub, Mapping):
      raise TypeError(f"cache entry {field!r} must be a dict, got {type(sub).__name__}.")
    for k, v in sub.items():
      if not isinstance(k, str) or not check(v):
        raise TypeError(f"cache entry {field}[{k!r}] must be {what}, got {v!r}.")
  skipped = value.get("skipped", [])
  if not (isinstance(skipped, list) and all(isinstance(s, str) for s in skipped)):
    raise TypeError(f"cache entry 'skipped' must be a list of names, got {skipped!r}.")
  if not isinstance(value.get("measured_at", ""), str):
    raise TypeError("cache entry 'measured_at' must be an ISO timestamp string.")
  tuning_s = value.get("tuning_s", 0.0)
  if not (is_number(tuning_s) and tuning_s >= 0):
    raise TypeError(f"cache entry 'tuning_s' must be a number >= 0, got {tuning_s!r}.")
  if not isinstance(value.get("reason", ""), str):
    raise TypeError("cache entry 'reason' must be a string.")
  validate_payback(value.get("payback", {}))


def decided(value: Mapping[str, Any]) -> str:
  """``"kept"``, ``"predicted"`` or ``"timed"``: how a cached bucket was decided
  (`TuneResult.decided`).

  Example:
    >>> decided({"winner": "xla"}), decided({"winner": "fft", "pruned": {"im2col": "..."}})
    ('timed', 'predicted')
  """
  if (value.get("payback") or {}).get("kept"):
    return "kept"
  return "predicted" if value.get("pruned") else "timed"


def predicted_winner(value: Mapping[str, Any]) -> str | None:
  """The candidate a cached bucket's prediction ranked fastest, or None without one."""
  predicted = value.get("predicted") or {}
  return min(predicted, key=lambda n: (predicted[n], n)) if predicted else None


def regret(value: Mapping[str, Any]) -> float | None:
  """The predicted winner's measured time over the best measured time.

  From the cached ratios (each timed candidate's time over the default's,
  the default's own 1.0 among them); None when the bucket had no
  prediction, or its predicted winner was not timed.

  Example:
    >>> regret({"winner": "b", "predicted": {"xla": 1.0, "a": 0.2, "b": 0.3},
    ...         "ratios": {"xla": 1.0, "a": 0.25, "b": 0.2}})
    1.25
  """
  best = predicted_winner(value)
  ratios = {str(k): float(v) for k, v in (value.get("ratios") or {}).items()}
  if best is None or best not in ratios or min(ratios.values()) <= 0:
    return None
  return ratios[best] / min(ratios.values())
