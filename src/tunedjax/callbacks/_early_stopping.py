"""`EarlyStopping`: ends `fit` when a logged quantity stops improving."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunedjax._errors import is_int, show_value
from tunedjax.callbacks._monitor import Monitor
from tunedjax.trainer._callbacks import Callback
from tunedjax.trainer._model import TrainerError


class EarlyStopping(Callback):
  """Stops training when `monitor` has not improved for `patience` epochs.

  At each epoch's end the monitored entry of the epoch's summary
  (`History.epochs`: ``"loss"``, a metric's mean, ``"eval_loss"`` and
  ``"eval_<metric>"`` when `fit` evaluates `eval_data` at epoch ends,
  ``"learning_rate"``, ...) is compared with the best so far; it improves
  when it beats the best by more than `min_delta` (a nan never does). After
  `patience` epochs in a row without improvement (0 or 1: the first one)
  `fit` ends at that epoch's end: no step of the next epoch runs. With
  `restore_best_weights`, the model's weights (the parameters and the other
  state, such as BatchNorm statistics; not the optimizer state or the step
  count) of the best epoch are copied on their devices each time it
  improves and put back when `fit` ends, whether it stopped early or not.
  Each `fit` starts afresh. Every process of a multi-process job decides
  alike (the logs are global figures).

  Args:
    monitor: the epoch summary's entry to watch.
    mode: "min" (lower is better, the default) or "max".
    patience: epochs without improvement to wait before stopping (>= 0).
    min_delta: the least change that counts as an improvement (>= 0).
    restore_best_weights: end `fit` with the weights of the best epoch.

  Attributes:
    best: the best value seen in the last `fit` (nan before any).
    best_epoch: the epoch that had it (None before any).
    stopped_epoch: the epoch `fit` stopped after, or None if it did not stop.

  Example:
    >>> import numpy as np, optax
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> trainer = tj.Trainer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.0),
    ...                      lambda m, b: (m(b) ** 2).mean(), autotune=False,
    ...                      progress=False)  # a learning rate of 0: no progress
    >>> stop = tj.callbacks.EarlyStopping("loss", patience=2, min_delta=1e-6)
    >>> history = trainer.fit(x, batch_size=16, epochs=10, callbacks=[stop])
    >>> stop.best_epoch, stop.stopped_epoch, len(history.epochs)
    (0, 2, 3)
  """

  def __init__(self, monitor: str = "eval_loss", *, mode: str = "min", patience: int = 0,
               min_delta: float = 0.0, restore_best_weights: bool = True):
    self.monitor = Monitor(monitor, mode=mode, min_delta=min_delta, owner="EarlyStopping")
    if not is_int(patience) or patience < 0:
      raise TrainerError(f"EarlyStopping patience must be an int >= 0, got "
                         f"{show_value(patience)}.")
    self.patience = int(patience)
    if not isinstance(restore_best_weights, bool):
      raise TrainerError(f"EarlyStopping restore_best_weights must be True or False, got "
                         f"{show_value(restore_best_weights)}.")
    self.restore_best_weights = restore_best_weights
    self._reset()

  def _reset(self) -> None:
    self.monitor.reset()
    self.best_epoch: int | None = None
    self.stopped_epoch: int | None = None
    self._last_epoch: int | None = None
    self._wait = 0
    self._weights: Any = None

  @property
  def best(self) -> float:
    return self.monitor.best

  def on_fit_start(self, trainer: Any) -> None:
    self._reset()

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    value = self.monitor.value(logs, f"logs of epoch {epoch}")
    self._last_epoch = epoch
    if self.monitor.update(value):
      self.best_epoch, self._wait = epoch, 0
      if self.restore_best_weights:
        self._weights = None  # the old copy's memory first
        self._weights = trainer._weights_copy()  # pylint: disable=protected-access
      return
    self._wait += 1
    if self._wait >= self.patience:
      self.stopped_epoch = epoch
      trainer.stop_training = True

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    weights, self._weights = self._weights, None
    if weights is not None and self.best_epoch != self._last_epoch:
      trainer._set_weights(weights)  # pylint: disable=protected-access
