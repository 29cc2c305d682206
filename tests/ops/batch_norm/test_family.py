"""The ``"batch_norm"`` family: kernels against a float64 reference, selection end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tunedjax as tj
from tunedjax import autotune
from tunedjax.ops.batch_norm import _family as _bn_family
from tunedjax.ops.batch_norm import _kernels as _bn_kernels
from tunedjax.ops.batch_norm._spec import BatchNormSpec

KERNELS = [k.name for k in autotune.kernels("batch_norm")]


def _reference64(x, scale, bias, ct, eps):
  """(y, mean, var) and the VJP of their cotangents `ct` (a triple), float64, through JAX's
  autodiff of the plain formula."""
  with jax.enable_x64(True):
    def f(x, scale, bias):
      axes = tuple(range(x.ndim - 1))
      mean = jnp.mean(x, axes)
      var = jnp.mean((x - mean) ** 2, axes)
      return (x - mean) / jnp.sqrt(var + eps) * scale + bias, mean, var
    args = [jnp.asarray(a, jnp.float64) for a in (x, scale, bias)]
    outs, vjp = jax.vjp(f, *args)
    grads = vjp(tuple(jnp.asarray(c, jnp.float64) for c in ct))
    return [np.asarray(o) for o in outs], [np.asarray(g) for g in grads]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _draw(rng, shape, offset):
  c = shape[-1]
  x = rng.normal(size=shape) * (0.5 + rng.random(c)) + offset * rng.normal(size=c)
  ct = tuple(rng.normal(size=s).astype(np.float32) for s in (shape, (c,), (c,)))
  return (x.astype(np.float32), rng.normal(size=c).astype(np.float32),
          rng.normal(size=c).astype(np.float32), ct)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=5, deadline=None)
@given(shape=st.tuples(st.integers(4, 8), st.integers(2, 5), st.integers(2, 5),
                       st.integers(1, 9)),
       offset=st.sampled_from([0.0, 3.0, 30.0]), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-5, 1e-3]))
def test_kernel_matches_float64_forward_and_gradient(kernel, shape, offset, seed, eps):
  rng = np.random.default_rng(seed)
  x, scale, bias, ct = _draw(rng, shape, offset)
  spec = BatchNormSpec.from_arrays(x, epsilon=eps)
  fn = autotune.kernels("batch_norm")[KERNELS.index(kernel)].fn
  outs, vjp = jax.vjp(lambda *a: fn(*a, spec), jnp.asarray(x), jnp.asarray(scale),
                      jnp.asarray(bias))
  want_outs, want_grads = _reference64(x, scale, bias, ct, eps)
  for name, got, want in zip(("y", "mean", "var"), outs, want_outs):
    assert _rel(got, want) < 2e-5, name
  # The output's cotangent alone (as a loss of y only gives), then all three: the
  # statistics' cotangents (Flax's running averages, if differentiated) reach dx too.
  only_y = (ct[0], np.zeros_like(ct[1]), np.zeros_like(ct[2]))
  for cts in (only_y, ct):
    grads = vjp(tuple(jnp.asarray(c) for c in cts))
    want_grads = _reference64(x, scale, bias, cts, eps)[1]
    for name, got, want in zip(("dx", "dscale", "dbias"), grads, want_grads):
      assert _rel(got, want) < 2e-4, name  # float32 against float64, >= 16 rows


def test_a_large_mean_does_not_cancel_the_variance(rng):
  # mean 1e3, spread 1e-1: E[x^2] - E[x]^2 without the shift loses every digit in float32.
  x = (1e3 + 0.1 * rng.normal(size=(16, 4, 4, 8))).astype(np.float32)
  scale, bias = np.ones(8, np.float32), np.zeros(8, np.float32)
  spec = BatchNormSpec.from_arrays(x)
  want, _ = _reference64(x, scale, bias, (x, scale, scale), 1e-5)
  y, _, var = _bn_kernels.fused(x, scale, bias, spec)
  assert _rel(y, want[0]) < 1e-3 and _rel(var, want[2]) < 1e-3


def test_outside_kernel_selection_batch_norm_is_the_reference(rng):
  x, scale, bias, _ = _draw(rng, (4, 3, 3, 5), 1.0)
  spec = BatchNormSpec.from_arrays(x)
  np.testing.assert_array_equal(_bn_family.batch_norm(x, scale, bias),
                                _bn_kernels.xla(x, scale, bias, spec)[0])
  for got, want in zip(_bn_family.batch_norm_stats(x, scale, bias),
                       _bn_kernels.xla(x, scale, bias, spec)):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(tj.TunedJaxError, match=r"scale must have shape \(C,\) = \(5,\)"):
    _bn_family.batch_norm(x, scale[:3], bias)


def test_selected_under_tj_jit_tuned_cached_and_gradient_agrees(rng, tmp_path):
  x, scale, bias, _ = _draw(rng, (8, 6, 6, 16), 2.0)
  params = {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)}

  def loss(params, x):
    y = _bn_family.batch_norm(x, params["scale"], params["bias"])
    return jnp.sum(jnp.tanh(y) * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size)

  config = {"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)}}
  with tj.config_context(config):
    f = tj.jit(jax.value_and_grad(loss, argnums=(0, 1)), session=autotune.TuningSession())
    value, grads = f(params, jnp.asarray(x))
    (choice,) = f.report(memory=False).last.kernel_report.of("batch_norm")
  assert choice.why == "tuned" and choice.kernel in KERNELS
  want_value, want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
  assert abs(float(value) - float(want_value)) <= 1e-4 * abs(float(want_value))
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert _rel(got, want) < 1e-3
  (row,) = [r for r in autotune.explain(loss, params, x, cache=tmp_path)
            if r.op == "batch_norm"]
  assert row.bucket == "batch_norm 8x6x6x16 float32" and row.kernel == choice.kernel
  # A hint pins a kernel.
  with tj.config_context({**config, "kernel": {"enable": True,
                                               "hints": {"batch_norm": "fused"}}}):
    g = tj.jit(loss, session=autotune.TuningSession())
    np.testing.assert_allclose(g(params, x), want_value, rtol=1e-4)
    assert [(c.kernel, c.why) for c in g.report(memory=False).last.kernel_report.of(
        "batch_norm")] == [("fused", "hint")]


def test_pow2_bucket_rounds_the_rows_only():
  spec = BatchNormSpec((3, 5, 6, 10), "float32")
  assert _bn_family.bn_key(spec, "pow2")["shape"] == [4, 8, 8, 10]
  assert _bn_family.bn_key(spec, "exact")["shape"] == [3, 5, 6, 10]
  with pytest.raises(tj.TunedJaxError, match="kernel.bucket"):
    _bn_family.bn_key(spec, "pow3")
