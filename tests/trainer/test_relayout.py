"""Convolution kernels stored in the layout their convolutions run in, between steps.

An NCHW model (OIHW kernels, as a PyTorch port) trained with the layout pass
on: the Trainer keeps the kernels (and their optimizer state) as HWIO, so no
step transposes them; the model, `variables`, `predict`, `evaluate` and the
checkpoints see the original layout, with the values of a run that does not
re-lay.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

from tunedjax import rewrite
from tunedjax.trainer import Trainer, _relayout
from tunedjax.trainer._checkpoint import Checkpointer

LAYOUT_ON = {"layout": {"enable": True}}
NCHW = ("NCHW", "OIHW", "NCHW")


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NCHW)


class NchwCNN(nnx.Module):
  """Two 3x3 convolutions written NCHW with OIHW kernels, then a dense head."""

  def __init__(self, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.w1 = nnx.Param(jnp.asarray(rng.normal(size=(8, 3, 3, 3)) * 0.3, jnp.float32))
    self.w2 = nnx.Param(jnp.asarray(rng.normal(size=(6, 8, 3, 3)) * 0.2, jnp.float32))
    self.head = nnx.Linear(6, 1, rngs=nnx.Rngs(seed))

  def __call__(self, x):
    h = jax.nn.relu(_conv(x, self.w1[...]))
    h = jax.nn.relu(_conv(h, self.w2[...]))
    return self.head(h.mean((2, 3)))[:, 0]


def loss_fn(model, batch):
  return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _data(n: int = 64, seed: int = 1) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3, 6, 6)).astype(np.float32)
  y = (x.mean((1, 2, 3)) * 3 + 0.1 * rng.normal(size=n)).astype(np.float32)
  return {"x": x, "y": y}


def _trainer(optimizer=None, **kwargs) -> Trainer:
  options = {"autotune": LAYOUT_ON, "progress": False, **kwargs}
  return Trainer(NchwCNN(), optimizer or optax.sgd(0.05, momentum=0.9), loss_fn, **options)


@pytest.fixture
def no_relayout(monkeypatch):
  """Trainers made inside run without storing kernels re-laid (the reference)."""
  def off():
    monkeypatch.setattr(_relayout, "plan", lambda *args, **kwargs: None)
  return off


def _kernel(trainer: Trainer, name: str) -> jax.Array:
  return trainer.state.params[name][...]


@pytest.mark.parametrize("optimizer, mirrors", [
    (optax.sgd(0.05, momentum=0.9), 2),       # one momentum leaf per kernel
    (optax.adamw(1e-2), 4),                   # mu and nu
])
def test_kernels_are_stored_relaid_and_the_user_sees_the_original(optimizer, mirrors,
                                                                  monkeypatch):
  data = _data()
  relaid = _trainer(optimizer)
  history = relaid.fit(data, batch_size=16, epochs=2)
  summary = history.tuning[_relayout.KEY]
  assert summary["target"] == "NHWC" and summary["weights"] == 2
  assert summary["optimizer_leaves"] == mirrors
  assert _kernel(relaid, "w1").shape == (3, 3, 3, 8)  # HWIO between steps
  assert _kernel(relaid, "w1").sharding.is_fully_replicated  # still on all 8 devices

  monkeypatch.setattr(_relayout, "plan", lambda *args, **kwargs: None)
  plain = _trainer(optimizer)
  expected = plain.fit(data, batch_size=16, epochs=2)
  assert _relayout.KEY not in expected.tuning
  assert _kernel(plain, "w1").shape == (8, 3, 3, 3)

  # Losses: the same program up to where XLA puts the transposes; float32 rounding only.
  np.testing.assert_allclose(history.losses, expected.losses, rtol=1e-5, atol=1e-7)
  for name in ("w1", "w2"):
    got, want = getattr(relaid.model, name)[...], getattr(plain.model, name)[...]
    assert got.shape == want.shape  # the user's model keeps OIHW
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(relaid.variables["params"][name][...], want,
                               rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(relaid.predict(data["x"]), plain.predict(data["x"]),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(relaid.evaluate(data)["loss"], plain.evaluate(data)["loss"],
                             rtol=1e-5)


def _input_transposes(closed, inputs) -> int:
  """Transposes in `closed` (any depth) that read one of the top-level `inputs`."""
  wanted = {id(v) for v in inputs}
  return sum(1 for e in rewrite.iter_equations(closed)
             if e.primitive.name == "transpose" and id(e.invars[0]) in wanted)


def test_no_step_transposes_a_stored_kernel(no_relayout):
  data = _data()
  batch = {k: v[:16] for k, v in data.items()}
  relaid = _trainer()
  relaid.fit(data, batch_size=16, steps=1)
  no_relayout()
  plain = _trainer()
  plain.fit(data, batch_size=16, steps=1)
  counts = {}
  for name, t in (("relaid", relaid), ("plain", plain)):
    t.predict(batch["x"])
    with t._running():  # the trainer's config: the layout pass on
      step = t._programs.train_step.jaxpr(t.state, t.placement.put(batch))
      predict = t._programs.predictors[None].jaxpr(t.state, t.placement.put(batch["x"]))
    kernels = [step.jaxpr.invars[i] for i in (2, 3)]  # params: head bias, head kernel, w1, w2
    assert [v.aval.ndim for v in kernels] == [4, 4]
    counts[name] = (_input_transposes(step, kernels),
                    rewrite.count_primitives(predict)["transpose"])
  # Plain: each kernel is transposed to HWIO at every call (forward; the step's
  # backward reuses it); the prediction also transposes its input batch.
  assert counts["plain"] == (2, 3)
  assert counts["relaid"] == (0, 1)  # the input batch only


def test_checkpoint_of_relaid_kernels_restores_bitwise_in_the_original_layout(tmp_path):
  data = _data()
  trainer = _trainer(optax.adam(1e-2), checkpoint_dir=tmp_path)
  trainer.fit(data, batch_size=16, epochs=1)
  assert _kernel(trainer, "w1").shape == (3, 3, 3, 8)
  logical = trainer._programs.logical(trainer.state)

  # On disk: the original layout (what any reader of the checkpoint expects).
  restored, _ = Checkpointer(tmp_path).restore()
  assert restored["params"]["w1"]["value"].shape == (8, 3, 3, 3)
  for a, b in zip(jax.tree_util.tree_leaves(logical.params),
                  jax.tree_util.tree_leaves(restored["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Into a fresh model (original layout) through a new Trainer: bitwise.
  model = NchwCNN(seed=5)
  copy = shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-copy")
  fresh = Trainer(model, optax.adam(1e-2), loss_fn, autotune=LAYOUT_ON, progress=False,
                  checkpoint_dir=copy)
  fresh.restore()
  for name in ("w1", "w2"):
    assert getattr(model, name)[...].shape == getattr(trainer.model, name)[...].shape
    np.testing.assert_array_equal(np.asarray(getattr(model, name)[...]),
                                  np.asarray(getattr(trainer.model, name)[...]))
  for a, b in zip(jax.tree_util.tree_leaves(fresh.state), jax.tree_util.tree_leaves(logical)):
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a), np.asarray(jax.random.key_data(b) if
        jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key) else b))

  # Training on from it re-lays again and continues as the original trainer does.
  more = trainer.fit(data, batch_size=16, epochs=2, resume=True).losses[-4:]
  again = fresh.fit(data, batch_size=16, epochs=2, resume=True).losses[-4:]
  assert _kernel(fresh, "w1").shape == (3, 3, 3, 8)
  assert again == more  # bitwise: the same program on the same state

  # And a trainer that already stores re-laid kernels restores into that storage.
  trainer.restore(tmp_path, step=4)
  assert _kernel(trainer, "w1").shape == (3, 3, 3, 8)
  np.testing.assert_array_equal(np.asarray(trainer.model.w1[...]),
                                np.asarray(restored["params"]["w1"]["value"]))


def test_multi_step_scan_keeps_the_kernels_stored(no_relayout):
  data = _data()
  relaid = _trainer(steps_per_execution=2)
  losses = relaid.fit(data, batch_size=16, epochs=2).losses
  assert _kernel(relaid, "w2").shape == (3, 3, 8, 6)
  no_relayout()
  plain = _trainer(steps_per_execution=2)
  np.testing.assert_allclose(losses, plain.fit(data, batch_size=16, epochs=2).losses,
                             rtol=1e-5, atol=1e-7)


def test_nothing_is_relaid_without_the_layout_pass_or_for_an_nhwc_model():
  data = _data()
  off = _trainer(autotune=False)
  assert _relayout.KEY not in off.fit(data, batch_size=16, steps=2).tuning
  assert _kernel(off, "w1").shape == (8, 3, 3, 3)

  class NhwcCNN(nnx.Module):
    def __init__(self):
      self.conv = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))  # HWIO: already NHWC's

    def __call__(self, x):
      return self.conv(x.transpose(0, 2, 3, 1)).mean((1, 2, 3))

  nhwc = Trainer(NhwcCNN(), optax.sgd(0.1), loss_fn, autotune=LAYOUT_ON, progress=False)
  assert _relayout.KEY not in nhwc.fit(data, batch_size=16, steps=2).tuning


def test_weight_layout_round_trips_and_plan_reads_the_layout_report(rng):
  layout = _relayout.WeightLayout({1: (2, 3, 1, 0)}, target="NHWC", weights=("w",))
  tree = [jnp.asarray(rng.normal(size=(3,)), jnp.float32),
          jnp.asarray(rng.normal(size=(5, 4, 3, 2)), jnp.float32)]
  stored = layout.to_stored(tree)
  assert stored[1].shape == (3, 2, 4, 5)
  np.testing.assert_array_equal(layout.to_logical(stored)[1], tree[1])
  assert [s.shape for s in layout.logical_abstract(stored)] == [(3,), (5, 4, 3, 2)]
  step = layout.wrap_step(lambda s, b: ([s[0] + b, s[1] * 2.0], s[1].sum()))
  new, out = jax.jit(step)(stored, 1.0)
  np.testing.assert_allclose(layout.to_logical(new)[1], tree[1] * 2.0)
  np.testing.assert_allclose(out, tree[1].sum(), rtol=1e-5)


def test_a_model_without_kernel_shaped_parameters_is_not_traced(monkeypatch):
  import tunedjax as tj
  from tests.trainer import models as m
  trainer = Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, autotune=LAYOUT_ON,
                    progress=False)
  monkeypatch.setattr(_relayout._pipeline, "plan", lambda *a, **k: pytest.fail("traced"))
  batch = {k: v[:16] for k, v in m.regression_data().items()}
  with tj.config_context(trainer.config):
    assert _relayout.plan(lambda *a: 0.0, trainer.state, batch, trainer.config) is None
