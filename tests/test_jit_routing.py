"""tunedjax.jit routes Flax's BatchNorm and attention modules onto their families itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import tunedjax as tj
from tunedjax.autotune import _routes

# Non-default kernels, pinned: a site that reaches its family shows the kernel, untuned.
HINTS = {"conv": "xla", "batch_norm": "fused", "attention": "einsum"}


def _config(tmp_path, enable=True):
  return {"kernel": {"enable": enable, "hints": HINTS}, "cache": {"dir": str(tmp_path)}}


def _sites(f, op):
  return {(c.kernel, c.why): c.count
          for c in f.report(memory=False).last.kernel_report.of(op)}


def _rel(a, b):
  """Relative to the largest element; a gradient that is zero in exact arithmetic (the
  key projection's bias: softmax ignores a shift per query) is compared with 1e-3."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-3))


def _assert_close(got, want, bound):
  for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(got),
                               jax.tree_util.tree_leaves_with_path(want), strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path)
    assert _rel(g, w) < bound, (jax.tree_util.keystr(path), _rel(g, w))


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.proj = nnx.Linear(6, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.gelu(self.bn(self.proj(x)))
    mask = nnx.make_causal_mask(x[..., 0])
    h = h + self.attn(h, mask=mask)
    return self.head(h.mean(1))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    h = jax.nn.gelu(nn.BatchNorm(use_running_average=False, momentum=0.9)(h))
    h = h + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
    return nn.Dense(3)(h.mean(1))


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(4, 8, 6)) * 1.5 + 0.3, jnp.float32)
  y = jnp.asarray(rng.integers(0, 3, size=4), jnp.int32)
  return x, y


def _nnx_step():
  graphdef, params, stats = nnx.split(NnxBlock(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

  def loss(params, stats, x, y):
    m = nnx.merge(graphdef, params, stats, copy=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    return ce, nnx.state(m, nnx.BatchStat)

  return jax.value_and_grad(loss, has_aux=True), (params, stats)


def _linen_step():
  model = LinenBlock()
  x, _ = _data()
  variables = model.init(jax.random.key(0), x)

  def loss(params, stats, x, y):
    logits, new = model.apply({"params": params, "batch_stats": stats}, x,
                              mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

  return jax.value_and_grad(loss, has_aux=True), (variables["params"],
                                                   variables["batch_stats"])


def test_routes_registered_by_the_families():
  assert {"batch_norm", "attention"} <= set(_routes.route_names())


@pytest.mark.parametrize("make", [_nnx_step, _linen_step], ids=["nnx", "linen"])
def test_jit_reaches_batch_norm_and_attention(tmp_path, make):
  step, (params, stats) = make()
  x, y = _data()
  want = jax.jit(step)(params, stats, x, y)
  with tj.config_context(_config(tmp_path)):
    f = tj.jit(step)
    got = f(params, stats, x, y)
  assert _sites(f, "batch_norm") == {("fused", "hint"): 1}
  assert _sites(f, "attention") == {("einsum", "hint"): 1}
  # Routed to tj.attention (nnx's make_causal_mask made the call causal: the pattern has
  # nothing left to find; tests/ops/attention/test_causal_masks.py checks the bucket).
  assert [m for m in f.report(memory=False).last.kernel_report.matched
          if m.op == "attention"] == []
  _assert_close(got, want, 1e-4)  # loss, running averages, every gradient


@pytest.mark.parametrize("make", [_nnx_step, _linen_step], ids=["nnx", "linen"])
def test_no_routing_without_kernel_selection(tmp_path, make):
  step, (params, stats) = make()
  x, y = _data()
  with tj.config_context(_config(tmp_path, enable=False)):
    f = tj.jit(step)
    got = f(params, stats, x, y)
  assert f.report(memory=False).last.kernel_report is None
  _assert_close(got, jax.jit(step)(params, stats, x, y), 1e-6)


def test_routing_leaves_plain_calls_and_classes_alone(tmp_path):
  step, (params, stats) = _nnx_step()
  x, y = _data()
  original = nnx.MultiHeadAttention.__call__
  with tj.config_context(_config(tmp_path)):
    tj.jit(step)(params, stats, x, y)
  assert nnx.MultiHeadAttention.__call__ is original  # the wrapper is gone after the trace
  model = NnxBlock(nnx.Rngs(0))
  assert model.attn.attention_fn is nnx.dot_product_attention  # no module is changed


def test_trainer_swap_keeps_its_record(tmp_path):
  """A linen swap entered around tj.jit (as the Trainer does) records the calls itself."""
  step, (params, stats) = _linen_step()
  x, y = _data()
  swap = tj.use_tuned_attention(LinenBlock())
  with tj.config_context(_config(tmp_path)), swap:
    f = tj.jit(step)
    f(params, stats, x, y)
  assert swap.tuned and _sites(f, "attention") == {("einsum", "hint"): 1}
