"""`CSVLogger` and `JSONLinesLogger`: the training's figures in plain files."""

from __future__ import annotations

import csv
import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

from tunedjax.callbacks import _rows
from tunedjax.trainer._callbacks import Callback
from tunedjax.trainer._model import TrainerError


def _check_bool(what: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise TrainerError(f"{what} must be True or False, got {value!r}.")
  return value


class _Table:
  """One CSV file whose columns are those of its first row (or its header)."""

  def __init__(self, path: str, append: bool):
    self.path = path
    self.append = append
    self.file: TextIO | None = None
    self.writer: csv.DictWriter | None = None
    self.columns: list[str] | None = None
    self.warned: set[str] = set()

  def open(self) -> None:
    if self.file is not None:
      return
    if self.append and os.path.exists(self.path) and os.path.getsize(self.path) > 0:
      with open(self.path, newline="", encoding="utf-8") as f:
        self.columns = next(csv.reader(f), None)
    elif not self.append:
      self.columns = None
      open(self.path, "w", encoding="utf-8").close()  # a new run starts a new file
    self.file = open(self.path, "a", newline="", encoding="utf-8")
    self.append = True  # a later fit of the same run continues the file
    if self.columns:
      self.writer = csv.DictWriter(self.file, self.columns, restval="",
                                   extrasaction="ignore")

  def write(self, row: Mapping[str, Any]) -> None:
    if self.writer is None:
      self.columns = list(row)
      self.writer = csv.DictWriter(self.file, self.columns, restval="",
                                   extrasaction="ignore")
      self.writer.writeheader()
    extra = [k for k in row if k not in self.writer.fieldnames and k not in self.warned]
    if extra:
      self.warned.update(extra)
      warnings.warn(f"CSVLogger: {os.path.basename(self.path)}'s columns were fixed by its "
                    f"first row; {extra} are not written (JSONLinesLogger keeps every key).",
                    stacklevel=4)
    self.writer.writerow(row)

  def close(self) -> None:
    if self.file is not None:
      self.file.close()
      self.file, self.writer = None, None


class CSVLogger(Callback):
  """Writes the figures of each step and each epoch as CSV, with Python's `csv`.

  Three files in `directory`: ``steps.csv`` (one row per step, every
  `every_n_steps`: ``step``, ``loss``, the metrics, ``learning_rate`` when
  known, ``skipped``, ``skipped_steps``, ``step_time`` in seconds,
  ``samples_per_s``) and ``epochs.csv`` (one row per epoch: ``epoch``, the
  global ``step`` it ended at, then the epoch's summary of `History.epochs`,
  ``eval_*`` included when `fit` evaluates at epoch ends). A file's columns
  are those of its first row; a key that appears only later is left out with
  a warning (`JSONLinesLogger` keeps every key). Every evaluation
  (`History.evals`: at epoch ends, or every ``eval_every`` steps) goes to
  ``evals.csv`` with the step it was made at. Only process 0 of a
  multi-process job writes.

  Args:
    directory: the folder of the three files (created if missing).
    every_n_steps: write every this many steps to ``steps.csv``.
    append: continue existing files (a resumed run) instead of starting new
      ones; a later `fit` with the same logger always continues them.

  Example:
    >>> import csv, os, tempfile, numpy as np, optax
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> trainer = tj.Trainer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                      lambda m, b: (m(b) ** 2).mean(), autotune=False,
    ...                      progress=False)
    >>> logger = tj.callbacks.CSVLogger(tempfile.mkdtemp())
    >>> _ = trainer.fit(x, batch_size=16, epochs=2, callbacks=[logger])
    >>> with open(os.path.join(logger.directory, "epochs.csv")) as f:
    ...   rows = list(csv.DictReader(f))
    >>> [row["epoch"] for row in rows], rows[-1]["step"]
    (['0', '1'], '8')
  """

  def __init__(self, directory: str | os.PathLike[str], *, every_n_steps: int = 1,
               append: bool = False):
    self.directory = _rows.check_path("CSVLogger directory", directory)
    self.every_n_steps = _rows.check_every("CSVLogger every_n_steps", every_n_steps)
    append = _check_bool("CSVLogger append", append)
    self._tables = {name: _Table(os.path.join(self.directory, f"{name}.csv"), append)
                    for name in ("steps", "epochs", "evals")}
    self._evals = _rows.EvalReader()
    self._active = False

  def on_fit_start(self, trainer: Any) -> None:
    self._evals.start(trainer)
    self._active = _rows.is_writer()
    if self._active:
      os.makedirs(self.directory, exist_ok=True)
      for table in self._tables.values():
        table.open()

  def on_step_end(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
    if not self._active:
      return
    if step % self.every_n_steps == 0:
      self._tables["steps"].write(_rows.step_row(trainer, step, logs))
    self._write_evals(trainer)

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    if self._active:
      self._tables["epochs"].write(_rows.epoch_row(trainer, logs))
      self._tables["epochs"].file.flush()
      self._tables["steps"].file.flush()

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    if self._active:
      self._write_evals(trainer)
      for table in self._tables.values():
        table.close()
      self._active = False

  def _write_evals(self, trainer: Any) -> None:
    for result in self._evals.new(trainer):
      self._tables["evals"].write({"step": result.pop("step"), **result})


def _json_value(value: Any) -> Any:
  """`value` for strict JSON: nan and inf (which JSON lacks) become None, in containers too."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, Mapping):
    return {str(k): _json_value(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_value(v) for v in value]
  return value


class JSONLinesLogger(Callback):
  """Writes one JSON object per line for each step, epoch, evaluation and tuning.

  Each line has ``"kind"``: ``"step"`` (every `every_n_steps`; the keys of
  `CSVLogger`'s ``steps.csv``), ``"epoch"`` (``epochs.csv``'s), ``"eval"``
  (the results of an evaluation and its ``step``) or ``"tuning"``
  (``history.tuning`` under ``"tuning"``, at the end of a `fit` that changed
  it). Every key is kept, however late it appears; nan and inf are written
  as ``null`` (strict JSON, which every reader takes). Only process 0 of a
  multi-process job writes.

  Args:
    path: the file (its folder is created if missing).
    every_n_steps: write every this many steps.
    append: continue an existing file instead of starting a new one; a later
      `fit` with the same logger always continues it.

  Example:
    >>> import json, tempfile, numpy as np, optax
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    >>> trainer = tj.Trainer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                      lambda m, b: (m(b) ** 2).mean(), autotune=False,
    ...                      progress=False)
    >>> logger = tj.callbacks.JSONLinesLogger(tempfile.mkdtemp() + "/log.jsonl")
    >>> _ = trainer.fit(x, batch_size=16, epochs=1, callbacks=[logger])
    >>> with open(logger.path) as f:
    ...   [json.loads(line)["kind"] for line in f]
    ['step', 'step', 'epoch', 'tuning']
  """

  def __init__(self, path: str | os.PathLike[str], *, every_n_steps: int = 1,
               append: bool = False):
    self.path = _rows.check_path("JSONLinesLogger path", path)
    self.every_n_steps = _rows.check_every("JSONLinesLogger every_n_steps", every_n_steps)
    self._append = _check_bool("JSONLinesLogger append", append)
    self._file: TextIO | None = None
    self._evals = _rows.EvalReader()
    self._tuning_written: str | None = None

  def on_fit_start(self, trainer: Any) -> None:
    self._evals.start(trainer)
    if _rows.is_writer():
      folder = os.path.dirname(os.path.abspath(self.path))
      os.makedirs(folder, exist_ok=True)
      self._file = open(self.path, "a" if self._append else "w", encoding="utf-8")
      self._append = True

  def _write(self, kind: str, row: Mapping[str, Any]) -> None:
    record = {"kind": kind, **{k: _json_value(v) for k, v in row.items()}}
    self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")

  def on_step_end(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
    if self._file is None:
      return
    if step % self.every_n_steps == 0:
      self._write("step", _rows.step_row(trainer, step, logs))
    self._write_evals(trainer)

  def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, Any]) -> None:
    if self._file is not None:
      self._write("epoch", _rows.epoch_row(trainer, logs))
      self._file.flush()

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    if self._file is None:
      return
    self._write_evals(trainer)
    line = json.dumps({"kind": "tuning", "tuning": _json_value(history.tuning)},
                      allow_nan=False, default=str)
    if history.tuning and line != self._tuning_written:
      self._file.write(line + "\n")
      self._tuning_written = line
    self._file.close()
    self._file = None

  def _write_evals(self, trainer: Any) -> None:
    for result in self._evals.new(trainer):
      self._write("eval", result)
