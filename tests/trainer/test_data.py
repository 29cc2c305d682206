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


# --- the per-step fast paths (issue 18, item 4) -------------------------------------


def test_a_batch_of_a_new_shape_after_the_cached_check_is_still_checked():
  from tunedjax.trainer._data import BatchChecker
  rng = np.random.default_rng(0)
  batch = lambda n, w=8: {"x": rng.normal(size=(n, w)).astype(np.float32),
                          "y": rng.normal(size=n).astype(np.float32)}
  checker = BatchChecker("train_data")
  for i in range(3):  # the first checks; the next two are found among those that passed
    checker.check(batch(16), i)
  assert len(checker._passed) == 1
  checker.check(batch(8), 3)  # a short batch: a new signature, checked and allowed
  assert len(checker._passed) == 2
  with pytest.raises(TrainerError, match=r"Batch 4 of train_data does not match the first "
                                         r"batch\.\n.*float32\[16, 8\].*\n.*float32\[16, 9\]"):
    checker.check(batch(16, w=9), 4)
  with pytest.raises(TrainerError, match=r"Batch 5 of train_data does not match"):
    checker.check({"x": batch(16)["x"]}, 5)  # another structure
  with pytest.raises(TrainerError, match=r"Batch 6 .* leaves that are not arrays"):
    checker.check({"x": batch(16)["x"], "y": [1.0] * 16}, 6)
  with pytest.raises(TrainerError, match=r"Batch 7 .* leaves that are not arrays"):
    checker.check({"x": batch(16)["x"], "y": np.float32(1.0)}, 7)  # no batch dimension
  assert len(checker._passed) == 2  # what failed is never remembered
  checker.check(batch(16), 8)  # and the first signature still passes


def test_one_device_placement_hands_numpy_batches_to_the_step_and_trains_identically():
  import jax
  from jax.sharding import Mesh

  from tunedjax.trainer._data import Placement

  one = Mesh(np.array(jax.devices()[:1]), ("data",))
  placement = Placement(one)
  host = {"x": np.ones((4, 2), np.float32), "y": np.ones(4, np.float32)}
  assert placement.put(host) is host  # jit transfers it with the step's dispatch
  on_device = placement.put({"x": jax.numpy.ones((4, 2)), "y": np.ones(4, np.float32)})
  assert all(isinstance(v, jax.Array) for v in on_device.values())  # a device array: put
  if jax.device_count() > 1:  # several devices on the mesh: sharded by device_put
    everywhere = Placement(None)
    sharded = everywhere.put({k: np.concatenate([v] * everywhere.shards) for k, v in host.items()})
    assert sharded["x"].sharding == everywhere.batch

  data = m.regression_data(128)

  def train(pass_host: bool) -> Trainer:
    trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, mesh=one, **QUIET)
    trainer.placement._pass_host = pass_host
    trainer.fit(data, batch_size=16, epochs=2)
    return trainer

  fast, put = train(True), train(False)
  assert fast.history.losses == put.history.losses  # bitwise
  for a, b in zip(jax.tree_util.tree_leaves(fast.state), jax.tree_util.tree_leaves(put.state)):
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if
                                             jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                                             else a),
                                  np.asarray(jax.random.key_data(b) if
                                             jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key)
                                             else b))
    assert a.sharding == b.sharding  # the state stays on the mesh
  assert fast._programs.train_step._jitted()._cache_size() == 1  # compiled once for every step
  assert fast.evaluate(data, batch_size=32) == put.evaluate(data, batch_size=32)
