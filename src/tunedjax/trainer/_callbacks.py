"""Callbacks: code of the user's that runs at points of `Trainer.fit`.

Example:
  >>> class StopAt(Callback):
  ...   def on_step_end(self, trainer, step, logs):
  ...     if logs["loss"] < 0.1:
  ...       trainer.stop_training = True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunedjax.trainer._model import TrainerError


class Callback:
  """Override the methods you need; each does nothing by default.

  Steps are reported once their loss is known, which is one step after they
  were dispatched: ``trainer.state`` may already be a step further. Set
  ``trainer.stop_training = True`` to end `fit` after the step in flight (at
  an epoch's end: before the next epoch's first step). Ready-made callbacks
  are in `tunedjax.callbacks`.
  """

  def on_fit_start(self, trainer: Any) -> None:
    """Before the first step of a `fit` call (after any resume)."""

  def on_step_end(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
    """After global step `step`; `logs` has ``loss``, the metrics, ``skipped``, and
    ``learning_rate`` when it is known (docs/callbacks.md)."""

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    """After an epoch; `logs` is the epoch's summary in `History.epochs`."""

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    """When `fit` returns."""


class CallbackList:
  """Calls each callback in turn."""

  def __init__(self, callbacks: Sequence[Callback] | None):
    if callbacks is None:
      callbacks = ()
    elif isinstance(callbacks, Callback):
      callbacks = (callbacks,)
    try:
      if isinstance(callbacks, (str, bytes, Mapping)):
        raise TypeError
      self.callbacks = list(callbacks)
    except TypeError:
      raise TrainerError(f"callbacks must be a list of tunedjax.trainer.Callback "
                         f"instances, got {callbacks!r}.") from None
    bad = [c for c in self.callbacks if not isinstance(c, Callback)]
    if bad:
      raise TrainerError(f"callbacks must be tunedjax.trainer.Callback instances, got "
                         f"{bad!r}.")

  def on_fit_start(self, trainer: Any) -> None:
    for c in self.callbacks:
      c.on_fit_start(trainer)

  def on_step_end(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
    for c in self.callbacks:
      c.on_step_end(trainer, step, logs)

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    for c in self.callbacks:
      c.on_epoch_end(trainer, epoch, logs)

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    for c in self.callbacks:
      c.on_fit_end(trainer, history)
