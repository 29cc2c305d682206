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
from tunedjax.trainer._model import TrainerError


def _check_bool(what: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise TrainerError(f"{what} must be True or False, got {value!r}.")
  return value


_FLUSH_SECS = 10.0  # rows are written and flushed at least this often


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

  def flush(self) -> None:
    if self.file is not None:
      self.file.flush()

  def close(self) -> None:
    if self.file is not None:
      self.file.close()
      self.file, self.writer = None, None


class CSVLogger(_rows.Logger):
  """Writes the figures of each step, epoch and evaluation as CSV, with Python's `csv`.

  Three files in `directory`: ``steps.csv`` (one row per step, every
  `every_n_steps`: ``step``, ``loss``, the metrics, ``learning_rate`` when
  known, ``skipped``, ``skipped_steps``, ``step_time`` in seconds,
  ``samples_per_s``), ``epochs.csv`` (one row per epoch: ``epoch``, the
  global ``step`` it ended at, then the epoch's summary of `History.epochs`,
  ``eval_*`` included when `fit` evaluates at epoch ends) and ``evals.csv``
  (every evaluation of `History.evals`, at epoch ends or every
  ``eval_every`` steps, with the step it was made at). A file's columns are
  those of its first row; a key that appears only later is left out with a
  warning (`JSONLinesLogger` keeps every key). Rows are written in batches
  (at each epoch's end, every 1000 steps, every 10 s and at the end of
  `fit`, when the files are flushed). Only process 0 of a multi-process job
  writes.

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
    append = _check_bool("CSVLogger append", append)
    super().__init__(every_n_steps, _FLUSH_SECS, "CSVLogger")
    self._tables = {name: _Table(os.path.join(self.directory, f"{name}.csv"), append)
                    for name in ("steps", "epochs", "evals")}

  def open(self, trainer: Any) -> None:
    os.makedirs(self.directory, exist_ok=True)
    for table in self._tables.values():
      table.open()

  def write_steps(self, rows: list[dict[str, Any]], wall_times: list[float]) -> None:
    for row in rows:
      self._tables["steps"].write(row)

  def write_eval(self, result: dict[str, Any]) -> None:
    self._tables["evals"].write({"step": result.pop("step"), **result})

  def write_epoch(self, row: dict[str, Any]) -> None:
    self._tables["epochs"].write(row)

  def finish(self, *, closing: bool) -> None:
    for table in self._tables.values():
      if closing:
        table.close()
      else:
        table.flush()


def _json_value(value: Any) -> Any:
  """`value` for strict JSON: nan and inf (which JSON lacks) become None, in containers too."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, Mapping):
    return {str(k): _json_value(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_value(v) for v in value]
  return value



class JSONLinesLogger(_rows.Logger):
  """Writes one JSON object per line for each step, epoch, evaluation and tuning.

  Each line has ``"kind"``: ``"step"`` (every `every_n_steps`; the keys of
  `CSVLogger`'s ``steps.csv``, and ``"time"``: when the step was reported,
  in seconds since the epoch), ``"epoch"`` (``epochs.csv``'s), ``"eval"``
  (the results of an evaluation and its ``step``) or ``"tuning"``
  (``history.tuning`` under ``"tuning"``, at the end of a `fit` that changed
  it). Every key is kept, however late it appears; nan and inf are written
  as ``null`` (strict JSON, which every reader takes). Lines are written in
  batches, as `CSVLogger`'s rows. Only process 0 of a multi-process job
  writes.

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
    self._append = _check_bool("JSONLinesLogger append", append)
    super().__init__(every_n_steps, _FLUSH_SECS, "JSONLinesLogger")
    self._file: TextIO | None = None
    self._tuning_written: str | None = None

  def open(self, trainer: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    self._file = open(self.path, "a" if self._append else "w", encoding="utf-8")
    self._append = True

  def _write(self, kind: str, row: Mapping[str, Any]) -> None:
    record = {"kind": kind, **{k: _json_value(v) for k, v in row.items()}}
    self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")

  def write_steps(self, rows: list[dict[str, Any]], wall_times: list[float]) -> None:
    for row, wall_time in zip(rows, wall_times):
      self._write("step", {**row, "time": wall_time})

  def write_eval(self, result: dict[str, Any]) -> None:
    self._write("eval", result)

  def write_epoch(self, row: dict[str, Any]) -> None:
    self._write("epoch", row)

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    if self._active:
      self.drain(trainer)
      line = json.dumps({"kind": "tuning", "tuning": _json_value(history.tuning)},
                        allow_nan=False, default=str)
      if history.tuning and line != self._tuning_written:
        self._file.write(line + "\n")
        self._tuning_written = line
    super().on_fit_end(trainer, history)

  def finish(self, *, closing: bool) -> None:
    if closing:
      self._file.close()
      self._file = None
    else:
      self._file.flush()
