"""An Equinox model's train step under tunedjax.jit reaches the attention and batch-norm
families: `eqx.nn.MultiheadAttention` (with a causal mask) and a batch norm written by
hand are found in the jaxpr, forward and backward, and the step equals plain JAX's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj

eqx = pytest.importorskip("equinox")

# Non-default kernels, pinned: a site that is found shows them in the report.
HINTS = {"attention": "einsum", "batch_norm": "fused"}
B, T, F, C = 4, 8, 6, 16


def batch_norm(x, scale, bias, eps=1e-5):
  """Batch norm over every axis but the last, two-pass, as tutorials write it."""
  axes = tuple(range(x.ndim - 1))
  mean = jnp.mean(x, axis=axes, keepdims=True)
  var = jnp.mean((x - mean) ** 2, axis=axes, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


class Model(eqx.Module):
  proj: eqx.nn.Linear
  attn: eqx.nn.MultiheadAttention
  head: eqx.nn.Linear
  scale: jax.Array
  bias: jax.Array

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.proj = eqx.nn.Linear(F, C, key=k1)
    self.attn = eqx.nn.MultiheadAttention(num_heads=2, query_size=C, key=k2)
    self.head = eqx.nn.Linear(C, 3, key=k3)
    self.scale = 1.0 + 0.1 * jnp.arange(C, dtype=jnp.float32)
    self.bias = 0.05 * jnp.arange(C, dtype=jnp.float32)

  def __call__(self, x):
    h = jax.vmap(jax.vmap(self.proj))(x)
    h = jax.nn.gelu(batch_norm(h, self.scale, self.bias))
    mask = jnp.tril(jnp.ones((T, T), bool))
    h = h + jax.vmap(lambda s: self.attn(s, s, s, mask=mask))(h)
    return jax.vmap(self.head)(h.mean(1))


def _problem():
  model = Model(jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(B, T, F)) * 1.5 + 0.2, jnp.float32)
  y = jnp.asarray(rng.integers(0, 3, size=B), jnp.int32)

  def loss(params, x, y):
    logits = eqx.combine(params, static)(x)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(B), y])

  def step(params, x, y):  # an SGD train step
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  return step, (params, x, y)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-3))


def test_equinox_step_reaches_attention_and_batch_norm(tmp_path):
  step, args = _problem()
  want = jax.jit(step)(*args)
  with tj.config_context({"kernel": {"enable": True, "hints": HINTS},
                          "cache": {"dir": str(tmp_path)}}):
    f = tj.jit(step)
    got = f(*args)
  report = f.report(memory=False).last.kernel_report
  matched = sorted((m.op, m.kernel, m.replaced) for m in report.matched)
  assert matched == [("attention", "einsum", "forward+backward"),
                     ("batch_norm", "fused", "forward+backward")], str(report)
  assert [(c.kernel, c.why) for c in report.of("attention")] == [("einsum", "hint")]
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert _rel(g, w) < 1e-4
