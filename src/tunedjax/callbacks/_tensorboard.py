"""`TensorBoard`: the training's figures as TensorBoard event files (tensorboardX)."""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from tunedjax.callbacks import _rows
from tunedjax.trainer._callbacks import Callback
from tunedjax.trainer._model import TrainerError

INSTALL_HINT = ("tunedjax.callbacks.TensorBoard writes with tensorboardX, which is not "
                "installed: pip install 'tunedjax[tensorboard]'")


def _tensorboardx() -> tuple[Any, Any]:
  """tensorboardX and its `Summary` protocol buffer, or an ImportError naming the extra."""
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top
    import tensorboardX.summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(INSTALL_HINT) from e
  return tensorboardX, Summary


def _scalars(summary: Any, prefix: str, row: Mapping[str, float],
             skip: tuple[str, ...]) -> Any:
  """One `Summary` holding every value of `row`: the values `tensorboardX.summary.scalar`
  makes one at a time, in one event (one write per step, not one per figure)."""
  return summary(value=[summary.Value(tag=f"{prefix}/{name}", simple_value=float(value))
                        for name, value in row.items() if name not in skip])


def _tuning_text(tuning: Mapping[str, Any]) -> str:
  """`history.tuning` as Markdown: its JSON as a code block."""
  body = json.dumps(tuning, indent=2, sort_keys=True, default=str)
  return "What each tuner chose (`history.tuning`):\n\n" + "\n".join(
      "    " + line for line in body.splitlines())


def _path_name(path: tuple[Any, ...]) -> str:
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  if len(parts) > 1 and parts[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
    parts.pop()  # an nnx Variable's `.value`: the parameter is named by its module's path
  return "/".join(parts)


def _host_copy(x: Any) -> np.ndarray | None:
  """`x` on this host: a fully replicated array's local copy (None: sharded)."""
  if isinstance(x, jax.Array):
    if x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return None
  return np.asarray(x)


class TensorBoard(Callback):
  """Writes the training's figures for TensorBoard, with tensorboardX.

  Per step (every `every_n_steps`), under ``train/``: ``loss``, the loss
  function's metrics, ``learning_rate`` (when known: see docs/callbacks.md),
  ``step_time`` (seconds), ``samples_per_s``, ``skipped`` (1 when the update
  was skipped) and ``skipped_steps`` (how many so far), at the global step.
  Per epoch, under ``epoch/``: the epoch's summary (``History.epochs``: the
  means, ``eval_*`` when `fit` evaluates at epoch ends, ``seconds``,
  ``steps_per_s``, ``samples_per_s``, ``learning_rate``), at the epoch
  number. Each evaluation (`History.evals`: at epoch ends, or every
  ``eval_every`` steps), under ``eval/``, at its step.
  At the end of each `fit`: ``history.tuning`` (what each tuner chose) as
  text under ``tuning``, when it changed; with `histograms`, each parameter's
  histogram under ``params/`` at each epoch's end.

  tensorboardX's writer thread writes the events to disk and flushes the
  file every `flush_secs` and at the end of each `fit` (the events of the
  last moments may still be queued then); the event file stays open from
  one `fit` to the next until `close` (or the process's exit) writes out
  everything and closes it. Only process 0 of a multi-process job writes.
  Needs the ``tensorboard`` extra (``pip install 'tunedjax[tensorboard]'``:
  tensorboardX, and crc32c for native checksums).

  Args:
    log_dir: the run's folder (created if missing); point ``tensorboard
      --logdir`` at it or at its parent.
    every_n_steps: write the per-step figures of every this many steps.
    histograms: also write the parameters' histograms at each epoch's end
      (costs a copy of the parameters to the host).
    flush_secs: how often the writer thread flushes to disk (and at the end
      of each `fit`).

  Example:
    >>> import os, tempfile, numpy as np, optax
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> trainer = tj.Trainer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                      lambda m, b: (m(b) ** 2).mean(), autotune=False,
    ...                      progress=False)
    >>> board = tj.callbacks.TensorBoard(tempfile.mkdtemp())
    >>> _ = trainer.fit(x, batch_size=16, epochs=2, callbacks=[board])
    >>> board.close()  # everything on disk now (else within flush_secs)
    >>> [name.startswith("events.out.tfevents") for name in os.listdir(board.log_dir)]
    [True]
  """

  def __init__(self, log_dir: str | os.PathLike[str], *, every_n_steps: int = 1,
               histograms: bool = False, flush_secs: float = 10.0):
    # At once: a missing extra is named here, not in the middle of `fit`.
    self._tbx, self._summary = _tensorboardx()
    self.log_dir = _rows.check_path("TensorBoard log_dir", log_dir)
    self.every_n_steps = _rows.check_every("TensorBoard every_n_steps", every_n_steps)
    if not isinstance(histograms, bool):
      raise TrainerError(f"TensorBoard histograms must be True or False, got {histograms!r}.")
    self.histograms = histograms
    if (not isinstance(flush_secs, numbers.Real) or isinstance(flush_secs, bool)
        or not 0 < flush_secs < math.inf):
      raise TrainerError(f"TensorBoard flush_secs must be a number of seconds > 0, got "
                         f"{flush_secs!r}.")
    self.flush_secs = float(flush_secs)
    self._writer: Any = None
    self._evals = _rows.EvalReader()
    self._tuning_written: str | None = None

  def on_fit_start(self, trainer: Any) -> None:
    self._evals.start(trainer)
    if _rows.is_writer() and self._writer is None:
      # A queue that never fills: a full one makes the training loop wait for the disk.
      self._writer = self._tbx.FileWriter(self.log_dir, max_queue=1024,
                                          flush_secs=self.flush_secs)

  def on_step_end(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
    if self._writer is None:
      return
    if step % self.every_n_steps == 0:
      row = _rows.step_row(trainer, step, logs)
      self._writer.add_summary(_scalars(self._summary, "train", row, ("step",)), step)
    self._write_evals(trainer)

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    if self._writer is None:
      return
    row = _rows.epoch_row(trainer, logs)
    self._writer.add_summary(_scalars(self._summary, "epoch", row, ("epoch", "step")), epoch)
    if self.histograms:
      self._write_histograms(trainer, epoch)

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    if self._writer is None:
      return
    self._write_evals(trainer)
    text = _tuning_text(history.tuning) if history.tuning else None
    if text is not None and text != self._tuning_written:
      step = history.steps[-1] + 1 if history.steps else 0
      self._writer.add_summary(self._tbx.summary.text("tuning", text), step)
      self._tuning_written = text
    self._writer.flush()

  def close(self) -> None:
    """Writes out what is queued and closes the event file (a later `fit` opens a
    new one in `log_dir`); also done when the process exits."""
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def _write_evals(self, trainer: Any) -> None:
    for result in self._evals.new(trainer):
      step = int(result.pop("step"))
      self._writer.add_summary(_scalars(self._summary, "eval", result, ()), step)

  def _write_histograms(self, trainer: Any, epoch: int) -> None:
    params = trainer.variables["params"]
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      values = _host_copy(leaf)
      if values is None or values.size == 0 or not np.issubdtype(values.dtype, np.number):
        continue
      values = values.astype(np.float64)
      if not np.isfinite(values).all():
        continue  # a histogram of nan/inf is an error in TensorBoard's format
      summary = self._tbx.summary.histogram(f"params/{_path_name(path)}", values,
                                            bins="auto")
      self._writer.add_summary(summary, epoch)
