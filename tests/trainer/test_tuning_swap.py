"""Kernel tuning inside a fit: the tuned program swapped in at a step boundary.

With ``kernel.tuning_range = [start, end]`` and no loader to tune first, the
Trainer's steps before ``start`` run the observe phase's program (every
convolution on xla), and step ``start`` swaps in the tuned program. The
training must not notice beyond float32 rounding: same losses, same state.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tunedjax.trainer import Trainer

STEPS = 6


def _model():
  return nnx.Sequential(
      nnx.Conv(3, 8, (3, 3), rngs=nnx.Rngs(0)), nnx.relu,
      nnx.Conv(8, 8, (3, 3), feature_group_count=8, rngs=nnx.Rngs(1)), nnx.relu,
      nnx.Conv(8, 4, (1, 1), rngs=nnx.Rngs(2)))


def _loss(model, batch):
  return ((model(batch["x"]).mean(axis=(1, 2, 3)) - batch["y"]) ** 2).mean()


def _data():
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(16 * STEPS, 12, 12, 3)).astype(np.float32),
          "y": rng.normal(size=(16 * STEPS,)).astype(np.float32)}


def _fit(autotune, cache_dir):
  config = {
      **autotune, "cache": {"dir": str(cache_dir)}, "dataloader": {"enable": False},
      "layout": {"enable": False}, "mixed_precision": {"enable": False}}
  trainer = Trainer(_model(), optax.sgd(0.05, momentum=0.9), _loss, autotune=config,
                    progress=False, seed=0)
  history = trainer.fit(_data(), batch_size=16, steps=STEPS)
  params = [np.asarray(x) for x in
            jax.tree_util.tree_leaves(nnx.state(trainer.model, nnx.Param))]
  return history, params, trainer


@pytest.mark.slow
def test_swapping_in_the_tuned_program_at_step_3_trains_like_tuning_before_step_0(tmp_path):
  # payback off: a 6-step fit could not pay back tuning its buckets (they would stay on xla).
  swap = {"kernel": {"enable": True, "tuning_range": [3, 10], "payback": False}}
  early = {"kernel": {"enable": True, "tuning_range": [1, 10], "payback": False}}
  late_history, late_params, late = _fit(swap, tmp_path / "late")
  early_history, early_params, _ = _fit(early, tmp_path / "early")

  # The swap happened: steps 0-2 ran the observe program, the rest a tuned one.
  reports = late._programs.train_step.report(memory=False)
  kinds = [{k.rsplit(" ", 1)[-1] for k in r.kernels} for r in reports]
  assert len(reports) == 2, kinds
  assert kinds[0] == {"(observe)"}, kinds
  assert "(tuned)" in kinds[1], kinds
  chosen = late_history.tuning["kernels"]
  assert any(k.split()[1] != "xla" for k in chosen), chosen  # some kernel really swapped

  # Same losses and weights as tuning before step 0, within float32 rounding
  # (steps 0-2 ran xla's convolutions, which sum in another order).
  np.testing.assert_allclose(late_history.losses, early_history.losses, rtol=2e-4)
  for a, b in zip(late_params, early_params, strict=True):
    scale = max(float(np.abs(b).max()), 1e-3)
    assert float(np.abs(a - b).max()) / scale < 2e-4
  assert not np.allclose(late_history.losses[0], late_history.losses[-1])  # it trained
