"""`route_batch_norm`: Flax's BatchNorm layers on the batch_norm family, equal to Flax's own."""

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
from tunedjax.ops.batch_norm import _flax as _bn_flax

# conv on xla everywhere, so that no convolution bucket is tuned in these tests
HINTS = {"conv": "xla"}


def _config(tmp_path, bn_kernel):
  return {"kernel": {"enable": True, "hints": {**HINTS, "batch_norm": bn_kernel}},
          "cache": {"dir": str(tmp_path)}}


def _bn_sites(f):
  """{(kernel, why): how many batch_norm sites} of `f`'s last trace."""
  return {(c.kernel, c.why): c.count
          for c in f.report(memory=False).last.kernel_report.of("batch_norm")}


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _assert_trees_close(got, want, bound, what):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree_util.tree_leaves_with_path(want)
  assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves], what  # same state tree
  for (path, g), (_, w) in zip(got_leaves, want_leaves):
    assert g.shape == w.shape and g.dtype == w.dtype, (what, path)
    assert _rel(g, w) < bound, (what, jax.tree_util.keystr(path), _rel(g, w))


class NnxNet(nnx.Module):
  def __init__(self, rngs, axis=-1):
    self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)  # a bias before BN: grad 0
    self.bn1 = nnx.BatchNorm(8 if axis == -1 else 7, momentum=0.9, rngs=rngs, axis=axis)
    self.bn2 = nnx.BatchNorm(8, epsilon=1e-3, use_scale=False, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.bn1(self.conv(x)))
    h = jnp.tanh(self.bn2(h))
    return self.head(h.mean((1, 2)))


def _nnx_problem(rng, **kw):
  model = NnxNet(nnx.Rngs(0), **kw)
  # Non-trivial parameters and running averages, so every term of the update shows.
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  key = iter(jax.random.split(jax.random.key(1), 64))
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(key), p.shape), params)
  stats = jax.tree.map(lambda s: s + jax.random.uniform(next(key), s.shape), stats)
  x = jnp.asarray(rng.normal(size=(6, 7, 7, 3)) * 2.0 + 0.5, jnp.float32)
  y = jnp.asarray(rng.integers(0, 4, size=6), jnp.int32)

  def loss(params, stats, x, y):
    m = nnx.merge(graphdef, params, stats, copy=True)
    logits = m(x)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
            nnx.state(m, nnx.BatchStat))

  return jax.value_and_grad(loss, has_aux=True), (params, stats, x, y)


@pytest.mark.parametrize("bn_kernel", ["fused", "xla"])
def test_nnx_batch_norm_routed_equals_flax(rng, tmp_path, bn_kernel):
  step, args = _nnx_problem(rng)
  (want_loss, want_stats), want_grads = jax.jit(step)(*args)
  with tj.config_context(_config(tmp_path, bn_kernel)):
    f = tj.jit(ops.batch_norm.route_batch_norm()(step), session=autotune.TuningSession())
    (loss, stats), grads = f(*args)
  assert _bn_sites(f) == {(bn_kernel, "hint"): 2}  # bn1 and bn2
  assert _rel(loss, want_loss) < 1e-5
  _assert_trees_close(stats, want_stats, 1e-5, "running averages")
  _assert_trees_close(grads, want_grads, 2e-4, "gradients")
  # The running averages moved (the batch's statistics are not the stored ones).
  assert _rel(stats["bn1"]["mean"][...], args[1]["bn1"]["mean"][...]) > 1e-2


def test_nnx_outside_kernel_selection_is_flax_itself(rng):
  step, args = _nnx_problem(rng)
  want = jax.jit(step)(*args)
  got = jax.jit(ops.batch_norm.route_batch_norm()(step))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


def test_nnx_calls_the_family_does_not_cover_run_flax(rng, tmp_path):
  # A feature axis other than the last (bn1), and evaluation on running averages.
  step, args = _nnx_problem(rng, axis=1)
  with tj.config_context(_config(tmp_path, "fused")):
    f = tj.jit(ops.batch_norm.route_batch_norm()(step), session=autotune.TuningSession())
    f(*args)
    assert _bn_sites(f) == {("fused", "hint"): 1}  # bn2 only
    bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0), use_running_average=True)
    x = jnp.asarray(rng.normal(size=(4, 5, 3)), jnp.float32)
    g = tj.jit(ops.batch_norm.route_batch_norm()(lambda x: bn(x)), session=autotune.TuningSession())
    np.testing.assert_array_equal(g(x), x / np.sqrt(1 + 1e-5, dtype=np.float32))
    assert not _bn_sites(g)


def test_the_wrapper_is_removed_on_exit_and_other_threads_are_not_routed(rng, tmp_path):
  original = nnx.BatchNorm.__call__
  x = jnp.asarray(rng.normal(size=(4, 5, 3)), jnp.float32)
  seen = []

  def bn(x):
    return nnx.BatchNorm(3, rngs=nnx.Rngs(0))(x, use_running_average=False)

  def other_thread():  # under kernel selection (select_kernels: no routes), outside the context
    with tj.config_context(_config(tmp_path, "fused")):
      reports = []
      autotune.select_kernels(bn, session=autotune.TuningSession(), on_report=reports.append)(x)
      seen.append({(c.kernel, c.why): c.count for c in reports[-1].of("batch_norm")})

  with ops.batch_norm.route_batch_norm():
    assert nnx.BatchNorm.__call__ is not original
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    with tj.config_context(_config(tmp_path, "fused")):
      g = tj.jit(bn, session=autotune.TuningSession())
      g(x)
      assert _bn_sites(g) == {("fused", "hint"): 1}
  assert nnx.BatchNorm.__call__ is original
  assert seen == [{}]


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Conv(8, (3, 3), use_bias=False)(x)
    h = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.8)(h))
    h = nn.BatchNorm(use_running_average=not train, use_bias=False, epsilon=1e-3)(h)
    return nn.Dense(4)(jnp.tanh(h).mean((1, 2)))


def test_linen_batch_norm_routed_equals_flax(rng, tmp_path):
  model = LinenNet()
  x = jnp.asarray(rng.normal(size=(6, 7, 7, 3)) * 2.0 + 0.5, jnp.float32)
  y = jnp.asarray(rng.integers(0, 4, size=6), jnp.int32)
  variables = model.init(jax.random.key(0), x)
  key = iter(jax.random.split(jax.random.key(1), 64))
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(key), p.shape),
                        variables["params"])
  stats = jax.tree.map(lambda s: s + jax.random.uniform(next(key), s.shape),
                       variables["batch_stats"])

  def loss(params, stats, x, y):
    logits, new = model.apply({"params": params, "batch_stats": stats}, x,
                              mutable=["batch_stats"])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
            new["batch_stats"])

  step = jax.value_and_grad(loss, has_aux=True)
  (want_loss, want_stats), want_grads = jax.jit(step)(params, stats, x, y)
  with tj.config_context(_config(tmp_path, "fused")):
    f = tj.jit(ops.batch_norm.route_batch_norm()(step), session=autotune.TuningSession())
    (got_loss, got_stats), got_grads = f(params, stats, x, y)
    assert _bn_sites(f) == {("fused", "hint"): 2}
    # Evaluation (running averages) and initialisation: Flax's own code, no site.
    g = tj.jit(ops.batch_norm.route_batch_norm()(
        lambda v, x: model.apply(v, x, train=False)), session=autotune.TuningSession())
    np.testing.assert_allclose(g({"params": params, "batch_stats": stats}, x),
                               model.apply({"params": params, "batch_stats": stats}, x,
                                           train=False), rtol=1e-6, atol=1e-6)
    assert not _bn_sites(g)
  assert _rel(got_loss, want_loss) < 1e-5
  _assert_trees_close(got_stats, want_stats, 1e-5, "running averages")
  _assert_trees_close(got_grads, want_grads, 2e-4, "gradients")


def test_trainer_routes_batch_norm_and_matches_the_untuned_trainer(rng, tmp_path):
  x = (rng.normal(size=(16, 7, 7, 3)) * 2.0 + 0.5).astype(np.float32)
  y = rng.integers(0, 4, size=16).astype(np.int32)

  def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

  def train(autotune_option):
    trainer = tj.Trainer(NnxNet(nnx.Rngs(0)), optax.sgd(0.1), loss_fn,
                         autotune=autotune_option, progress=False)
    trainer.fit((x, y), batch_size=8, epochs=1)  # the same seed: the same batches
    return trainer

  tuned = train(_config(tmp_path, "fused"))
  plain = train(False)
  assert _bn_sites(tuned._programs.train_step) == {("fused", "hint"): 2}
  _assert_trees_close(nnx.state(tuned.model), nnx.state(plain.model), 1e-4,
                      "model after two steps")
  assert _rel(tuned.history.losses, plain.history.losses) < 1e-5


def test_route_batch_norm_is_in_the_public_api():
  assert ops.batch_norm.route_batch_norm is _bn_flax.route_batch_norm
  assert ops.batch_norm.batch_norm.__module__ == "tunedjax.ops.batch_norm._family"
