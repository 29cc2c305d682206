"""BestCheckpoint and Checkpointer(best_metric=...): the best N kept by orbax besides the
latest; the best restored into a fresh model equals the weights of its epoch."""

from __future__ import annotations

import numpy as np
import pytest

from tests.callbacks import support as s
from tunedjax.callbacks import BestCheckpoint
from tunedjax.trainer import Checkpointer, TrainerError


def test_the_best_epochs_are_kept_and_the_best_restores_into_a_fresh_model(tmp_path):
  # score per epoch (3 steps each): the best two are epochs 1 (0.5) and 3 (0.7).
  data = s.ScoredEpochs([2.0, 0.5, 1.5, 0.7, 0.9])
  trainer = s.scored_trainer(checkpoint_dir=tmp_path / "latest", max_checkpoints=1)
  recorder = s.WeightsAtEpochEnd()
  best = BestCheckpoint(tmp_path / "best", monitor="score", keep=2)
  trainer.fit(data, epochs=5, callbacks=[recorder, best])
  assert best.best_step == 6 and best.steps() == [6, 12]
  assert trainer.checkpointer.all_steps() == [15]  # the trainer's latest, as before

  fresh = s.scored_trainer()
  metadata = fresh.restore(best.directory, step=best.best_step)
  assert fresh.step == 6 and metadata["data"] == {"kind": "iterable", "epoch": 1, "index": 3}
  s.assert_bitwise_equal(fresh.variables, recorder.weights[1])
  assert [e["epoch"] for e in fresh.history.epochs] == [0, 1]
  fresh.restore(best.directory, step=12)
  s.assert_bitwise_equal(fresh.variables, recorder.weights[3])

  again = s.scored_trainer(checkpoint_dir=tmp_path / "latest")
  again.fit(s.ScoredEpochs([1.0]), epochs=5, resume=True)  # restores the latest: nothing to do
  assert again.step == 15
  s.assert_bitwise_equal(again.variables, recorder.weights[4])
  best.close()


def test_mode_max_and_an_epoch_that_cannot_be_among_the_best_is_not_saved(tmp_path):
  data = s.ScoredEpochs([0.3, 0.9, 0.1, 0.2])
  best = BestCheckpoint(tmp_path / "best", monitor="score", mode="max")
  trainer = s.scored_trainer()
  trainer.fit(data, epochs=4, callbacks=[best])
  assert best.steps() == [6] and best.best_step == 6
  assert sorted(p.name for p in best.directory.iterdir() if p.name.isdigit()) == ["6"]
  best.close()


def test_best_checkpoint_needs_its_own_folder_and_checks_its_options(tmp_path):
  trainer = s.scored_trainer(checkpoint_dir=tmp_path)
  with pytest.raises(TrainerError, match="is the Trainer's checkpoint_dir"):
    trainer.fit(s.ScoredEpochs([1.0]), epochs=1, callbacks=[BestCheckpoint(tmp_path)])
  with pytest.raises(TrainerError, match="keep must be an int >= 1, got 0"):
    BestCheckpoint(tmp_path / "b", keep=0)
  with pytest.raises(TrainerError, match="mode must be 'min' or 'max'"):
    BestCheckpoint(tmp_path / "b", mode="best")


def test_checkpointer_keeps_the_best_n_besides_the_latest_n_and_restores_the_latest(tmp_path):
  values = {1: 5.0, 2: 1.0, 3: 3.0, 4: 0.5, 5: 4.0, 6: 2.0}
  with Checkpointer(tmp_path, max_to_keep=1, best_metric="eval_loss", keep_best=2) as ckpt:
    for step, value in values.items():
      ckpt.save(step, {"w": np.full(2, step, np.float32)}, metrics={"eval_loss": value})
    ckpt.save(7, {"w": np.full(2, 7, np.float32)})  # no metrics: kept as the latest only
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4, 7] and ckpt.best_step() == 4
    state, _ = ckpt.restore()
    assert state["w"].tolist() == [7.0, 7.0]
    with pytest.raises(ValueError, match=r"no 'eval_loss' \(the best_metric\); it has \['acc'\]"):
      ckpt.save(8, {"w": np.zeros(2)}, metrics={"acc": 1.0})
  with Checkpointer(tmp_path, max_to_keep=1, best_metric="eval_loss", keep_best=2) as ckpt:
    assert ckpt.best_step() == 4  # orbax read the metrics back from the folder
  with pytest.raises(ValueError, match=r"best_mode must be 'min' or 'max', got 'low'"):
    Checkpointer(tmp_path, best_metric="eval_loss", best_mode="low")
  with pytest.raises(ValueError, match="max_to_keep .* must be an int >= 1"):
    Checkpointer(tmp_path, max_to_keep=0)
