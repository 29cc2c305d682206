"""`Monitor`: one logged quantity watched for improvement (early stopping, best
checkpoints).

Example:
  >>> m = Monitor("eval_loss", mode="min", min_delta=0.1, owner="EarlyStopping")
  >>> [m.update(v) for v in (1.0, 0.95, 0.8, float("nan"))]
  [True, False, True, False]
  >>> m.best
  0.8
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from tunedjax._errors import format_choices, show_value
from tunedjax.trainer._model import TrainerError

MODES = ("min", "max")


class Monitor:
  """The best value of one entry of the epoch logs so far.

  Args:
    name: the entry of `History.epochs` (``"loss"``, a metric, ``"eval_loss"``,
      ``"eval_<metric>"``, ``"learning_rate"``, ...).
    mode: "min" (lower is better) or "max".
    min_delta: how much a value must beat the best by to count as better.
    owner: the callback's name, for error messages.
  """

  def __init__(self, name: Any, *, mode: Any, min_delta: Any = 0.0, owner: str):
    if not isinstance(name, str) or not name:
      raise TrainerError(f"{owner} monitor must be the name of a logged quantity (e.g. "
                         f"'eval_loss', 'loss'), got {show_value(name)}.")
    if not isinstance(mode, str) or mode not in MODES:
      raise TrainerError(f"{owner} mode must be {format_choices(MODES)}, got "
                         f"{show_value(mode)}.")
    if (not isinstance(min_delta, numbers.Real) or isinstance(min_delta, bool)
        or not 0 <= min_delta < math.inf):
      raise TrainerError(f"{owner} min_delta must be a finite number >= 0, got "
                         f"{show_value(min_delta)}.")
    self.name, self.mode, self.min_delta, self.owner = name, mode, float(min_delta), owner
    self.best = math.nan

  def reset(self) -> None:
    self.best = math.nan

  def value(self, logs: Mapping[str, Any], where: str) -> float:
    """The monitored entry of `logs`, or a TrainerError listing the entries there."""
    if self.name not in logs:
      hint = (" (eval_* entries need fit(eval_data=...) without eval_every: the epoch "
              "logs hold the evaluation made at each epoch's end)"
              if self.name.startswith("eval_") else "")
      raise TrainerError(f"{self.owner}: monitor {self.name!r} is not in the {where}; "
                         f"it has {format_choices(sorted(logs))}{hint}.")
    return float(logs[self.name])

  def update(self, value: float) -> bool:
    """Whether `value` beats the best by more than `min_delta` (then it is the best)."""
    if math.isnan(value):
      return False
    if math.isnan(self.best):
      better = True
    elif self.mode == "min":
      better = value < self.best - self.min_delta
    else:
      better = value > self.best + self.min_delta
    if better:
      self.best = value
    return better
