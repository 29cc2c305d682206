"""What the logging callbacks write, and when: rows per step, epoch and evaluation.

The loggers (TensorBoard, CSV, JSON lines) write the same figures under the
same names, read from the trainer's `History`, which records every step,
epoch and evaluation before the callbacks hear of it. A step costs a logger
almost nothing while the step runs: it notes the time, and the rows of the
steps since the last write are built and written together (`Logger.drain`)
at each epoch's end, at the end of `fit`, every `DRAIN_STEPS` steps and
every `flush_secs`. On a CPU the training step's own threads use every
core, so Python work done while a step runs is slowed several times over
(writing a TensorBoard event per step as it came took ~14 us of CPU per step
alone and ~65 us inside `fit` on 2 cores); in one batch it costs what it
costs alone.

Example:
  >>> from tunedjax.trainer import History
  >>> h = History()
  >>> h.record_step(0, 0.5, 0.002, samples=32, learning_rate=0.1)
  >>> h.record_step(1, 0.25, 0.002, samples=32, skipped=True)
  >>> rows = step_rows(h, 0, 2, every=1)
  >>> list(rows[0])
  ['step', 'loss', 'learning_rate', 'skipped', 'skipped_steps', 'step_time', 'samples_per_s']
  >>> rows[0]["samples_per_s"], rows[1]["skipped_steps"], "learning_rate" in rows[1]
  (16000.0, 1, False)
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import jax

from tunedjax._errors import is_int, show_value
from tunedjax.trainer._callbacks import Callback
from tunedjax.trainer._model import TrainerError

DRAIN_STEPS = 1000  # at most this many steps' rows wait to be written


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


def step_rows(history: Any, lo: int, hi: int, *, every: int) -> list[dict[str, Any]]:
  """The rows of `history`'s per-step entries ``lo:hi`` whose step is a multiple of
  `every`: ``step``, ``loss``, the metrics, ``learning_rate`` (when known),
  ``skipped``, ``skipped_steps`` (so far), ``step_time``, ``samples_per_s``."""
  skipped = set(history.skipped)
  skipped_before = bisect.bisect_left(history.skipped, history.steps[lo]) if lo < hi else 0
  rows = []
  for i in range(lo, hi):
    step = history.steps[i]
    skip = step in skipped
    skipped_before += skip
    if step % every:
      continue
    row: dict[str, Any] = {"step": step, "loss": history.losses[i], **history.metrics[i]}
    rate = history.learning_rates[i] if i < len(history.learning_rates) else math.nan
    if not math.isnan(rate):
      row["learning_rate"] = rate
    seconds = history.step_times[i]
    row.update(skipped=int(skip), skipped_steps=skipped_before, step_time=seconds,
               samples_per_s=history.samples[i] / seconds if seconds > 0 else math.nan)
    rows.append(row)
  return rows


def epoch_row(history: Any, logs: Mapping[str, Any]) -> dict[str, Any]:
  """The epoch's summary (`History.epochs`) with the global step it ended at."""
  row: dict[str, Any] = {"epoch": int(logs["epoch"])}
  row["step"] = history.steps[-1] + 1 if history.steps else 0
  for name, value in logs.items():
    if name != "epoch":
      row[name] = float(value)
  row["skipped_steps"] = history.skipped_steps
  return row


class Logger(Callback):
  """A callback that writes rows (on process 0 only), in batches from the History.

  Subclasses open their files in `open`, write in `write_steps`, `write_eval`
  and `write_epoch`, and flush or close in `finish`.
  """

  def __init__(self, every_n_steps: int, flush_secs: float, name: str):
    self.every_n_steps = check_every(f"{name} every_n_steps", every_n_steps)
    self._flush_secs = flush_secs
    self._active = False
    self._next = 0  # the first of History's per-step entries not written yet
    self._evals = 0  # the same for History.evals
    self._times: list[float] = []  # wall time of each step not written yet
    self._due = math.inf

  def on_fit_start(self, trainer: Any) -> None:
    history = trainer.history
    self._next, self._evals, self._times = len(history.steps), len(history.evals), []
    self._active = is_writer()
    if self._active:
      self.open(trainer)
      self._due = time.monotonic() + self._flush_secs

  def on_step_end(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
    if self._active:
      self._times.append(time.time())
      if len(self._times) >= DRAIN_STEPS or time.monotonic() >= self._due:
        self.drain(trainer)
        self.finish(closing=False)

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    if self._active:
      self.drain(trainer)
      self.write_epoch(epoch_row(trainer.history, logs))

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    if self._active:
      self.drain(trainer)
      self.finish(closing=True)
      self._active = False

  def drain(self, trainer: Any) -> None:
    """Writes the steps and evaluations recorded since the last call."""
    history = trainer.history
    hi, lo = len(history.steps), min(self._next, len(history.steps))
    times, self._times = self._times, []
    if hi > lo:
      times = [math.nan] * (hi - lo - len(times)) + times[-(hi - lo):]
      rows = step_rows(history, lo, hi, every=self.every_n_steps)
      when = {history.steps[i]: t for i, t in zip(range(lo, hi), times)}
      self.write_steps(rows, [when[row["step"]] for row in rows])
    self._next = hi
    for result in history.evals[min(self._evals, len(history.evals)):]:
      self.write_eval(dict(result))
    self._evals = len(history.evals)
    self._due = time.monotonic() + self._flush_secs

  def open(self, trainer: Any) -> None:
    """Before the first row of a `fit` (on process 0)."""

  def write_steps(self, rows: list[dict[str, Any]], wall_times: list[float]) -> None:
    """Steps' rows, and when each step was reported (nan: not known)."""

  def write_eval(self, result: dict[str, Any]) -> None:
    """An evaluation's results, with its ``step``."""

  def write_epoch(self, row: dict[str, Any]) -> None:
    """An epoch's row."""

  def finish(self, *, closing: bool) -> None:
    """After a drain: flush (`closing`: the end of a `fit`)."""
