"""`route_layer_norm`: Flax's LayerNorm layers on the layer_norm family, equal to Flax's own."""

from __future__ import annotations

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import tunedjax as tj
from tunedjax import autotune, ops
from tunedjax.ops.layer_norm import _flax as _ln_flax


def _config(tmp_path, kernel):
  return {"kernel": {"enable": True, "hints": {"layer_norm": kernel}},
          "cache": {"dir": str(tmp_path)}}


def _ln_sites(f):
  """{(kernel, why): how many layer_norm sites} of `f`'s last trace."""
  return {(c.kernel, c.why): c.count
          for c in f.report(memory=False).last.kernel_report.of("layer_norm")}


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _assert_trees_close(got, want, bound, what):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree_util.tree_leaves_with_path(want)
  assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves], what  # same tree
  for (path, g), (_, w) in zip(got_leaves, want_leaves):
    assert g.shape == w.shape and g.dtype == w.dtype, (what, path)
    assert _rel(g, w) < bound, (what, jax.tree_util.keystr(path), _rel(g, w))


class NnxNet(nnx.Module):
  def __init__(self, rngs, **norm2):
    self.up = nnx.Linear(6, 16, rngs=rngs)
    self.norm1 = nnx.LayerNorm(16, rngs=rngs)
    self.norm2 = nnx.LayerNorm(16, epsilon=1e-3, **({"use_scale": False} | norm2), rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.norm1(self.up(x)))
    return self.head(self.norm2(h + x.sum(-1, keepdims=True)))


def _nnx_problem(rng, **norm2):
  graphdef, params = nnx.split(NnxNet(nnx.Rngs(0), **norm2))
  key = iter(jax.random.split(jax.random.key(1), 64))
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(key), p.shape), params)
  x = jnp.asarray(rng.normal(size=(3, 5, 6)) * 2.0 + 0.5, jnp.float32)
  y = jnp.asarray(rng.integers(0, 4, size=(3, 5)), jnp.int32)

  def loss(params, x, y):
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return jax.value_and_grad(loss), (params, x, y)


@pytest.mark.parametrize("kernel", ["fused", "native"])
def test_nnx_layer_norm_routed_equals_flax(rng, tmp_path, kernel):
  spec = ops.layer_norm.LayerNormSpec((3, 5, 16), "float32")
  if not [k for k in autotune.kernels("layer_norm") if k.name == kernel
          and k.applicable(spec, "cpu")]:
    pytest.skip(f"{kernel} is not applicable here (no native library?)")
  step, args = _nnx_problem(rng)
  want_loss, want_grads = jax.jit(step)(*args)
  with tj.config_context(_config(tmp_path, kernel)):
    f = tj.jit(ops.layer_norm.route_layer_norm()(step), session=autotune.TuningSession())
    loss, grads = f(*args)
  assert _ln_sites(f) == {(kernel, "hint"): 2}  # norm1 and norm2
  assert _rel(loss, want_loss) < 1e-5
  _assert_trees_close(grads, want_grads, 1e-4, "gradients")


def test_nnx_outside_kernel_selection_is_flax_itself(rng):
  step, args = _nnx_problem(rng)
  want = jax.jit(step)(*args)
  got = jax.jit(ops.layer_norm.route_layer_norm()(step))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("norm2", [{"reduction_axes": (-2, -1), "feature_axes": -1},
                                   {"dtype": jnp.bfloat16}, {"param_dtype": jnp.float64}])
def test_nnx_calls_the_family_does_not_cover_run_flax(rng, tmp_path, norm2):
  with jax.enable_x64("param_dtype" in norm2):  # float64 stays float64: Flax's code
    step, args = _nnx_problem(rng, **norm2)
    want = jax.jit(step)(*args)
    with tj.config_context(_config(tmp_path, "fused")):
      f = tj.jit(ops.layer_norm.route_layer_norm()(step), session=autotune.TuningSession())
      got = f(*args)
  # norm1 only; with x64 on, the perturbed parameters are float64 too: neither layer
  assert _ln_sites(f) == ({} if "param_dtype" in norm2 else {("fused", "hint"): 1})
  _assert_trees_close(got, want, 1e-5, "value and gradients")


def test_a_masked_call_runs_flax(rng, tmp_path):
  ln = nnx.LayerNorm(8, rngs=nnx.Rngs(0))
  x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
  mask = jnp.asarray(rng.random((4, 8)) > 0.3)
  with tj.config_context(_config(tmp_path, "fused")):
    g = tj.jit(ops.layer_norm.route_layer_norm()(lambda x, m: ln(x, mask=m)),
               session=autotune.TuningSession())
    np.testing.assert_array_equal(g(x, mask), jax.jit(lambda x, m: ln(x, mask=m))(x, mask))
  assert not _ln_sites(g)


def test_the_wrapper_is_removed_on_exit_and_other_threads_are_not_routed(rng, tmp_path):
  original = nnx.LayerNorm.__call__
  x = jnp.asarray(rng.normal(size=(4, 5, 3)), jnp.float32)
  seen = []

  def ln(x):
    return nnx.LayerNorm(3, rngs=nnx.Rngs(0))(x)

  def other_thread():  # under kernel selection (select_kernels: no routes), outside the context
    with tj.config_context(_config(tmp_path, "fused")):
      reports = []
      autotune.select_kernels(ln, session=autotune.TuningSession(), on_report=reports.append)(x)
      seen.append({(c.kernel, c.why): c.count for c in reports[-1].of("layer_norm")})

  with ops.layer_norm.route_layer_norm():
    assert nnx.LayerNorm.__call__ is not original
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    with tj.config_context(_config(tmp_path, "fused")):
      g = tj.jit(ln, session=autotune.TuningSession())
      g(x)
      assert _ln_sites(g) == {("fused", "hint"): 1}
  assert nnx.LayerNorm.__call__ is original
  assert seen == [{}]


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(nn.Dense(16)(x))
    h = nn.LayerNorm(use_bias=False, epsilon=1e-3)(jnp.tanh(h))
    h = nn.LayerNorm(reduction_axes=(-2, -1))(h)  # not the last axis alone: Flax's code
    return nn.Dense(4)(h)


def test_linen_layer_norm_routed_equals_flax(rng, tmp_path):
  model = LinenNet()
  x = jnp.asarray(rng.normal(size=(3, 5, 6)) * 2.0 + 0.5, jnp.float32)
  y = jnp.asarray(rng.integers(0, 4, size=(3, 5)), jnp.int32)
  variables = model.init(jax.random.key(0), x)
  with tj.config_context(_config(tmp_path, "fused")):  # initialisation: Flax's own
    routed_init = tj.jit(ops.layer_norm.route_layer_norm()(model.init),
                         session=autotune.TuningSession())(jax.random.key(0), x)
  _assert_trees_close(routed_init, variables, 1e-7, "initial variables")
  key = iter(jax.random.split(jax.random.key(1), 64))
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(key), p.shape),
                        variables["params"])

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": params}, x), y).mean()

  step = jax.value_and_grad(loss)
  want_loss, want_grads = jax.jit(step)(params, x, y)
  with tj.config_context(_config(tmp_path, "fused")):
    f = tj.jit(ops.layer_norm.route_layer_norm()(step), session=autotune.TuningSession())
    got_loss, got_grads = f(params, x, y)
  assert _ln_sites(f) == {("fused", "hint"): 2}
  assert _rel(got_loss, want_loss) < 1e-5
  _assert_trees_close(got_grads, want_grads, 1e-4, "gradients")


def test_trainer_routes_layer_norm_and_matches_the_untuned_trainer(rng, tmp_path):
  x = (rng.normal(size=(16, 5, 6)) * 2.0 + 0.5).astype(np.float32)
  y = rng.integers(0, 4, size=(16, 5)).astype(np.int32)

  def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

  def train(autotune_option):
    trainer = tj.Trainer(NnxNet(nnx.Rngs(0)), optax.sgd(0.1), loss_fn,
                         autotune=autotune_option, progress=False)
    trainer.fit((x, y), batch_size=8, epochs=1)  # the same seed: the same batches
    return trainer

  tuned = train(_config(tmp_path, "fused"))
  plain = train(False)
  assert _ln_sites(tuned._programs.train_step) == {("fused", "hint"): 2}
  _assert_trees_close(nnx.state(tuned.model), nnx.state(plain.model), 1e-4,
                      "model after two steps")
  assert _rel(tuned.history.losses, plain.history.losses) < 1e-5


def test_route_layer_norm_is_in_the_public_api():
  assert ops.layer_norm.route_layer_norm is _ln_flax.route_layer_norm
  assert ops.layer_norm.layer_norm.__module__ == "tunedjax.ops.layer_norm._family"
  from tunedjax.autotune import _routes  # pylint: disable=import-outside-toplevel
  assert "layer_norm" in _routes.route_names()
