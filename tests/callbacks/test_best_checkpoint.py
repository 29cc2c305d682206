"""BestCheckpoint: the best N epochs kept by orbax, the trainer's latest kept as before; the
best restored into a fresh model equals the weights of its epoch."""

from __future__ import annotations

import pytest

from tests.callbacks import support as s
from tunedjax.callbacks import BestCheckpoint
from tunedjax.trainer import TrainerError


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
