"""The ``depthwise_native`` conv kernel (C++ FFI handlers) against `lax.conv_general_dilated`.

Each form (the channel form: forward and input gradient; the weight-gradient
form) in float64 with hypothesis over shapes, channels, padding, strides,
dilations and dimension numbers; float32 and preferred_element_type against
the float64 reference (half precision is not applicable); a model's gradient
under `tunedjax.jit` with the kernel pinned; bitwise determinism; applicability (CPU only, and only
with native kernels on); a cached winner read where native kernels are off;
a depthwise model exported for CUDA.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tunedjax as tj
from tests.autotune import selection_helpers as h
from tests.ops.conv.test_kernels import conv_cases, x64
from tunedjax import _native
from tunedjax._tuning import _cache
from tunedjax.autotune import _bucket, _registry, _select
from tunedjax.ops.conv import _native_depthwise as _conv_native
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.autotune._hints import HintWarning

NHWC = ("NHWC", "HWIO", "NHWC")

pytestmark = pytest.mark.skipif(not _native.available(_conv_native.SOURCE),
                                reason="native kernels unavailable (no C++ compiler?)")


@contextlib.contextmanager
def native_off():
  """``TUNEDJAX_NATIVE=0`` inside the block; native kernels usable again after it."""
  old = os.environ.get(_native.ENV_VAR)
  os.environ[_native.ENV_VAR] = "0"
  _native.reset()
  try:
    yield
  finally:
    if old is None:
      del os.environ[_native.ENV_VAR]
    else:
      os.environ[_native.ENV_VAR] = old
    _native.reset()


def _with_channels(case, channels):
  """A `conv_cases` depthwise or weight-gradient case with `channels` channels.

  The test strategy draws 2-4 channels; the kernel's register-blocked tiles
  (32 float32 / 16 float64 channels) need more to be exercised.
  """
  lhs_shape, rhs_shape, kwargs = case
  lhs, rhs = list(lhs_shape), list(rhs_shape)
  dn = kwargs["dimension_numbers"]
  kwargs = dict(kwargs)
  if kwargs["batch_group_count"] > 1:  # lhs batch == out features == groups
    lhs[dn.lhs_spec[0]] = rhs[dn.rhs_spec[0]] = kwargs["batch_group_count"] = channels
  else:  # lhs features == out features == groups, one input channel per group
    lhs[dn.lhs_spec[1]] = rhs[dn.rhs_spec[0]] = kwargs["feature_group_count"] = channels
  return tuple(lhs), tuple(rhs), kwargs


def _reference(lhs, rhs, kwargs):
  with x64():
    return np.asarray(lax.conv_general_dilated(np.asarray(lhs, np.float64),
                                               np.asarray(rhs, np.float64), **kwargs))


def check_native(case, *, dtype=np.float64, rtol=1e-12, seed=0, **extra):
  """Asserts the kernel's output matches lax's in float64 to `rtol` (relative to the max)."""
  lhs_shape, rhs_shape, kwargs = case
  kwargs = {**kwargs, **extra}
  rng = np.random.default_rng(seed)
  lhs = rng.normal(size=lhs_shape)
  rhs = rng.normal(size=rhs_shape)
  want = _reference(lhs, rhs, {k: v for k, v in kwargs.items()
                               if k != "preferred_element_type"})
  with x64():
    args = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
    spec = ConvSpec.from_arrays(*args, **kwargs)
    assert _conv_native.applicable(spec, "cpu"), spec
    got = jax.jit(_conv_native.conv_depthwise_native, static_argnums=2)(*args, spec)
    want_dtype = jax.eval_shape(lambda l, r: lax.conv_general_dilated(l, r, **kwargs),
                                *args).dtype
  got = np.asarray(got)
  assert got.shape == want.shape == spec.out_shape and got.dtype == want_dtype, spec
  err = float(np.max(np.abs(got.astype(np.float64) - want))) / (
      float(np.max(np.abs(want))) + 1e-300)
  assert err < rtol, f"relative error {err:.3g} on {spec}"
  return got


@settings(max_examples=12)
@given(conv_cases(depthwise=True, spatial=(1, 11), kernel=(1, 4)),
       st.sampled_from([2, 5, 37, 70]))
def test_channel_form_matches_lax_in_float64(case, channels):
  check_native(_with_channels(case, channels))


@settings(max_examples=12)
@given(conv_cases(wgrad=True, spatial=(1, 11), kernel=(1, 4)),
       st.sampled_from([2, 5, 37, 70]))
def test_weight_grad_form_matches_lax_in_float64(case, channels):
  check_native(_with_channels(case, channels))


def _train_step_specs(stride, *, shape=(3, 13, 12, 70), nsp=2, dtype=jnp.float32):
  """The depthwise layer's three convolutions in a train step (forward, weight
  gradient, input gradient), as the jaxpr has them."""
  dn = NHWC if nsp == 2 else ("NWC", "WIO", "NWC")
  c = shape[-1]

  def loss(x, w):
    y = lax.conv_general_dilated(x, w, (stride,) * nsp, "SAME", dimension_numbers=dn,
                                 feature_group_count=c)
    return jnp.sum(y ** 2)

  args = (jax.ShapeDtypeStruct(shape, dtype),
          jax.ShapeDtypeStruct((3,) * nsp + (1, c), dtype))
  closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args)
  return [ConvSpec.from_equation(e) for e in closed.jaxpr.eqns
          if e.primitive.name == "conv_general_dilated"]


def _case(spec):
  p = spec.params()
  kwargs = {k: p[k] for k in ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
                              "dimension_numbers", "feature_group_count",
                              "batch_group_count")}
  return spec.lhs_shape, spec.rhs_shape, kwargs


@pytest.mark.parametrize("nsp", [1, 2])
@pytest.mark.parametrize("stride", [1, 2])
def test_every_train_step_form_in_float32(stride, nsp):
  shape = (3, 13, 12, 70) if nsp == 2 else (3, 29, 70)
  specs = _train_step_specs(stride, shape=shape, nsp=nsp)
  assert [s.batch_group_count > 1 for s in specs] == [False, True, False]
  if stride == 2:
    assert specs[2].lhs_dilation == (2,) * nsp  # the input gradient
  for spec in specs:
    check_native(_case(spec), dtype=np.float32, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("preferred", [None, jnp.float32], ids=["as_is", "preferred_f32"])
def test_not_applicable_to_half_precision(dtype, preferred):
  # Cast to float32 around the FFI call it measured 4.5x slower than `depthwise`.
  for spec in _train_step_specs(2, shape=(2, 9, 10, 37), dtype=dtype):
    spec = ConvSpec.from_dict({**spec.to_dict(), "preferred_element_type": (
        None if preferred is None else jnp.dtype(preferred).name)})
    assert not _conv_native.applicable(spec, "cpu"), spec


def test_preferred_element_type_of_the_operands_dtype():
  for spec in _train_step_specs(1, shape=(2, 7, 9, 33)):
    got = check_native(_case(spec), dtype=np.float32, rtol=1e-5,
                       preferred_element_type=jnp.float32)
    assert got.dtype == np.float32


def test_long_weight_gradient_sum_is_accurate_in_float32():
  # 64 images of 32x32: 65536 terms per output. Each image's sum is float32,
  # the images' sums double, so the error stays near float32 rounding.
  spec = _train_step_specs(1, shape=(64, 32, 32, 48))[1]
  check_native(_case(spec), dtype=np.float32, rtol=2e-6)


def test_bitwise_reproducible(rng):
  for spec in _train_step_specs(2, shape=(32, 17, 19, 40)):
    x = jnp.asarray(rng.normal(size=spec.lhs_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
    f = jax.jit(_conv_native.conv_depthwise_native, static_argnums=2)
    first = np.asarray(f(x, w, spec))
    for _ in range(2):
      np.testing.assert_array_equal(np.asarray(f(x, w, spec)), first)


def test_differentiable_and_vmappable(rng):
  spec = _train_step_specs(1, shape=(2, 6, 7, 5))[0]
  x = jnp.asarray(rng.normal(size=(3, *spec.lhs_shape)), jnp.float32)
  w = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
  ref = lambda l, r: lax.conv_general_dilated_p.bind(l, r, **spec.params())
  mine = lambda l, r: _conv_native.conv_depthwise_native(l, r, spec)
  loss = lambda conv: lambda l, r: jnp.sum(jax.vmap(conv, (0, None))(l, r) ** 2)
  assert h.max_rel_err(jax.vmap(mine, (0, None))(x, w), jax.vmap(ref, (0, None))(x, w)) < 1e-5
  got = jax.jit(jax.grad(loss(mine), argnums=(0, 1)))(x, w)
  assert h.max_rel_err(got, jax.grad(loss(ref), argnums=(0, 1))(x, w)) < 1e-5


# --- applicability ---------------------------------------------------------------------


def test_applicable_on_cpu_only_and_only_depthwise():
  specs = _train_step_specs(2)
  for spec in specs:
    assert _conv_native.applicable(spec, "cpu")
    assert not _conv_native.applicable(spec, "gpu")
    assert not _conv_native.applicable(spec, "tpu")
  dense = ConvSpec.from_arrays(np.ones((2, 8, 8, 4), np.float32),
                               np.ones((3, 3, 4, 4), np.float32), dimension_numbers=NHWC)
  grouped = ConvSpec.from_arrays(np.ones((2, 8, 8, 4), np.float32),
                                 np.ones((3, 3, 2, 4), np.float32), dimension_numbers=NHWC,
                                 feature_group_count=2)
  three_d = ConvSpec.from_arrays(np.ones((1, 4, 4, 4, 4), np.float32),
                                 np.ones((3, 3, 3, 1, 4), np.float32),
                                 dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                 feature_group_count=4)
  integer = ConvSpec.from_arrays(np.ones((2, 8, 8, 4), np.int32),
                                 np.ones((3, 3, 1, 4), np.int32), dimension_numbers=NHWC,
                                 feature_group_count=4)
  for spec in (dense, grouped, three_d, integer):
    assert not _conv_native.applicable(spec, "cpu"), spec


def test_not_applicable_with_native_kernels_off():
  spec = _train_step_specs(1)[0]
  with native_off():
    assert not _conv_native.applicable(spec, "cpu")
    names = [k.name for k in _registry.applicable_kernels(spec, "cpu")]
    assert "depthwise_native" not in names and "depthwise" in names
  assert _conv_native.applicable(spec, "cpu")


# --- inside tunedjax: pinned by hint, cached, exported ----------------------------------


def _model(params, x):
  """Two depthwise layers (one strided) and pointwise mixing: a MobileNet block."""
  c = x.shape[-1]
  y = lax.conv_general_dilated(x, params["dw1"], (1, 1), "SAME", dimension_numbers=NHWC,
                               feature_group_count=c)
  y = jax.nn.relu(y) @ params["pw"]
  y = lax.conv_general_dilated(y, params["dw2"], (2, 2), "SAME", dimension_numbers=NHWC,
                               feature_group_count=c)
  return jnp.mean(jnp.tanh(y) ** 2)


def _model_args(rng, c=24):
  params = {"dw1": rng.normal(size=(3, 3, 1, c)), "pw": rng.normal(size=(c, c)) / c ** 0.5,
            "dw2": rng.normal(size=(3, 3, 1, c))}
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  return params, jnp.asarray(rng.normal(size=(4, 10, 11, c)), jnp.float32)


def test_gradient_under_tj_jit_with_the_kernel_pinned(tmp_path, rng):
  params, x = _model_args(rng)
  grad = jax.grad(_model)
  config = {"cache": {"dir": str(tmp_path / "cache")}, "layout": {"enable": False},
            "mixed_precision": {"enable": False},
            "kernel": {"enable": True, "hints": {"conv": "depthwise_native"}}}
  with tj.config_context(config):
    f = tj.jit(grad)
    got = f(params, x)
    kernels = f.report(memory=False).last.kernels
    rewritten = str(f.jaxpr(params, x))
  # Both layers' forward and weight gradient, the second's input gradient
  # (the gradient is taken with respect to the parameters only).
  assert kernels == {"conv depthwise_native (hint)": 5}, kernels
  assert h.max_rel_err(got, grad(params, x)) < 1e-5
  for handler in ("TjDepthwiseConvF32", "TjDepthwiseWgradF32"):
    assert f"tunedjax_{handler}" in rewritten


def _trace(f, *args):
  counts = {}
  out = jax.jit(_select.select_kernels(f, rounds=1, budget_s=3.0,
                                       on_report=lambda r: counts.update(r.counts())))(*args)
  return counts, out


def test_a_cached_winner_where_native_kernels_are_off(tmp_path, rng):
  x = jnp.asarray(rng.normal(size=(2, 9, 9, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 3, 1, 8)), jnp.float32)
  conv = lambda x, w: lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=NHWC, feature_group_count=8)
  want = conv(x, w)
  spec = ConvSpec.from_arrays(x, w, padding="SAME", dimension_numbers=NHWC,
                              feature_group_count=8)
  with h.isolated_selection(tmp_path):
    cache = _cache.default_cache()
    key = _bucket.bucket_key(spec, _registry.applicable_kernels(spec, "cpu"))
    assert "depthwise_native" in key["candidates"]
    cache.put("conv", key, {"winner": "depthwise_native", "timings": {}})
    counts, got = _trace(conv, x, w)
    assert counts == {"conv depthwise_native (hit)": 1}
    assert h.max_rel_err(got, want) < 1e-5
    with native_off():
      # The same winner under the key this machine now computes (as a shared
      # cache written elsewhere, or a leader's broadcast choice, would hold it).
      off_key = _bucket.bucket_key(spec, _registry.applicable_kernels(spec, "cpu"))
      assert "depthwise_native" not in off_key["candidates"]
      cache.put("conv", off_key, {"winner": "depthwise_native", "timings": {}})
      counts, got = _trace(conv, x, w)
  assert counts == {"conv xla (not applicable)": 1}, counts  # the default, not a crash
  assert h.max_rel_err(got, want) < 1e-5


def test_export_for_cuda_lowers_a_depthwise_model(tmp_path, rng):
  params, x = _model_args(rng)
  config = {"cache": {"dir": str(tmp_path / "cache")}, "layout": {"enable": False},
            "mixed_precision": {"enable": False},
            "kernel": {"enable": True, "hints": {"conv": "depthwise_native"}}}
  with tj.config_context(config), warnings.catch_warnings():
    warnings.simplefilter("ignore", HintWarning)  # not applicable on gpu: xla instead
    f = tj.jit(jax.grad(_model), platform="gpu")
    exported = f.export(params, x)
  assert exported.platforms == ("cuda",)
  assert "tunedjax_" not in exported.mlir_module()
  assert all("depthwise_native" not in k for k in f.report(memory=False).last.kernels)


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_sharded_batch(axes, tmp_path, rng, mesh8_auto, mesh8_explicit):
  # The FFI call has no partitioning rule: on a sharded batch XLA gathers its
  # operands and runs it whole, which must still give jax.jit's result.
  mesh = {"auto": mesh8_auto, "explicit": mesh8_explicit}[axes]
  params, x = _model_args(rng)
  x = jnp.concatenate([x, x * 0.5])  # batch 8: one image per device
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  grad = jax.grad(_model)
  want = jax.jit(grad)(params, x)
  config = {"cache": {"dir": str(tmp_path / "cache")}, "layout": {"enable": False},
            "mixed_precision": {"enable": False},
            "kernel": {"enable": True, "hints": {"conv": "depthwise_native"}}}
  with tj.config_context(config):
    f = tj.jit(grad)
    got = f(params, x)
    kernels = f.report(memory=False).last.kernels
  assert kernels == {"conv depthwise_native (hint)": 5}, kernels
  assert h.max_rel_err(got, want) < 1e-5
