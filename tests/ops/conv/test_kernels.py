"""Each conv kernel against `lax.conv_general_dilated` in float64.

Forward, input gradient and kernel gradient, over hypothesis-generated
convolutions inside each kernel's declared applicability; `applicable` is
false outside it and true on the benchmark buckets of the issue.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax import lax

from tunedjax.ops.conv import _matmul as _conv_matmul
from tunedjax.autotune import _registry as reg
from tunedjax.ops.conv._spec import ConvSpec


@contextlib.contextmanager
def x64():
  """Enables float64 inside the block and restores the previous setting."""
  old = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", old)


def _perm(draw, n):
  return tuple(draw(st.permutations(range(n))))


@st.composite
def conv_cases(draw, *, nsp=(1, 2), kernel=(1, 3), spatial=(1, 7),
               strides=(1, 2), pad=(-1, 2), lhs_dil=(1, 2), rhs_dil=(1, 2),
               groups="any", batch_groups=False, depthwise=False,
               wgrad=False):
  """A random convolution: (lhs shape, rhs shape, conv kwargs).

  `depthwise` draws feature_group_count == C with one kernel per channel;
  `wgrad` draws the weight-gradient form (batch_group_count == lhs batch ==
  out features); otherwise `groups` / `batch_groups` say whether feature or
  batch groups may be > 1.
  """
  n_sp = draw(st.sampled_from(nsp))
  g = 1
  bg = 1
  if depthwise:
    g = draw(st.integers(2, 4))
    c, o, n = g, g, draw(st.integers(1, 2))
  elif wgrad:
    bg = draw(st.integers(2, 4))
    n, o, c = bg, bg, draw(st.integers(1, 3))
  else:
    if groups == "any":
      g = draw(st.integers(1, 2))
    if batch_groups and g == 1:
      bg = draw(st.integers(1, 2))
    c = g * draw(st.integers(1, 3))
    o = g * bg * draw(st.integers(1, 3))
    n = bg * draw(st.integers(1, 2))
  ks = tuple(draw(st.integers(*kernel)) for _ in range(n_sp))
  xs = tuple(draw(st.integers(*spatial)) for _ in range(n_sp))
  ws = tuple(draw(st.integers(*strides)) for _ in range(n_sp))
  padding = tuple((draw(st.integers(*pad)), draw(st.integers(*pad)))
                  for _ in range(n_sp))
  ld = tuple(draw(st.integers(*lhs_dil)) for _ in range(n_sp))
  rd = tuple(draw(st.integers(*rhs_dil)) for _ in range(n_sp))
  for x, k, s, (lo, hi), l, r in zip(xs, ks, ws, padding, ld, rd):
    padded = (x - 1) * l + 1 + lo + hi
    assume(padded >= (k - 1) * r + 1)
  specs = tuple(_perm(draw, n_sp + 2) for _ in range(3))
  dn = lax.ConvDimensionNumbers(*specs)
  lhs_shape = [0] * (n_sp + 2)
  rhs_shape = [0] * (n_sp + 2)
  for dim, size in zip(specs[0], (n, c, *xs)):
    lhs_shape[dim] = size
  for dim, size in zip(specs[1], (o, c // g, *ks)):
    rhs_shape[dim] = size
  kwargs = dict(window_strides=ws, padding=padding, lhs_dilation=ld,
                rhs_dilation=rd, dimension_numbers=dn,
                feature_group_count=g, batch_group_count=bg)
  return tuple(lhs_shape), tuple(rhs_shape), kwargs


def check_kernel(name, case, *, platform="cpu", dtype=np.float64, rtol=1e-9,
                 seed=0):
  """Asserts kernel `name` matches lax: forward, lhs grad and rhs grad.

  The kernel runs on `dtype` operands; the reference is lax in float64 on the
  same values, and errors are relative to the largest reference value.
  """
  lhs_shape, rhs_shape, kwargs = case
  kernel = reg.get_kernel("conv", name)
  with x64():
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=lhs_shape), dtype)
    rhs = jnp.asarray(rng.normal(size=rhs_shape), dtype)
    cot = jnp.asarray(rng.normal(size=jax.eval_shape(
        lambda l, r: lax.conv_general_dilated(l, r, **kwargs), lhs, rhs).shape),
        dtype)
    spec = ConvSpec.from_arrays(lhs, rhs, **kwargs)
    assert kernel.applicable(spec, platform), spec

    def ref(lhs, rhs, cot):
      f64 = [a.astype(jnp.float64) for a in (lhs, rhs, cot)]
      out, vjp = jax.vjp(
          lambda l, r: lax.conv_general_dilated(l, r, **kwargs), *f64[:2])
      return (out, *vjp(f64[2]))

    def run(lhs, rhs, cot):
      out, vjp = jax.vjp(lambda l, r: kernel.fn(l, r, spec), lhs, rhs)
      return (out, *vjp(cot))

    want, got = jax.jit(lambda *a: (ref(*a), run(*a)))(lhs, rhs, cot)
    want, got = jax.device_get((want, got))
  for what, w, g in zip(("forward", "lhs grad", "rhs grad"), want, got):
    assert g.shape == w.shape and g.dtype == np.dtype(dtype), (what, g.shape)
    scale = float(np.max(np.abs(w))) + 1e-30
    err = float(np.max(np.abs(g.astype(np.float64) - w))) / scale
    assert err < rtol, f"{name} {what}: relative error {err:.3g} on {spec}"


@settings(max_examples=5)
@given(conv_cases(batch_groups=True))
def test_xla_matches_lax(case):
  check_kernel("xla", case)


@settings(max_examples=8)
@given(conv_cases(kernel=(1, 1)))
def test_matmul_1x1_matches_lax(case):
  check_kernel("matmul_1x1", case)


@pytest.mark.slow
@settings(max_examples=8)
@given(conv_cases(kernel=(1, 3)))
def test_im2col_matches_lax(case):
  assume(max(_rhs_spatial(case)) > 1)  # 1x1 is matmul_1x1's job
  _, rhs_shape, kwargs = case
  assume(rhs_shape[kwargs["dimension_numbers"].rhs_spec[1]] > 1)  # depthwise: not im2col's
  check_kernel("im2col", case)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(conv_cases(nsp=(2,), kernel=(8, 10), spatial=(7, 12), pad=(-1, 2), rhs_dil=(1, 1),
                  groups="none"))
def test_window_matmul_matches_lax(case):
  lhs_shape, rhs_shape, kwargs = case
  spec = ConvSpec.from_arrays(np.ones(lhs_shape), np.ones(rhs_shape), **kwargs)
  assume(reg.get_kernel("conv", "window_matmul").applicable(spec, "cpu"))
  check_kernel("window_matmul", case)


@pytest.mark.parametrize("kernel, stride", [((1, 1), 1), ((3, 3), 1), ((3, 3), 2)])
def test_window_matmul_computes_weight_gradients(kernel, stride, rng):
  # The weight-gradient convolution of a conv layer (window: the image; output:
  # the kernel's taps) is window_matmul's job; it gives the same gradient.
  x = jnp.asarray(rng.normal(size=(4, 16, 16, 3)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(*kernel, 3, 5)), jnp.float32)
  conv = lambda x, w: lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  y, vjp = jax.vjp(conv, x, w)
  wgrad = [e for e in jax.make_jaxpr(lambda ct: vjp(ct)[1])(y).eqns
           if e.primitive.name == "conv_general_dilated"
           and sorted(e.outvars[0].aval.shape) == sorted(w.shape)]
  assert len(wgrad) == 1
  l, r = (v.aval for v in wgrad[0].invars)
  params = {k: v for k, v in wgrad[0].params.items() if k in (
      "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
      "feature_group_count", "batch_group_count")}
  spec = ConvSpec.from_arrays(np.ones(l.shape, l.dtype), np.ones(r.shape, r.dtype), **params)
  kernel_fn = reg.get_kernel("conv", "window_matmul")
  assert kernel_fn.applicable(spec, "cpu")
  lhs, rhs = (jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in (l, r))
  want = lax.conv_general_dilated(lhs, rhs, **params)
  np.testing.assert_allclose(kernel_fn.fn(lhs, rhs, spec), want, rtol=1e-4, atol=1e-4)


def _rhs_spatial(case):
  _, rhs_shape, kwargs = case
  return [rhs_shape[d] for d in kwargs["dimension_numbers"].rhs_spec[2:]]


@pytest.mark.slow
@settings(max_examples=6)
@given(conv_cases(nsp=(2,), kernel=(5, 7), spatial=(5, 9), strides=(1, 1),
                  lhs_dil=(1, 1), rhs_dil=(1, 1), groups="none"))
def test_fft_matches_lax(case):
  check_kernel("fft", case)


@settings(max_examples=2)
@given(conv_cases(nsp=(1,), kernel=(25, 27), spatial=(25, 30), strides=(1, 1),
                  lhs_dil=(1, 1), rhs_dil=(1, 1), groups="none"))
def test_fft_matches_lax_1d(case):
  check_kernel("fft", case)


@pytest.mark.slow
@settings(max_examples=10)
@given(conv_cases(depthwise=True))
def test_depthwise_channel_form_matches_lax(case):
  check_kernel("depthwise", case)


@pytest.mark.slow
@settings(max_examples=8)
@given(conv_cases(wgrad=True))
def test_depthwise_weight_grad_form_matches_lax(case):
  check_kernel("depthwise", case)


def _grad_conv_specs(lhs_shape, rhs_shape, **kwargs):
  """The specs of the forward conv and the two convs autodiff adds."""
  def loss(x, w):
    return jnp.sum(lax.conv_general_dilated(x, w, **kwargs) ** 2)
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (lhs_shape, rhs_shape)]
  closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args)
  return [ConvSpec.from_equation(e) for e in closed.jaxpr.eqns
          if e.primitive.name == "conv_general_dilated"]


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_covers_every_train_step_form(stride, rng):
  specs = _grad_conv_specs(
      (2, 9, 9, 4), (3, 3, 1, 4), window_strides=(stride, stride),
      padding="SAME", feature_group_count=4,
      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  assert len(specs) == 3
  assert specs[1].batch_group_count == 4
  if stride == 2:
    assert specs[2].lhs_dilation == (2, 2)
  xla = reg.get_kernel("conv", "xla")
  depthwise = reg.get_kernel("conv", "depthwise")
  for spec in specs:
    assert depthwise.applicable(spec, "cpu"), spec
    lhs = rng.normal(size=spec.lhs_shape).astype(np.float32)
    rhs = rng.normal(size=spec.rhs_shape).astype(np.float32)
    want = xla.fn(lhs, rhs, spec)
    got = jax.jit(depthwise.fn, static_argnums=2)(lhs, rhs, spec)
    assert got.shape == want.shape == spec.out_shape
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-4,
                               atol=1e-4 * float(np.max(np.abs(want))))


def _spec(lhs_shape, rhs_shape, dtype="float32", **kwargs):
  kwargs.setdefault("dimension_numbers", ("NHWC", "HWIO", "NHWC"))
  args = [jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
          for s in (lhs_shape, rhs_shape)]
  return ConvSpec.from_arrays(*args, **kwargs)


# The benchmark buckets of issue 6 (batch 8) and the kernel meant for each.
BUCKETS = {
    "depthwise": _spec((8, 56, 56, 128), (3, 3, 1, 128), padding="SAME",
                       feature_group_count=128),
    "matmul_1x1": _spec((8, 56, 56, 64), (1, 1, 64, 256)),
    "fft": _spec((8, 64, 64, 3), (15, 15, 3, 8), padding="SAME"),
    "im2col": _spec((8, 7, 7, 512), (3, 3, 512, 512), padding="SAME"),
}


@pytest.mark.parametrize("name", sorted(BUCKETS))
def test_applicable_on_benchmark_buckets(name):
  names = [k.name for k in reg.applicable_kernels(BUCKETS[name], "cpu")]
  assert names[0] == "xla"
  assert name in names
  assert "pallas" not in names  # GPU only


def test_applicable_on_backward_buckets():
  dw = _grad_conv_specs((8, 56, 56, 128), (3, 3, 1, 128), window_strides=(1, 1),
                        padding="SAME", feature_group_count=128,
                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
  assert all(reg.get_kernel("conv", "depthwise").applicable(s, "cpu")
             for s in dw)
  big = _grad_conv_specs((8, 64, 64, 3), (31, 31, 3, 8), window_strides=(1, 1),
                         padding="SAME",
                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
  assert all(reg.get_kernel("conv", "fft").applicable(s, "cpu") for s in big)


NOT_APPLICABLE = [
    ("matmul_1x1", _spec((2, 8, 8, 4), (3, 3, 4, 4))),
    ("matmul_1x1", _spec((2, 8, 8, 4), (1, 1, 4, 4), dtype="int32")),
    ("im2col", _spec((2, 8, 8, 4), (1, 1, 4, 4))),  # 1x1: matmul_1x1's job
    ("im2col", _spec((8, 64, 64, 3), (15, 15, 3, 8))),  # 225 taps
    ("im2col", _spec((4, 8, 8, 3), (3, 3, 3, 4), batch_group_count=2)),
    ("im2col", _spec((2, 8, 8, 4), (3, 3, 1, 4), feature_group_count=4)),  # depthwise
    ("window_matmul", _spec((2, 8, 8, 4), (3, 3, 4, 4))),  # a small window
    ("window_matmul", _spec((2, 40, 40, 4), (10, 10, 4, 4))),  # 31x31 outputs
    ("window_matmul", _spec((2, 12, 12, 4), (10, 10, 2, 4), feature_group_count=2)),
    ("fft", _spec((2, 16, 16, 3), (5, 5, 3, 4), window_strides=(2, 2))),
    ("fft", _spec((2, 16, 16, 3), (5, 5, 3, 4), rhs_dilation=(2, 2))),
    ("fft", _spec((2, 16, 16, 4), (5, 5, 2, 4), feature_group_count=2)),
    ("fft", _spec((2, 16, 16, 3), (3, 3, 3, 4))),  # 9 taps
    ("depthwise", _spec((2, 8, 8, 4), (3, 3, 4, 4))),
    ("depthwise", _spec((2, 8, 8, 4), (3, 3, 1, 8), feature_group_count=4)),
    ("depthwise", _spec((2, 8, 8, 4), (3, 3, 2, 4), feature_group_count=2)),
    ("depthwise", _spec((2, 32, 32, 4), (11, 11, 1, 4), feature_group_count=4)),
]


@pytest.mark.parametrize("name,spec", NOT_APPLICABLE)
def test_not_applicable_outside_declared_domain(name, spec):
  assert not reg.get_kernel("conv", name).applicable(spec, "cpu")
  assert reg.get_kernel("conv", "xla").applicable(spec, "cpu")


@pytest.mark.parametrize("name", ["matmul_1x1", "im2col", "fft", "depthwise"])
def test_bfloat16_with_float32_accumulation(name, rng):
  shapes = {"matmul_1x1": ((2, 5, 5, 8), (1, 1, 8, 6), {}),
            "im2col": ((2, 5, 5, 8), (3, 3, 8, 6), {}),
            "fft": ((2, 9, 9, 3), (5, 5, 3, 4), {}),
            "depthwise": ((2, 5, 5, 8), (3, 3, 1, 8),
                          {"feature_group_count": 8})}
  lhs_shape, rhs_shape, extra = shapes[name]
  kwargs = dict(window_strides=(1, 1), padding="SAME",
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                preferred_element_type=jnp.float32, **extra)
  lhs = jnp.asarray(rng.normal(size=lhs_shape), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=rhs_shape), jnp.bfloat16)
  spec = ConvSpec.from_arrays(lhs, rhs, **kwargs)
  assert spec.out_dtype == "float32"
  kernel = reg.get_kernel("conv", name)
  assert kernel.applicable(spec, "cpu")
  got = kernel.fn(lhs, rhs, spec)
  want = lax.conv_general_dilated(lhs, rhs, **kwargs)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_check_kernel_catches_a_wrong_kernel():
  xla = reg.get_kernel("conv", "xla").fn
  reg.register_kernel("conv", "test_off_by_1e_6",
                      lambda l, r, s: xla(l, r, s) * (1 + 1e-6),
                      applicable=lambda spec, platform: True)
  case = ((1, 4, 4, 2), (3, 3, 2, 3), dict(
      window_strides=(1, 1), padding="SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC")))
  try:
    with pytest.raises(AssertionError, match="relative error"):
      check_kernel("test_off_by_1e_6", case)
  finally:
    reg.unregister_kernel("conv", "test_off_by_1e_6")


def test_im2col_backward_at_its_largest_kernel():
  # conv_general_dilated_patches crashes XLA:CPU's backward at 15x15; the
  # gather must differentiate at im2col's largest kernel (7x7).
  case = ((2, 12, 12, 3), (7, 7, 3, 4), dict(
      window_strides=(2, 2), padding="SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC")))
  check_kernel("im2col", case, dtype=np.float32, rtol=1e-5)


@pytest.mark.parametrize("name,lhs_shape,rhs_shape,extra", [
    ("matmul_1x1", (2, 5, 5, 4), (1, 1, 4, 3), {}),
    ("im2col", (2, 5, 5, 4), (3, 3, 4, 3), {}),
    ("fft", (2, 9, 9, 2), (5, 5, 2, 3), {}),
    ("depthwise", (2, 5, 5, 4), (3, 3, 1, 4), {"feature_group_count": 4}),
])
def test_kernels_compose_with_vmap_and_jit(name, lhs_shape, rhs_shape, extra,
                                           rng):
  # The selection pass evaluates kernels inside the caller's trace, which may
  # be a vmap (per-example gradients) under jit.
  kwargs = dict(window_strides=(1, 1), padding="SAME",
                dimension_numbers=("NHWC", "HWIO", "NHWC"), **extra)
  lhs = rng.normal(size=(3, *lhs_shape)).astype(np.float32)
  rhs = rng.normal(size=rhs_shape).astype(np.float32)
  spec = ConvSpec.from_arrays(lhs[0], rhs, **kwargs)
  kernel = reg.get_kernel("conv", name)
  got = jax.jit(jax.vmap(lambda l: kernel.fn(l, rhs, spec)))(lhs)
  want = jax.vmap(lambda l: lax.conv_general_dilated(l, rhs, **kwargs))(lhs)
  np.testing.assert_allclose(got, want, rtol=1e-4,
                             atol=1e-4 * float(np.max(np.abs(want))))


def test_im2col_reads_every_tap_with_one_gather_not_a_slice_per_tap():
  # Compile time: a strided slice per tap, stacked, cost XLA:CPU 0.1-0.25 s per
  # site to compile (one gather with trace-time indices: about 0.03 s).
  x = np.random.default_rng(0).normal(size=(2, 9, 9, 4)).astype(np.float32)
  w = np.random.default_rng(1).normal(size=(3, 3, 4, 5)).astype(np.float32)
  spec = ConvSpec.from_arrays(x, w, window_strides=(2, 1), padding=[(2, 1), (0, 3)],
                              rhs_dilation=(1, 2), dimension_numbers=("NHWC", "HWIO", "NHWC"))
  jaxpr = jax.make_jaxpr(lambda a, b: _conv_matmul.conv_im2col(a, b, spec))(x, w)
  names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert names.count("gather") == 1 and "concatenate" not in names, names
  assert names.count("slice") == 0, names
  ref = lax.conv_general_dilated(x.astype(np.float64), w.astype(np.float64), (2, 1),
                                 [(2, 1), (0, 3)], rhs_dilation=(1, 2),
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
  out = np.asarray(_conv_matmul.conv_im2col(x, w, spec), np.float64)
  assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5
