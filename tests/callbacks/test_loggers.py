"""TensorBoard, CSVLogger and JSONLinesLogger: what they wrote, read back by TensorBoard's
own reader, Python's `csv` and `json`, equals the History."""

from __future__ import annotations

import csv
import json
import math
import sys

import numpy as np
import optax
import pytest

from tests.callbacks import support as s
from tests.trainer import models as m
from tunedjax.callbacks import CSVLogger, JSONLinesLogger, TensorBoard
from tunedjax.trainer import Trainer, TrainerError

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")

SCHEDULE = optax.linear_schedule(0.01, 0.001, transition_steps=8)


def _trainer():
  return Trainer(m.NnxMLP(), optax.adam(SCHEDULE), m.nnx_loss, schedule=SCHEDULE, **s.QUIET)


def _read_events(folder):
  acc = event_accumulator.EventAccumulator(
      str(folder), size_guidance={event_accumulator.SCALARS: 0,
                                  event_accumulator.TENSORS: 0,
                                  event_accumulator.HISTOGRAMS: 0})
  acc.Reload()
  return acc


def _scalars(acc, tag):
  return {e.step: e.value for e in acc.Scalars(tag)}


def test_tensorboard_event_files_hold_the_history(tmp_path):
  data = m.regression_data(n=64)
  trainer = _trainer()
  board = TensorBoard(tmp_path / "run", histograms=True)
  history = trainer.fit(data, batch_size=16, epochs=3, eval_data=data, callbacks=[board])
  acc = _read_events(tmp_path / "run")  # flushed at the end of fit: no close needed
  f32 = lambda values: np.asarray(values, np.float32).tolist()  # noqa: E731  # simple_value
  assert _scalars(acc, "train/loss") == dict(zip(history.steps, f32(history.losses)))
  assert list(_scalars(acc, "train/mae").values()) == f32([x["mae"] for x in history.metrics])
  rates = _scalars(acc, "train/learning_rate")
  assert list(rates.values()) == f32(history.learning_rates)
  np.testing.assert_allclose(list(rates.values()), [SCHEDULE(i) for i in range(12)], rtol=1e-6)
  assert list(_scalars(acc, "train/step_time").values()) == f32(history.step_times)
  assert set(_scalars(acc, "train/skipped_steps").values()) == {0.0}
  for name in ("loss", "eval_loss", "eval_mae", "samples_per_s", "learning_rate"):
    assert _scalars(acc, f"epoch/{name}") == {e["epoch"]: f32([e[name]])[0]
                                              for e in history.epochs}, name
  (text,) = acc.Tensors("tuning/text_summary")
  shown = text.tensor_proto.string_val[0].decode()
  assert '"precision": "float32"' in shown and text.step == 12
  assert {"params/fc1/kernel", "params/fc2/bias"} <= set(acc.Tags()["histograms"])
  histogram = acc.Histograms("params/fc1/kernel")
  assert [h.step for h in histogram] == [0, 1, 2] and histogram[0].histogram_value.num == 8 * 32
  board.close()


def test_tensorboard_every_n_steps_and_evaluations_every_n_steps(tmp_path):
  data = m.regression_data(n=64)
  board = TensorBoard(tmp_path, every_n_steps=3)
  trainer = _trainer()
  trainer.fit(data, batch_size=16, epochs=1, eval_data=data, eval_every=4, callbacks=[board])
  history = trainer.fit(data, batch_size=16, epochs=2, eval_data=data, eval_every=4,
                        callbacks=[board])  # the same event file, continued
  board.close()
  assert len(list(tmp_path.iterdir())) == 1
  acc = _read_events(tmp_path)
  assert sorted(_scalars(acc, "train/loss")) == [0, 3, 6]
  assert _scalars(acc, "eval/loss") == {e["step"]: np.float32(e["loss"]) for e in history.evals}
  assert sorted(_scalars(acc, "eval/loss")) == [4, 8]


def test_tensorboard_names_the_extra_to_install(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
  with pytest.raises(ImportError, match=r"pip install 'tunedjax\[tensorboard\]'"):
    TensorBoard(tmp_path)
  monkeypatch.undo()
  with pytest.raises(TrainerError, match="every_n_steps must be an int >= 1, got 0"):
    TensorBoard(tmp_path, every_n_steps=0)


def _read_csv(path):
  with open(path, newline="", encoding="utf-8") as f:
    return list(csv.DictReader(f))


def test_csv_files_hold_each_step_epoch_and_evaluation(tmp_path):
  data = m.regression_data(n=64)
  trainer = _trainer()
  logger = CSVLogger(tmp_path / "logs")
  history = trainer.fit(data, batch_size=16, epochs=2, eval_data=data, callbacks=[logger])
  steps = _read_csv(tmp_path / "logs" / "steps.csv")
  assert list(steps[0]) == ["step", "loss", "mae", "learning_rate", "skipped", "skipped_steps",
                            "step_time", "samples_per_s"]
  assert [int(r["step"]) for r in steps] == history.steps
  assert [float(r["loss"]) for r in steps] == history.losses  # repr round-trips a float
  assert [float(r["learning_rate"]) for r in steps] == history.learning_rates
  assert [float(r["step_time"]) for r in steps] == history.step_times
  assert {r["skipped"] for r in steps} == {"0"}
  epochs = _read_csv(tmp_path / "logs" / "epochs.csv")
  assert [int(r["step"]) for r in epochs] == [4, 8]
  for row, summary in zip(epochs, history.epochs):
    assert {k: float(row[k]) for k in summary} == summary
  evals = _read_csv(tmp_path / "logs" / "evals.csv")  # every evaluation, at its step
  assert [(int(r["step"]), float(r["loss"])) for r in evals] == [
      (e["step"], e["loss"]) for e in history.evals] == [(4, history.epochs[0]["eval_loss"]),
                                                          (8, history.epochs[1]["eval_loss"])]

  trainer.fit(data, batch_size=16, epochs=3, eval_data=data, eval_every=2, callbacks=[logger])
  steps = _read_csv(tmp_path / "logs" / "steps.csv")  # the same logger continues its files
  assert [int(r["step"]) for r in steps] == list(range(12))
  evals = _read_csv(tmp_path / "logs" / "evals.csv")
  assert [int(r["step"]) for r in evals] == [4, 8, 10, 12] and list(evals[0]) == ["step", "loss",
                                                                                 "mae"]


def test_csv_appends_to_a_resumed_run_and_warns_about_a_late_key(tmp_path):
  data = m.regression_data(n=64)
  trainer = _trainer()
  trainer.fit(data, batch_size=16, epochs=1, callbacks=[CSVLogger(tmp_path)])
  with pytest.warns(UserWarning, match=r"\['eval_loss', 'eval_mae'\] are not written"):
    trainer.fit(data, batch_size=16, epochs=2, eval_data=data,
                callbacks=[CSVLogger(tmp_path, append=True)])
  epochs = _read_csv(tmp_path / "epochs.csv")
  assert [r["epoch"] for r in epochs] == ["0", "0"] and "eval_loss" not in epochs[1]
  assert len(_read_csv(tmp_path / "steps.csv")) == 8
  trainer.fit(data, batch_size=16, epochs=3, callbacks=[CSVLogger(tmp_path)])  # a new run
  assert len(_read_csv(tmp_path / "steps.csv")) == 4


def test_json_lines_hold_every_record_in_strict_json(tmp_path):
  data = m.regression_data(n=64)
  trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, **s.QUIET)  # no known rate
  logger = JSONLinesLogger(tmp_path / "sub" / "log.jsonl", every_n_steps=2)
  history = trainer.fit(data, batch_size=16, epochs=2, eval_data=data, eval_every=3,
                        callbacks=[logger])
  with open(tmp_path / "sub" / "log.jsonl", encoding="utf-8") as f:
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(c)) for line in f]
  kinds = [r["kind"] for r in records]
  assert kinds.count("step") == 4 and kinds.count("epoch") == 2 and kinds[-1] == "tuning"
  assert [r["step"] for r in records if r["kind"] == "eval"] == [3, 6]
  steps = [r for r in records if r["kind"] == "step"]
  assert [r["loss"] for r in steps] == history.losses[::2]
  assert "learning_rate" not in steps[0] and all(math.isnan(v) for v in history.learning_rates)
  assert records[-1]["tuning"] == json.loads(json.dumps(history.tuning))
