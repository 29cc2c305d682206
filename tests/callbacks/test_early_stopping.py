"""EarlyStopping: stops at the epoch its rule says, and restores the best weights bitwise."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from tests.callbacks import support as s
from tests.trainer import models as m
from tunedjax.callbacks import EarlyStopping
from tunedjax.trainer import TrainerError


def test_stops_after_patience_epochs_without_improvement_and_restores_the_best_bitwise():
  # score per epoch: best at epoch 2 (1.0); epochs 3 and 4 do not beat it by min_delta
  # (0.95 is within 0.1 of it); patience 2: fit stops after epoch 4, before epoch 5.
  data = s.ScoredEpochs([3.0, 2.0, 1.0, 1.5, 0.95, 0.1, 0.1])
  trainer = s.scored_trainer()
  recorder, stop = s.WeightsAtEpochEnd(), EarlyStopping("score", patience=2, min_delta=0.1)
  history = trainer.fit(data, epochs=7, callbacks=[recorder, stop])
  assert (stop.best_epoch, stop.best, stop.stopped_epoch) == (2, 1.0, 4)
  assert [e["epoch"] for e in history.epochs] == [0, 1, 2, 3, 4]
  np.testing.assert_allclose([e["score"] for e in history.epochs], [3.0, 2.0, 1.0, 1.5, 0.95])
  assert len(history.losses) == 5 * len(data) and trainer.step == 15  # no step of epoch 5
  assert not np.array_equal(recorder.weights[2]["params"]["fc1"]["kernel"],
                            recorder.weights[4]["params"]["fc1"]["kernel"])
  s.assert_bitwise_equal(trainer.variables, recorder.weights[2])
  s.assert_bitwise_equal(nnx.state(trainer.model, nnx.Param), recorder.weights[2]["params"])


def test_mode_max_and_no_restore_keeps_the_last_weights():
  data = s.ScoredEpochs([0.1, 0.5, 0.4, 0.2])
  trainer = s.scored_trainer()
  recorder = s.WeightsAtEpochEnd()
  stop = EarlyStopping("score", mode="max", patience=0, restore_best_weights=False)
  history = trainer.fit(data, epochs=4, callbacks=[recorder, stop])
  assert (stop.best_epoch, stop.stopped_epoch, len(history.epochs)) == (1, 2, 3)
  s.assert_bitwise_equal(trainer.variables, recorder.weights[2])


def test_without_a_stop_the_best_weights_come_back_at_the_end_and_a_new_fit_starts_afresh():
  data = s.ScoredEpochs([2.0, 1.0, 1.5])
  trainer = s.scored_trainer()
  recorder, stop = s.WeightsAtEpochEnd(), EarlyStopping("score", patience=5)
  trainer.fit(data, epochs=3, callbacks=[recorder, stop])
  assert (stop.best_epoch, stop.stopped_epoch) == (1, None)
  s.assert_bitwise_equal(trainer.variables, recorder.weights[1])
  history = trainer.fit(data, epochs=4, callbacks=[stop])  # one epoch more, scoring 1.5
  assert (stop.best_epoch, stop.best) == (history.epochs[-1]["epoch"], 1.5)  # a new best


def test_monitors_eval_loss_at_epoch_ends():
  data = {**m.regression_data(n=64), "score": np.zeros(64, np.float32)}
  trainer = s.scored_trainer()
  stop = EarlyStopping(patience=1)  # "eval_loss"
  history = trainer.fit(s.ScoredEpochs([1.0]), epochs=3, eval_data=data, callbacks=[stop])
  assert stop.best == min(e["eval_loss"] for e in history.epochs)


def test_a_missing_monitor_names_the_entries_there_and_bad_options_are_errors():
  trainer = s.scored_trainer()
  with pytest.raises(TrainerError, match=r"'eval_loss' is not in the logs of epoch 0.*'score'"
                     r".*eval_data"):
    trainer.fit(s.ScoredEpochs([1.0]), epochs=1, callbacks=[EarlyStopping()])
  with pytest.raises(TrainerError, match=r"mode must be 'min' or 'max', got 'least'"):
    EarlyStopping(mode="least")
  with pytest.raises(TrainerError, match="patience must be an int >= 0, got -1"):
    EarlyStopping(patience=-1)
  with pytest.raises(TrainerError, match="min_delta must be a finite number >= 0"):
    EarlyStopping(min_delta=-0.5)
  with pytest.raises(TrainerError, match="monitor must be the name"):
    EarlyStopping(monitor=3)
