"""The layer_norm family: its JAX kernels against float64, the call site, tuning and keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tunedjax as tj
from tunedjax import autotune
from tunedjax.ops.layer_norm import _family as _ln_family
from tunedjax.ops.layer_norm import _kernels as _ln_kernels
from tunedjax.ops.layer_norm._spec import LayerNormSpec


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _draw(rng, shape, offset):
  """Rows with their own means (`offset` times their spread) and spreads; never zeros."""
  rows = shape[:-1] + (1,)
  x = rng.normal(size=shape) * (0.5 + rng.random(rows)) + offset * rng.normal(size=rows)
  c = shape[-1]
  return (x.astype(np.float32), rng.normal(size=c).astype(np.float32),
          rng.normal(size=c).astype(np.float32), rng.normal(size=shape).astype(np.float32))


def _value_and_grads(kernel, x, scale, bias, g, eps, dtype):
  spec = LayerNormSpec.from_arrays(x, epsilon=eps)
  with jax.enable_x64(dtype == np.float64):
    args = [jnp.asarray(a, dtype) for a in (x, scale, bias, g)]
    y, vjp = jax.vjp(lambda *a: kernel(*a, spec), *args[:3])
    return [np.asarray(t) for t in (y, *vjp(args[3]))]


@pytest.mark.parametrize("kernel", ["xla", "fused"])
@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from([(5,), (3, 7), (2, 3, 33), (1, 4, 2, 16)]),
       offset=st.sampled_from([0.0, 3.0, 300.0]), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-6, 1e-3]))
def test_kernel_matches_float64_forward_and_gradient(kernel, shape, offset, seed, eps):
  x, scale, bias, g = _draw(np.random.default_rng(seed), shape, offset)
  fn = getattr(_ln_kernels, kernel)
  got = _value_and_grads(fn, x, scale, bias, g, eps, np.float32)
  want = _value_and_grads(_ln_kernels.xla, x, scale, bias, g, eps, np.float64)
  for name, a, b in zip(("y", "dx", "dscale", "dbias"), got, want):
    assert a.dtype == np.float32 and a.shape == b.shape, name
    # A row's mean 300x its spread costs float32 about log2(300) bits in x - mean.
    assert _rel(a, b) < (2e-4 if offset > 100 else 2e-5), (name, _rel(a, b))


def test_the_variance_is_two_pass(rng):
  # A row whose mean is 1e4 times its spread: E[x^2] - E[x]^2 in float32 is all
  # rounding; the two-pass variance keeps its digits.
  x = (1e4 + rng.normal(size=(4, 64))).astype(np.float32)
  spec = LayerNormSpec.from_arrays(x)
  want = (x - x.mean(-1, keepdims=True, dtype=np.float64)) / x.astype(np.float64).std(
      -1, keepdims=True)
  for kernel in (_ln_kernels.xla, _ln_kernels.fused):
    y = kernel(x, np.ones(64, np.float32), np.zeros(64, np.float32), spec)
    assert _rel(y, want) < 5e-3


def test_outside_kernel_selection_layer_norm_is_the_reference(rng):
  x, scale, bias, _ = _draw(rng, (4, 3, 6), 1.0)
  spec = LayerNormSpec.from_arrays(x)
  np.testing.assert_array_equal(_ln_family.layer_norm(x, scale, bias, epsilon=1e-6),
                                _ln_kernels.xla(x, scale, bias, spec))


@pytest.mark.parametrize("scale_shape, x_shape", [((5,), (4, 6)), ((6, 1), (4, 6)),
                                                  ((1,), ())])
def test_bad_shapes_name_the_value_and_the_expected_one(scale_shape, x_shape):
  x = jnp.ones(x_shape, jnp.float32)
  scale = jnp.ones(scale_shape, jnp.float32)
  with pytest.raises(tj.ShapeError, match=r"scale must have shape \(C,\)") as info:
    _ln_family.layer_norm(x, scale, jnp.ones(x_shape[-1:] or (1,)))
  assert str(tuple(scale_shape)) in str(info.value) and str(x_shape) in str(info.value)
  assert isinstance(info.value, ValueError)


def test_selected_under_tj_jit_tuned_cached_and_gradient_agrees(rng, tmp_path):
  x, scale, bias, _ = _draw(rng, (4, 32, 64), 2.0)
  params = {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)}

  def loss(params, x):
    y = _ln_family.layer_norm(x, params["scale"], params["bias"])
    return jnp.sum(jnp.tanh(y) * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size)

  config = {"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)}}
  with tj.config_context(config):
    f = tj.jit(jax.value_and_grad(loss, argnums=(0, 1)), session=autotune.TuningSession())
    value, grads = f(params, jnp.asarray(x))
    (choice,) = f.report(memory=False).last.kernel_report.of("layer_norm")
  assert choice.why == "tuned" and choice.kernel in [k.name for k in
                                                     autotune.kernels("layer_norm")]
  want_value, want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
  assert abs(float(value) - float(want_value)) <= 1e-5 * abs(float(want_value))
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert _rel(got, want) < 1e-4
  (row,) = [r for r in autotune.explain(loss, params, x, cache=tmp_path)
            if r.op == "layer_norm"]
  assert row.bucket == "layer_norm 4x32x64 float32" and row.kernel == choice.kernel
  # A hint pins a kernel.
  with tj.config_context({**config, "kernel": {"enable": True,
                                               "hints": {"layer_norm": "fused"}}}):
    g = tj.jit(loss, session=autotune.TuningSession())
    np.testing.assert_allclose(g(params, x), want_value, rtol=1e-5)
    assert [(c.kernel, c.why) for c in g.report(memory=False).last.kernel_report.of(
        "layer_norm")] == [("fused", "hint")]


def test_keys_features_and_names():
  spec = LayerNormSpec((3, 5, 10), "float32", 1e-5)
  assert _ln_family.ln_key(spec, "pow2") == {"shape": [4, 8, 10], "dtype": "float32",
                                             "epsilon": 1e-5}
  assert _ln_family.ln_key(spec, "exact")["shape"] == [3, 5, 10]
  with pytest.raises(tj.TunedJaxError, match="kernel.bucket"):
    _ln_family.ln_key(spec, "pow3")
  assert _ln_family.describe_ln(_ln_family.ln_key(spec)) == "layer_norm 3x5x10 float32"
  assert _ln_family.ln_features({"shape": [4, 8, 16], "dtype": "float64"}) == {
      "rows": 5.0, "features": 4.0, "itemsize": 6.0}
  x, scale, bias = _ln_family.ln_operands(spec, np.random.default_rng(0))
  assert x.shape == spec.shape and scale.shape == bias.shape == (10,)
  assert np.all(x != 0) and x.dtype == np.float32
  # Each row its own mean: the operands exercise the statistics, not just the scale.
  assert np.std(x.mean(-1)) > 0.5
