"""`BestCheckpoint`: keeps the best checkpoints by an evaluation metric (orbax)."""

from __future__ import annotations

import bisect
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from tunedjax._errors import is_int, show_value
from tunedjax.callbacks import _rows
from tunedjax.callbacks._monitor import Monitor
from tunedjax.trainer._callbacks import Callback
from tunedjax.trainer._checkpoint import Checkpointer
from tunedjax.trainer._model import TrainerError


class BestCheckpoint(Callback):
  """Keeps the `keep` best epochs' checkpoints by `monitor`, in their own folder.

  At each epoch's end, when the monitored entry of the epoch's summary
  (``"eval_loss"`` by default: `fit` evaluates `eval_data` at each epoch's
  end) could be among the `keep` best, the trainer's state is saved into
  `directory` with that value as its orbax metric; orbax's `CheckpointManager`
  (``best_fn``/``best_mode`` with a ``BestN`` preservation policy) keeps the
  `keep` best and deletes the rest. A checkpoint here is a Trainer
  checkpoint like those of ``checkpoint_dir`` (state, history, data
  position), so ``trainer.restore(best.directory, step=best.best_step)``
  loads the best weights into any Trainer of the same model. The trainer's
  own ``checkpoint_dir`` keeps its latest checkpoints as before, which is
  what ``fit(resume=True)`` restores; `directory` must be another folder.
  Every process of a multi-process job saves (orbax coordinates the writes).

  Args:
    directory: the folder of the best checkpoints (created if missing).
    monitor: the epoch summary's entry to rank by.
    mode: "min" (lower is better, the default) or "max".
    keep: how many of the best checkpoints to keep (>= 1).

  Example:
    >>> import tempfile, numpy as np, optax
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> trainer = tj.Trainer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                      lambda m, b: (m(b) ** 2).mean(), autotune=False,
    ...                      progress=False)
    >>> best = tj.callbacks.BestCheckpoint(tempfile.mkdtemp(), keep=2)
    >>> _ = trainer.fit(x, batch_size=16, epochs=3, eval_data=x[:32], callbacks=[best])
    >>> best.best_step, best.steps()  # the loss falls: the last two epochs are best
    (12, [8, 12])
    >>> _ = trainer.restore(best.directory, step=best.best_step)
  """

  def __init__(self, directory: str | os.PathLike[str], *, monitor: str = "eval_loss",
               mode: str = "min", keep: int = 1):
    directory = _rows.check_path("BestCheckpoint directory", directory)
    self.directory = pathlib.Path(directory).expanduser().absolute()
    self.monitor = Monitor(monitor, mode=mode, owner="BestCheckpoint")
    if not is_int(keep) or keep < 1:
      raise TrainerError(f"BestCheckpoint keep must be an int >= 1, got {show_value(keep)}.")
    self.keep = int(keep)
    self._checkpointer: Checkpointer | None = None
    self._saved: list[float] = []  # this callback's saved values, best first (as "min")

  @property
  def checkpointer(self) -> Checkpointer:
    """The `Checkpointer` of `directory` (orbax's manager with the best-N policy)."""
    if self._checkpointer is None:
      self._checkpointer = Checkpointer(self.directory, max_to_keep=0,
                                        best_metric=self.monitor.name,
                                        best_mode=self.monitor.mode, keep_best=self.keep)
    return self._checkpointer

  @property
  def best_step(self) -> int | None:
    """The step of the best checkpoint in `directory` (None: none yet)."""
    return self.checkpointer.best_step()

  def steps(self) -> list[int]:
    """The steps kept in `directory`, oldest first."""
    return self.checkpointer.all_steps()

  def on_fit_start(self, trainer: Any) -> None:
    own = getattr(trainer, "checkpointer", None)
    if own is not None and own.directory == self.directory:
      raise TrainerError(
          f"BestCheckpoint directory {str(self.directory)!r} is the Trainer's "
          "checkpoint_dir; give it a folder of its own (the trainer's keeps the latest "
          "checkpoints for resume, this one the best).")
    self.checkpointer  # pylint: disable=pointless-statement  # opens it on every process

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    value = self.monitor.value(logs, f"logs of epoch {epoch}")
    if math.isnan(value):
      return
    key = value if self.monitor.mode == "min" else -value
    if len(self._saved) >= self.keep and key >= self._saved[self.keep - 1]:
      return  # orbax would delete it at once
    if trainer._save_to(self.checkpointer, force=True,  # pylint: disable=protected-access
                        metrics={self.monitor.name: value}):
      bisect.insort(self._saved, key)

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    if self._checkpointer is not None:
      self._checkpointer.wait()  # on disk when fit returns

  def close(self) -> None:
    """Waits for the save in flight and releases orbax's threads."""
    if self._checkpointer is not None:
      self._checkpointer.close()
      self._checkpointer = None
