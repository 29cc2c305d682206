"""The Trainer's data argument: arrays whose rows do not line up (issue 19, item 5)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer import models as m
from tunedjax.trainer import Trainer, TrainerError
from tunedjax.trainer._data import BatchStream

QUIET = {"progress": False, "autotune": False}


@pytest.mark.parametrize("data, shown", [
    ({"x": np.zeros((32, 8)), "y": np.zeros(20)}, "'x': 32, 'y': 20"),
    ((np.zeros((32, 8)), np.zeros(20), np.zeros(32)), "[0]: 32, [1]: 20, [2]: 32"),
])
def test_arrays_with_different_numbers_of_rows_are_named(data, shown):
  with pytest.raises(TrainerError, match="different numbers of rows") as e:
    BatchStream(data, batch_size=8, seed=0)
  assert shown in str(e.value) and "train_data" in str(e.value)


def test_fit_evaluate_and_predict_name_the_mismatched_lengths():
  rng = np.random.default_rng(0)
  data = {"x": rng.normal(size=(32, 8)).astype(np.float32),
          "y": rng.normal(size=20).astype(np.float32)}
  trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, **QUIET)
  with pytest.raises(TrainerError, match=r"train_data .*'x': 32, 'y': 20"):
    trainer.fit(data, batch_size=8, epochs=1)
  with pytest.raises(TrainerError, match=r"'x': 32, 'y': 20"):
    trainer.evaluate(data, batch_size=8)


def test_matching_rows_still_train():
  data = m.regression_data(64)
  stream = BatchStream(data, batch_size=8, seed=0)
  assert stream.steps_per_epoch == 8
  stream.close()
