"""What the logging callbacks write: one row per step, per epoch, per evaluation.

The loggers (TensorBoard, CSV, JSON lines) write the same figures under the
same names, built here from the callback's `logs` and the trainer's `History`,
which has recorded the step (or epoch) just before the callback is called.

Example:
  >>> from tunedjax.trainer import History
  >>> class T:  # what a row needs of a Trainer
  ...   history = History()
  >>> T.history.record_step(0, 0.5, 0.002, samples=32, learning_rate=0.1)
  >>> row = step_row(T, 0, {"loss": 0.5, "skipped": False, "learning_rate": 0.1})
  >>> list(row)
  ['step', 'loss', 'learning_rate', 'skipped', 'skipped_steps', 'step_time', 'samples_per_s']
  >>> row["samples_per_s"]  # 32 samples in 2 ms
  16000.0
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax

from tunedjax._errors import is_int, show_value
from tunedjax.trainer._model import TrainerError


def is_writer() -> bool:
  """Whether this process writes logs: process 0 of a `jax.distributed` job."""
  return jax.process_index() == 0


def check_path(what: str, value: Any) -> str:
  """A file or folder path option as a str, or a TrainerError naming it."""
  if (not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)).strip()
      or "\x00" in str(os.fspath(value))):
    raise TrainerError(f"{what} must be a path (str or os.PathLike), got {value!r}.")
  return str(os.fspath(value))


def check_every(name: str, value: Any) -> int:
  """A positive int option, or a TrainerError naming it."""
  if is_int(value) and value >= 1:
    return int(value)
  raise TrainerError(f"{name} must be an int >= 1, got {show_value(value)}.")


def _number(value: Any) -> float:
  return float(value)


def step_row(trainer: Any, step: int, logs: Mapping[str, Any]) -> dict[str, float]:
  """``step``, the loss, the metrics, the learning rate, skips, time and throughput."""
  history = trainer.history
  row: dict[str, Any] = {"step": int(step)}
  for name, value in logs.items():
    if name != "skipped":
      row[name] = _number(value)
  row["skipped"] = int(bool(logs.get("skipped", False)))
  row["skipped_steps"] = history.skipped_steps
  seconds = history.step_times[-1] if history.step_times else math.nan
  row["step_time"] = seconds
  samples = history.samples[-1] if history.samples else 0
  row["samples_per_s"] = samples / seconds if seconds > 0 else math.nan
  return row


def epoch_row(trainer: Any, logs: Mapping[str, Any]) -> dict[str, float]:
  """The epoch's summary (`History.epochs`) with the global step it ended at."""
  history = trainer.history
  row: dict[str, Any] = {"epoch": int(logs["epoch"])}
  row["step"] = history.steps[-1] + 1 if history.steps else 0
  for name, value in logs.items():
    if name != "epoch":
      row[name] = _number(value)
  row["skipped_steps"] = history.skipped_steps
  return row


class EvalReader:
  """The evaluations `History.evals` gained since the last call."""

  def __init__(self):
    self.seen = 0

  def start(self, trainer: Any) -> None:
    """From now on: evaluations already recorded are not new."""
    self.seen = len(trainer.history.evals)

  def new(self, trainer: Any) -> list[dict[str, float]]:
    evals = trainer.history.evals
    self.seen = min(self.seen, len(evals))  # a restored history may be shorter
    fresh, self.seen = evals[self.seen:], len(evals)
    return [dict(e) for e in fresh]
