"""The ``direct_native`` conv kernel (C++ FFI handlers) against `lax.conv_general_dilated`.

Each form (the window form: forward and input gradient; the weight-gradient
form) in float64 with hypothesis over shapes, channels, padding, strides,
dilations and dimension numbers; every convolution of a strided layer's
train step (NHWC and NCHW, 1-D and 2-D) in float32 against the float64
reference; a long weight-gradient sum; a model's gradient under
`tunedjax.jit` with the kernel pinned by hint; bitwise determinism;
applicability (CPU only, dense, float32/float64, and only with native
kernels on); a cached winner read where native kernels are off; a model
exported for CUDA.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax import lax

import tunedjax as tj
from tests.autotune import selection_helpers as h
from tests.ops.conv.test_kernels import conv_cases, x64
from tunedjax import _native
from tunedjax._tuning import _cache
from tunedjax.autotune import _bucket, _registry, _select
from tunedjax.ops.conv import _native_direct as direct
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.autotune._hints import HintWarning

NHWC = ("NHWC", "HWIO", "NHWC")
NCHW = ("NCHW", "OIHW", "NCHW")
# Channel counts that reach each register tile (16 float32 / 8 float64 lanes a
# vector; 1, 2 or 4 vectors of output channels) and its zero-padded tail.
CHANNELS = [1, 3, 17, 33, 70]

pytestmark = pytest.mark.skipif(not _native.available(direct.SOURCE),
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


def _with_channels(case, ci, co):
  """A dense `conv_cases` case with `ci` input and `co` output channels."""
  lhs_shape, rhs_shape, kwargs = case
  lhs, rhs = list(lhs_shape), list(rhs_shape)
  dn = kwargs["dimension_numbers"]
  lhs[dn.lhs_spec[1]] = rhs[dn.rhs_spec[1]] = ci
  rhs[dn.rhs_spec[0]] = co
  return tuple(lhs), tuple(rhs), kwargs


def _spec(case, dtype=np.float64):
  lhs_shape, rhs_shape, kwargs = case
  with x64():
    return ConvSpec.from_arrays(jax.ShapeDtypeStruct(lhs_shape, dtype),
                                jax.ShapeDtypeStruct(rhs_shape, dtype), **kwargs)


def check_native(case, *, dtype=np.float64, rtol=1e-12, seed=0):
  """Asserts the kernel's output matches lax's in float64 to `rtol` (relative to the max)."""
  lhs_shape, rhs_shape, kwargs = case
  rng = np.random.default_rng(seed)
  lhs, rhs = rng.normal(size=lhs_shape), rng.normal(size=rhs_shape)
  with x64():
    want = np.asarray(lax.conv_general_dilated(lhs, rhs, **kwargs))
    args = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
    spec = ConvSpec.from_arrays(*args, **kwargs)
    assert direct.applicable(spec, "cpu"), spec
    got = np.asarray(jax.jit(direct.conv_direct_native, static_argnums=2)(*args, spec))
  assert got.shape == want.shape == spec.out_shape and got.dtype == np.dtype(dtype), spec
  err = float(np.max(np.abs(got.astype(np.float64) - want))) / (
      float(np.max(np.abs(want))) + 1e-300)
  assert err < rtol, f"relative error {err:.3g} on {spec}"
  return got


@settings(max_examples=15, deadline=None)
@given(conv_cases(groups=False, spatial=(1, 11), kernel=(1, 4), pad=(-1, 3)),
       st.sampled_from(CHANNELS), st.sampled_from(CHANNELS))
def test_window_form_matches_lax_in_float64(case, ci, co):
  case = _with_channels(case, ci, co)
  assume(direct.is_window_form(_spec(case)))
  check_native(case)


def _wgrad_case(draw):
  """A dense conv with a window side over 7 and 2 to 49 output positions."""
  case = draw(conv_cases(groups=False, spatial=(8, 16), kernel=(2, 12), pad=(-1, 3),
                         strides=(1, 3)))
  case = _with_channels(case, draw(st.sampled_from(CHANNELS)),
                        draw(st.sampled_from(CHANNELS)))
  assume(direct.is_weight_grad_form(_spec(case)))
  return case


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_weight_grad_form_matches_lax_in_float64(data):
  check_native(_wgrad_case(data.draw))


def _train_step_specs(stride, *, dn=NHWC, shape=(3, 13, 12, 5), co=33, dtype=jnp.float32):
  """A dense 3x3 layer's three convolutions in a train step (forward, weight
  gradient, input gradient), as the jaxpr has them; `shape` is channels-last."""
  nsp = len(shape) - 2
  if nsp == 1:
    dn = ("NWC", "WIO", "NWC") if dn == NHWC else ("NCW", "OIW", "NCW")
  lhs_cl, rhs_cl = shape, (3,) * nsp + (shape[-1], co)
  if dn[0].startswith("NC"):  # channels first: (N, C, *spatial), (O, I, *window)
    lhs_cl = (shape[0], shape[-1], *shape[1:-1])
    rhs_cl = (co, shape[-1]) + (3,) * nsp

  def loss(x, w):
    y = lax.conv_general_dilated(x, w, (stride,) * nsp, "SAME", dimension_numbers=dn)
    return jnp.sum(jnp.sin(y))

  args = (jax.ShapeDtypeStruct(lhs_cl, dtype), jax.ShapeDtypeStruct(rhs_cl, dtype))
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
@pytest.mark.parametrize("dn", [NHWC, NCHW], ids=["NHWC", "NCHW"])
@pytest.mark.parametrize("stride", [1, 2])
def test_every_train_step_form_in_float32(stride, dn, nsp):
  shape = (3, 17, 18, 5) if nsp == 2 else (3, 29, 5)
  specs = _train_step_specs(stride, dn=dn, shape=shape)
  forms = [(direct.is_window_form(s), direct.is_weight_grad_form(s)) for s in specs]
  # forward: window; weight gradient: the image as the window; input gradient: window
  assert forms == [(True, False), (False, True), (True, False)], forms
  if stride == 2:
    assert specs[2].lhs_dilation == (2,) * nsp  # the input gradient
  for spec in specs:
    check_native(_case(spec), dtype=np.float32, rtol=1e-5)


def test_long_weight_gradient_sum_is_accurate_in_float32():
  # 64 images of 32x32: 65536 products per output. Each image's sum is float32,
  # the images' sums double, so the error stays near float32 rounding.
  spec = _train_step_specs(1, shape=(64, 32, 32, 3), co=32)[1]
  check_native(_case(spec), dtype=np.float32, rtol=2e-6)


def test_bitwise_reproducible(rng):
  for spec in _train_step_specs(2, shape=(16, 17, 19, 20), co=40):
    x = jnp.asarray(rng.normal(size=spec.lhs_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
    f = jax.jit(direct.conv_direct_native, static_argnums=2)
    first = np.asarray(f(x, w, spec))
    for _ in range(2):
      np.testing.assert_array_equal(np.asarray(f(x, w, spec)), first)


def test_differentiable_and_vmappable(rng):
  for spec in _train_step_specs(1, shape=(2, 9, 8, 3), co=5)[:2]:
    x = jnp.asarray(rng.normal(size=(2, *spec.lhs_shape)), jnp.float32)
    w = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
    ref = lambda l, r, s=spec: lax.conv_general_dilated_p.bind(l, r, **s.params())
    mine = lambda l, r, s=spec: direct.conv_direct_native(l, r, s)
    loss = lambda conv: lambda l, r: jnp.sum(jnp.sin(jax.vmap(conv, (0, None))(l, r)))
    assert h.max_rel_err(jax.vmap(mine, (0, None))(x, w),
                         jax.vmap(ref, (0, None))(x, w)) < 1e-5
    got = jax.jit(jax.grad(loss(mine), argnums=(0, 1)))(x, w)
    assert h.max_rel_err(got, jax.grad(loss(ref), argnums=(0, 1))(x, w)) < 1e-5


# --- applicability ---------------------------------------------------------------------


def test_applicable_on_cpu_only_and_only_dense_float():
  for spec in _train_step_specs(2):
    assert direct.applicable(spec, "cpu")
    assert not direct.applicable(spec, "gpu")
    assert not direct.applicable(spec, "tpu")

  def spec_of(x, w, dtype=np.float32, dn=NHWC, **kw):
    return ConvSpec.from_arrays(np.ones(x, dtype), np.ones(w, dtype), dimension_numbers=dn,
                                **kw)

  not_ours = {
      "depthwise": spec_of((2, 8, 8, 4), (3, 3, 1, 4), feature_group_count=4),
      "grouped": spec_of((2, 8, 8, 4), (3, 3, 2, 4), feature_group_count=2),
      "batch groups": spec_of((4, 8, 8, 4), (3, 3, 4, 4), batch_group_count=2),
      "1x1": spec_of((2, 8, 8, 4), (1, 1, 4, 4)),
      "8x8 window, 8x8 output": spec_of((2, 15, 15, 4), (8, 8, 4, 4)),
      "3-D": spec_of((1, 4, 4, 4, 4), (3, 3, 3, 4, 4), dn=("NDHWC", "DHWIO", "NDHWC")),
      "bfloat16": spec_of((2, 8, 8, 4), (3, 3, 4, 4), dtype=jnp.bfloat16),
      "float16": spec_of((2, 8, 8, 4), (3, 3, 4, 4), dtype=np.float16),
      "int32": spec_of((2, 8, 8, 4), (3, 3, 4, 4), dtype=np.int32),
  }
  with x64():
    not_ours["float32 into float64"] = spec_of((2, 8, 8, 4), (3, 3, 4, 4),
                                               preferred_element_type=np.float64)
  for what, spec in not_ours.items():
    assert not direct.applicable(spec, "cpu"), what


def test_not_applicable_with_native_kernels_off():
  spec = _train_step_specs(1)[0]
  with native_off():
    assert not direct.applicable(spec, "cpu")
    names = [k.name for k in _registry.applicable_kernels(spec, "cpu")]
    assert "direct_native" not in names and "im2col" in names
  assert direct.applicable(spec, "cpu")


# --- inside tunedjax: pinned by hint, cached, exported ----------------------------------


def _model(params, x):
  """A small CNN: a strided 3x3 stem, a 3x3, a 1x1, and a dilated 3x3, NHWC."""
  y = jax.nn.relu(lax.conv_general_dilated(x, params["stem"], (2, 2), "SAME",
                                           dimension_numbers=NHWC))
  y = jnp.tanh(lax.conv_general_dilated(y, params["c3"], (1, 1), "SAME",
                                        dimension_numbers=NHWC))
  y = y @ params["pw"]
  y = lax.conv_general_dilated(y, params["dil"], (1, 1), "SAME", rhs_dilation=(2, 2),
                               dimension_numbers=NHWC)
  return jnp.mean(jnp.sin(y) ** 2)


def _model_args(rng, c=20):
  params = {"stem": rng.normal(size=(3, 3, 3, c)) / 5, "c3": rng.normal(size=(3, 3, c, c)) / 13,
            "pw": rng.normal(size=(c, c)) / c ** 0.5, "dil": rng.normal(size=(3, 3, c, 7)) / 13}
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  return params, jnp.asarray(rng.normal(size=(4, 18, 17, 3)), jnp.float32)


def _config(tmp_path, **kernel):
  return {"cache": {"dir": str(tmp_path / "cache")}, "layout": {"enable": False},
          "mixed_precision": {"enable": False}, "kernel": {"enable": True, **kernel}}


def test_gradient_under_tj_jit_with_the_kernel_pinned(tmp_path, rng):
  params, x = _model_args(rng)
  grad = jax.grad(_model)
  with tj.config_context(_config(tmp_path, hints={"conv": "direct_native"})):
    f = tj.jit(grad)
    got = f(params, x)
    kernels = f.report(memory=False).last.kernels
    rewritten = str(f.jaxpr(params, x))
  # Three 3x3 layers' forward and weight gradient, the two later ones' input
  # gradient (the gradient is taken with respect to the parameters only).
  assert kernels == {"conv direct_native (hint)": 8}, kernels
  assert h.max_rel_err(got, grad(params, x)) < 1e-5
  for handler in ("TjDirectConvF32", "TjDirectWgradF32"):
    assert f"tunedjax_{handler}" in rewritten


def _trace(f, *args):
  counts = {}
  out = jax.jit(_select.select_kernels(f, rounds=1, budget_s=3.0,
                                       on_report=lambda r: counts.update(r.counts())))(*args)
  return counts, out


def test_a_cached_winner_where_native_kernels_are_off(tmp_path, rng):
  x = jnp.asarray(rng.normal(size=(2, 9, 9, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 3, 8, 8)), jnp.float32)
  conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
  want = conv(x, w)
  spec = ConvSpec.from_arrays(x, w, padding="SAME", dimension_numbers=NHWC)
  with h.isolated_selection(tmp_path):
    cache = _cache.default_cache()
    key = _bucket.bucket_key(spec, _registry.applicable_kernels(spec, "cpu"))
    assert "direct_native" in key["candidates"]
    cache.put("conv", key, {"winner": "direct_native", "timings": {}})
    counts, got = _trace(conv, x, w)
    assert counts == {"conv direct_native (hit)": 1}
    assert h.max_rel_err(got, want) < 1e-5
    with native_off():
      # The same winner under the key this machine now computes (as a shared
      # cache written elsewhere, or a leader's broadcast choice, would hold it).
      off_key = _bucket.bucket_key(spec, _registry.applicable_kernels(spec, "cpu"))
      assert "direct_native" not in off_key["candidates"]
      cache.put("conv", off_key, {"winner": "direct_native", "timings": {}})
      counts, got = _trace(conv, x, w)
  assert counts == {"conv xla (not applicable)": 1}, counts  # the default, not a crash
  assert h.max_rel_err(got, want) < 1e-5


def test_export_for_cuda_lowers_the_model(tmp_path, rng):
  params, x = _model_args(rng)
  with tj.config_context(_config(tmp_path, hints={"conv": "direct_native"})), \
      warnings.catch_warnings():
    warnings.simplefilter("ignore", HintWarning)  # not applicable on gpu: xla instead
    f = tj.jit(jax.grad(_model), platform="gpu")
    exported = f.export(params, x)
  assert exported.platforms == ("cuda",)
  assert "tunedjax_" not in exported.mlir_module()
  assert all("direct_native" not in k for k in f.report(memory=False).last.kernels)
