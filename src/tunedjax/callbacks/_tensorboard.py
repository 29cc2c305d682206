"""`TensorBoard`: the training's figures as TensorBoard event files (tensorboardX)."""

from __future__ import annotations

import atexit
import json
import math
import numbers
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from tunedjax.callbacks import _rows
from tunedjax.trainer._model import TrainerError

INSTALL_HINT = ("tunedjax.callbacks.TensorBoard writes with tensorboardX, which is not "
                "installed: pip install 'tunedjax[tensorboard]'")


def _tensorboardx() -> tuple[Any, Any]:
  """tensorboardX's summary builders and its `Summary` protocol buffer, or an
  ImportError naming the extra."""
  try:
    import tensorboardX.event_file_writer  # pylint: disable=g-import-not-at-top
    import tensorboardX.summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(INSTALL_HINT) from e
  return tensorboardX.summary, Summary


class _EventFile:
  """One event file, written by tensorboardX's `EventsWriter` in the calling thread.

  Not its `FileWriter`: that one sends each event through a
  `multiprocessing.Queue` to a writer thread (pickled, unpickled, then
  written), and a thread that wakes for each event competes with the
  training step's threads; an event written here is a serialisation, two
  native checksums and a buffered file write (~10 us), and `Logger` writes
  them in batches.
  """

  def __init__(self, log_dir: str):
    from tensorboardX import event_file_writer  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
    from tensorboardX.record_writer import directory_check  # pylint: disable=g-import-not-at-top
    directory_check(log_dir)  # creates it (local, S3 or GCS, as tensorboardX's FileWriter)
    self._writer = event_file_writer.EventsWriter(os.path.join(log_dir, "events"))
    self._event = event_pb2.Event
    atexit.register(self.close)  # as tensorboardX's FileWriter: complete at exit

  def write(self, summary: Any, step: int, wall_time: float | None = None) -> None:
    if wall_time is None or math.isnan(wall_time):
      wall_time = time.time()
    self._writer.write_event(self._event(wall_time=wall_time, step=int(step), summary=summary))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    atexit.unregister(self.close)
    self._writer.close()


def _scalars(proto: Any, prefix: str, row: Mapping[str, float],
             skip: tuple[str, ...]) -> Any:
  """One `Summary` holding every value of `row`: the values `tensorboardX.summary.scalar`
  makes one at a time, in one event (one write per step, not one per figure)."""
  return proto(value=[proto.Value(tag=f"{prefix}/{name}", simple_value=float(value))
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


class TensorBoard(_rows.Logger):
  """Writes the training's figures for TensorBoard, with tensorboardX.

  Per step (every `every_n_steps`), under ``train/``: ``loss``, the loss
  function's metrics, ``learning_rate`` (when known: see docs/callbacks.md),
  ``step_time`` (seconds), ``samples_per_s``, ``skipped`` (1 when the update
  was skipped) and ``skipped_steps`` (how many so far), at the global step
  and the time the step was reported. Per epoch, under ``epoch/``: the
  epoch's summary (``History.epochs``: the means, ``eval_*`` when `fit`
  evaluates at epoch ends, ``seconds``, ``steps_per_s``, ``samples_per_s``,
  ``learning_rate``), at the epoch number. Each evaluation (`History.evals`:
  at epoch ends, or every ``eval_every`` steps), under ``eval/``, at its
  step. At the end of each `fit`: ``history.tuning`` (what each tuner chose)
  as text under ``tuning``, when it changed; with `histograms`, each
  parameter's histogram under ``params/`` at each epoch's end.

  The steps' events are written in batches (at each epoch's end, every 1000
  steps, every `flush_secs` and at the end of `fit`) with tensorboardX's
  `EventsWriter`, and the file is flushed then, so TensorBoard sees a
  finished `fit` whole. The event file stays open from one `fit` to the
  next, until `close` (or the process's exit). Only process 0 of a
  multi-process job writes. Needs the ``tensorboard`` extra (``pip install
  'tunedjax[tensorboard]'``: tensorboardX, and crc32c for native checksums).

  Args:
    log_dir: the run's folder (created if missing); point ``tensorboard
      --logdir`` at it or at its parent.
    every_n_steps: write the per-step figures of every this many steps.
    histograms: also write the parameters' histograms at each epoch's end
      (costs a copy of the parameters to the host).
    flush_secs: write and flush the steps so far at least this often while
      training.

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
    >>> [name.startswith("events.out.tfevents") for name in os.listdir(board.log_dir)]
    [True]
  """

  def __init__(self, log_dir: str | os.PathLike[str], *, every_n_steps: int = 1,
               histograms: bool = False, flush_secs: float = 10.0):
    # At once: a missing extra is named here, not in the middle of `fit`.
    self._summary, self._proto = _tensorboardx()
    self.log_dir = _rows.check_path("TensorBoard log_dir", log_dir)
    if not isinstance(histograms, bool):
      raise TrainerError(f"TensorBoard histograms must be True or False, got {histograms!r}.")
    self.histograms = histograms
    if (not isinstance(flush_secs, numbers.Real) or isinstance(flush_secs, bool)
        or not 0 < flush_secs < math.inf):
      raise TrainerError(f"TensorBoard flush_secs must be a number of seconds > 0, got "
                         f"{flush_secs!r}.")
    self.flush_secs = float(flush_secs)
    super().__init__(every_n_steps, self.flush_secs, "TensorBoard")
    self._writer: _EventFile | None = None
    self._tuning_written: str | None = None

  def open(self, trainer: Any) -> None:
    if self._writer is None:
      self._writer = _EventFile(self.log_dir)

  def write_steps(self, rows: list[dict[str, Any]], wall_times: list[float]) -> None:
    for row, wall_time in zip(rows, wall_times):
      self._writer.write(_scalars(self._proto, "train", row, ("step",)), row["step"],
                         wall_time)

  def write_eval(self, result: dict[str, Any]) -> None:
    step = int(result.pop("step"))
    self._writer.write(_scalars(self._proto, "eval", result, ()), step)

  def write_epoch(self, row: dict[str, Any]) -> None:
    self._writer.write(_scalars(self._proto, "epoch", row, ("epoch", "step")), row["epoch"])

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    super().on_epoch_end(trainer, epoch, logs)
    if self._active and self.histograms:
      self._write_histograms(trainer, epoch)

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    if self._active:
      self.drain(trainer)
      text = _tuning_text(history.tuning) if history.tuning else None
      if text is not None and text != self._tuning_written:
        step = history.steps[-1] + 1 if history.steps else 0
        self._writer.write(self._summary.text("tuning", text), step)
        self._tuning_written = text
    super().on_fit_end(trainer, history)

  def finish(self, *, closing: bool) -> None:
    self._writer.flush()

  def close(self) -> None:
    """Flushes and closes the event file (a later `fit` opens a new one in
    `log_dir`); also done when the process exits."""
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def _write_histograms(self, trainer: Any, epoch: int) -> None:
    params = trainer.variables["params"]
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      values = _host_copy(leaf)
      if values is None or values.size == 0 or not np.issubdtype(values.dtype, np.number):
        continue
      values = values.astype(np.float64)
      if not np.isfinite(values).all():
        continue  # a histogram of nan/inf is an error in TensorBoard's format
      summary = self._summary.histogram(f"params/{_path_name(path)}", values, bins="auto")
      self._writer.write(summary, epoch)
