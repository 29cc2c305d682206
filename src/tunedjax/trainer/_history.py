"""`History`: what `Trainer.fit` returns, per step, per epoch and per eval."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from tunedjax.trainer import _history_plot

FORMAT_VERSION = 1

# Per-step lists: one entry per recorded step, all of the same length.
_PER_STEP = ("losses", "step_times", "steps", "samples", "metrics", "learning_rates")
_FIELDS = ("losses", "step_times", "steps", "samples", "metrics", "learning_rates", "skipped",
           "epochs", "evals", "tuning")


def _same(a: Any, b: Any) -> bool:
  """Equality of JSON-like trees in which nan equals nan."""
  if isinstance(a, float) and isinstance(b, float):
    return a == b or (math.isnan(a) and math.isnan(b))
  if isinstance(a, Mapping) and isinstance(b, Mapping):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  return a == b


def _finite_mean(values: list[float]) -> float:
  finite = [v for v in values if math.isfinite(v)]
  return math.fsum(finite) / len(finite) if finite else math.nan


def _floats(values: Mapping[str, Any] | None) -> dict[str, float]:
  return {str(k): float(v) for k, v in (values or {}).items()}


def _rate(count: float, seconds: float) -> float:
  return count / seconds if seconds > 0 else math.nan


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


@dataclasses.dataclass(eq=False)
class History:
  """The record of a training run: losses, step times, epochs, evals, tuning.

  `Trainer.fit` returns one. The per-step lists (`losses`, `step_times`,
  `steps`, `samples`, `metrics`) have one entry per step, in step order;
  `steps` holds global step indices, so a resumed run's history starts where
  the checkpoint left off, and `extend` joins it after the first run's.
  `to_dict` / `from_dict` and `save_json` / `load_json` round-trip it (nan
  and inf losses included: they are written as JSON's ``NaN`` / ``Infinity``,
  which Python's `json` reads back). Two histories compare equal when all
  their fields do, with nan equal to nan.

  Attributes:
    losses: training loss per step; a skipped (non-finite) step keeps its
      loss, which may be nan or inf.
    step_times: seconds per step (k equal shares when k steps ran in one call).
    steps: the global step index of each entry in `losses`.
    samples: batch size of each step.
    metrics: per-step extra metrics of the loss function (may be empty dicts).
    learning_rates: the learning rate each step's update used, nan where it is
      not known (see the Trainer's `schedule` option and docs/callbacks.md).
    skipped: global step indices whose update was skipped (non-finite
      gradients under loss scaling).
    epochs: one summary dict per finished epoch (see `end_epoch`).
    evals: evaluation results, each ``{"step": ..., "loss": ..., <metric>: ...}``.
    tuning: what each tuner chose (JSON-able; filled by the trainer).

  Example:
    >>> h = History()
    >>> for step, loss in enumerate([1.0, 0.5, 0.25]):
    ...   h.record_step(step, loss, 0.5, samples=32)
    >>> h.end_epoch(0, seconds=1.5)["loss"]
    0.5833333333333334
    >>> h
    History(steps=3, epochs=1, last_loss=0.25, skipped=0)
    >>> h.throughput()  # 64 samples in 1 s: the first step is left out
    64.0
    >>> History.from_dict(h.to_dict()) == h
    True
  """

  losses: list[float] = dataclasses.field(default_factory=list)
  step_times: list[float] = dataclasses.field(default_factory=list)
  steps: list[int] = dataclasses.field(default_factory=list)
  skipped: list[int] = dataclasses.field(default_factory=list)
  metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
  epochs: list[dict[str, float]] = dataclasses.field(default_factory=list)
  evals: list[dict[str, float]] = dataclasses.field(default_factory=list)
  tuning: dict[str, Any] = dataclasses.field(default_factory=dict)
  samples: list[int] = dataclasses.field(default_factory=list)
  learning_rates: list[float] = dataclasses.field(default_factory=list)
  # Index into the per-step lists where the epoch in progress began.
  _epoch_start: int = dataclasses.field(default=0, init=False, repr=False)

  # --- recording -------------------------------------------------------------

  @property
  def skipped_steps(self) -> int:
    """How many steps had their update skipped."""
    return len(self.skipped)

  def record_step(self, step: int, loss: float, seconds: float, *, samples: int,
                  metrics: Mapping[str, float] | None = None,
                  skipped: bool = False, learning_rate: float | None = None) -> None:
    """Appends one training step.

    Args:
      step: the global step index; must be above the last one recorded.
      loss: the step's training loss (a JAX or NumPy scalar is converted).
      seconds: the step's wall time in seconds.
      samples: the step's batch size.
      metrics: the loss function's extra metrics for this step.
      skipped: True when the update was skipped (non-finite gradients).
      learning_rate: the learning rate of the step's update (None: unknown).

    Raises:
      ValueError: `step` does not follow the last recorded step, or
        `seconds` / `samples` is negative.
    """
    step = int(step)
    if self.steps and step <= self.steps[-1]:
      raise ValueError(f"History.record_step: step {step} does not follow the last "
                       f"recorded step {self.steps[-1]}; steps must increase.")
    if seconds < 0 or samples < 0:
      raise ValueError(f"History.record_step: seconds and samples must be >= 0, got "
                       f"seconds={seconds!r}, samples={samples!r}.")
    self.steps.append(step)
    self.losses.append(float(loss))
    self.step_times.append(float(seconds))
    self.samples.append(int(samples))
    self.metrics.append(_floats(metrics))
    self.learning_rates.append(math.nan if learning_rate is None else float(learning_rate))
    if skipped:
      self.skipped.append(step)

  def end_epoch(self, epoch: int, seconds: float, *,
                extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """Summarises the steps recorded since the last `end_epoch` into `epochs`.

    The summary holds ``"epoch"``, ``"loss"`` (the mean over the epoch's
    finite losses; nan if none was finite), each metric's mean (finite values
    only; a metric named like one of the other keys is left out),
    ``"seconds"``, ``"steps_per_s"`` and ``"samples_per_s"`` (nan when
    `seconds` is 0), ``"learning_rate"`` (the epoch's last step's, when
    known), then `extra` (e.g. the trainer's ``"eval_loss"``).

    Args:
      epoch: the epoch's number.
      seconds: the epoch's wall time in seconds.
      extra: more entries to store in the summary.

    Returns:
      The summary dict (also appended to `epochs`).
    """
    lo = self._epoch_start
    metric_values: dict[str, list[float]] = {}
    for m in self.metrics[lo:]:
      for name, value in m.items():
        metric_values.setdefault(name, []).append(value)
    timing = {
        "seconds": float(seconds),
        "steps_per_s": _rate(len(self.losses) - lo, seconds),
        "samples_per_s": _rate(sum(self.samples[lo:]), seconds),
    }
    summary: dict[str, Any] = {"epoch": int(epoch), "loss": _finite_mean(self.losses[lo:])}
    for name, values in metric_values.items():
      if name not in summary and name not in timing:
        summary[name] = _finite_mean(values)
    summary.update(timing)
    last_rate = self.learning_rates[-1] if len(self.learning_rates) > lo else math.nan
    if not math.isnan(last_rate):
      summary.setdefault("learning_rate", last_rate)
    summary.update(_floats(extra))
    self.epochs.append(summary)
    self._epoch_start = len(self.losses)
    return summary

  def record_eval(self, step: int, results: Mapping[str, float]) -> None:
    """Appends an evaluation's results (``"loss"`` and metrics) at `step`."""
    self.evals.append({**_floats(results), "step": int(step)})

  def extend(self, other: History) -> None:
    """Appends a resumed run's history after this one, in place.

    Every list is concatenated; `tuning` is updated with `other`'s entries
    (the later run's choices win). An epoch that `other` has not ended yet
    stays open here; steps of an epoch this history left open are not
    summarised again.

    Raises:
      ValueError: `other`'s first step is not after this history's last one.
    """
    if self.steps and other.steps and other.steps[0] <= self.steps[-1]:
      raise ValueError(
          f"History.extend: the other history starts at step {other.steps[0]}, which "
          f"does not follow this history's last step {self.steps[-1]}; extend with "
          "the run resumed after this one.")
    offset = len(self.losses)
    for name in _FIELDS:
      if name != "tuning":
        getattr(self, name).extend(copy.deepcopy(getattr(other, name)))
    self.tuning.update(copy.deepcopy(other.tuning))
    self._epoch_start = offset + other._epoch_start

  # --- reading ---------------------------------------------------------------

  def throughput(self, last: int | None = None) -> float:
    """Samples per second over the last `last` steps (all when None).

    The history's very first step is left out when there is more than one
    step: it includes compiling the training step. (After `extend`, the
    resumed run's first step is counted.) Returns 0.0 when there is nothing
    to measure (no steps, or no time).

    Args:
      last: how many of the latest steps to measure, >= 1.
    """
    if last is not None and (not isinstance(last, int) or last < 1):
      raise ValueError(f"History.throughput(last=...) must be an int >= 1 or None, "
                       f"got {last!r}.")
    n = len(self.step_times)
    lo = 1 if n > 1 else 0
    if last is not None:
      lo = max(lo, n - last)
    seconds = math.fsum(self.step_times[lo:])
    return sum(self.samples[lo:]) / seconds if seconds > 0 else 0.0

  def _mean_step_time(self) -> float:
    times = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
    return math.fsum(times) / len(times) if times else math.nan

  def __repr__(self) -> str:
    last = _fmt(self.losses[-1]) if self.losses else None
    return (f"History(steps={len(self.losses)}, epochs={len(self.epochs)}, "
            f"last_loss={last}, skipped={self.skipped_steps})")

  def summary(self) -> str:
    """A few lines for a human: steps, final loss, speed, skips, epochs.

    Example:
      >>> h = History()
      >>> h.record_step(0, 2.0, 1.0, samples=8)
      >>> h.record_step(1, 1.0, 0.01, samples=8)
      >>> print(h.summary())
      steps         2 (0..1)
      final loss    1 (step 1)
      step time     10 ms mean, first step left out (1000 ms, with compilation)
      throughput    800 samples/s
      skipped       0 updates
    """
    if not self.losses:
      return "steps         0"
    lines = [
        f"steps         {len(self.losses)} ({self.steps[0]}..{self.steps[-1]})",
        f"final loss    {_fmt(self.losses[-1])} (step {self.steps[-1]})",
    ]
    mean_ms = self._mean_step_time() * 1e3
    if len(self.step_times) > 1:
      lines.append(f"step time     {mean_ms:.4g} ms mean, first step left out "
                   f"({self.step_times[0] * 1e3:.4g} ms, with compilation)")
    else:
      lines.append(f"step time     {mean_ms:.4g} ms")
    lines.append(f"throughput    {self.throughput():.4g} samples/s")
    skipped = f"skipped       {self.skipped_steps} updates"
    if self.skipped:
      shown = ", ".join(str(s) for s in self.skipped[:8])
      skipped += f" (steps {shown}{', ...' if len(self.skipped) > 8 else ''})"
    lines.append(skipped)
    if self.evals and "loss" in self.evals[-1]:
      lines.append(f"last eval     loss {_fmt(self.evals[-1]['loss'])} "
                   f"(step {self.evals[-1]['step']})")
    if self.epochs:
      columns: list[str] = []
      for e in self.epochs:
        columns.extend(k for k in e if k not in columns)
      rows = [columns] + [[_fmt(e.get(c, "")) for c in columns] for e in self.epochs]
      widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
      lines.append("")
      lines.extend("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)
    return "\n".join(lines)

  # --- equality and serialisation --------------------------------------------

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, History):
      return NotImplemented
    return _same(self.to_dict(), other.to_dict())

  __hash__ = None  # type: ignore[assignment]  # mutable

  def to_dict(self) -> dict[str, Any]:
    """A JSON-able dict (plain `json.dumps` writes it; nan as ``NaN``)."""
    d: dict[str, Any] = {"version": FORMAT_VERSION}
    for name in _FIELDS:
      d[name] = copy.deepcopy(getattr(self, name))
    d["epoch_start"] = self._epoch_start
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> History:
    """The `History` that `to_dict` wrote.

    Raises:
      ValueError: an unknown version or key, or per-step lists of different
        lengths.
    """
    version = d.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
      raise ValueError(f"History.from_dict: format version {version!r} is not "
                       f"supported (this tunedjax reads version {FORMAT_VERSION}).")
    unknown = sorted(set(d) - set(_FIELDS) - {"version", "epoch_start"})
    if unknown:
      raise ValueError(f"History.from_dict: unknown keys {unknown}; expected some of "
                       f"{list(_FIELDS)}.")
    d = dict(d)
    if "learning_rates" not in d:  # written before learning rates were recorded
      d["learning_rates"] = [math.nan] * len(d.get("losses", ()))
    lengths = {name: len(d.get(name, ())) for name in _PER_STEP}
    if len(set(lengths.values())) > 1:
      raise ValueError(f"History.from_dict: the per-step lists must have one entry per "
                       f"step, got lengths {lengths}.")
    h = cls(**{name: copy.deepcopy(d[name]) for name in _FIELDS if name in d})
    h.losses = [float(v) for v in h.losses]
    h.step_times = [float(v) for v in h.step_times]
    h.learning_rates = [float(v) for v in h.learning_rates]
    h.metrics = [dict(m) for m in h.metrics]
    h._epoch_start = int(d.get("epoch_start", len(h.losses)))
    return h

  def save_json(self, path: str | os.PathLike[str]) -> None:
    """Writes `to_dict` as JSON to `path`, atomically (temp file + rename)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(self.to_dict(), f, indent=1)
      os.replace(tmp, path)
    except BaseException:
      if os.path.exists(tmp):
        os.unlink(tmp)
      raise

  @classmethod
  def load_json(cls, path: str | os.PathLike[str]) -> History:
    """Reads a history that `save_json` wrote."""
    with open(path, encoding="utf-8") as f:
      return cls.from_dict(json.load(f))

  # --- plotting --------------------------------------------------------------

  def plot(self, *, ax: Any = None, smoothing: int = 1) -> Any:
    """Draws the loss and step-time curves; returns the matplotlib Figure.

    Without `ax`: a new figure with two panels, (left) the training loss per
    step (raw, faint when smoothed, with its `smoothing`-step moving average
    over finite losses), eval losses as points and skipped updates marked
    along the bottom; (right) the step time in milliseconds (the first step,
    which compiles, is clipped with its time written in the panel when it
    dwarfs the rest). With `ax`: only the loss panel, drawn on `ax`.
    Nothing is shown (no ``plt.show()``): a notebook displays the returned
    figure; a script calls ``fig.savefig(...)``. The figure is not
    registered with pyplot, so it works under any backend, Agg included.

    Args:
      ax: a matplotlib Axes to draw the loss panel on.
      smoothing: the moving average's window in steps, >= 1 (1: no average).

    Returns:
      The `matplotlib.figure.Figure` drawn on.

    Raises:
      ImportError: matplotlib is not installed.
    """
    return _history_plot.plot(self, ax=ax, smoothing=smoothing)

