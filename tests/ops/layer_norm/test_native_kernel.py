"""The ``native`` layer-norm kernel (C++ FFI): against float64 on every tail, a large mean,
deterministic whatever the thread count, under jit and vmap, CPU-only, optional."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import native_harness as nh
from tunedjax import _native
from tunedjax.ops.layer_norm import _native_kernel as ln
from tunedjax.ops.layer_norm._spec import LayerNormSpec

needs_native = pytest.mark.skipif(not _native.available(ln.SOURCE),
                                  reason="no native library here (no C++ compiler?)")
SUFFIX = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64"}
# float64 results against a reference in long double: x86's 80-bit extended precision
# leaves only the kernel's rounding (~1e-15); where long double is float64, the
# reference's own rounding of x - mean at a mean 1e3 times the spread (~1e-12) counts too.
F64_BOUND = 1e-13 if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps else 1e-10


def reference(x, scale, bias, spec):
  """Layer norm as written (mean, two-pass variance, rsqrt): in x's dtype, autodiff for
  its gradients; float64 under `jax.enable_x64`."""
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + spec.epsilon) * scale + bias


def _output_and_grads(fn, x, scale, bias, ct, eps, dtype):
  """fn's y and its VJP of cotangent `ct` (dx, dscale, dbias), in `dtype`, in one jit."""
  spec = LayerNormSpec.from_arrays(x, epsilon=eps)

  @jax.jit
  def run(x, scale, bias, ct):
    y, vjp = jax.vjp(lambda *a: fn(*a, spec), x, scale, bias)
    return y, vjp(ct)

  with jax.enable_x64(dtype == np.float64):
    cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)  # noqa: E731
    return jax.tree.map(np.asarray, run(*cast((x, scale, bias, ct))))


def _rel(got, want, floor=1e-3):
  """The largest difference over the largest reference value (at least `floor`)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), floor))


def _draw(rng, shape, offset, dtype):
  """x with a mean and a spread of its own per row (offset: their scale), scale, bias, ct."""
  c = shape[-1]
  rows = (*shape[:-1], 1)
  x = (rng.normal(size=shape) * (0.2 + 2 * rng.random(rows))
       + offset * (1 + rng.random(rows)) * rng.choice([-1, 1], rows))
  scale, bias = 1 + 0.5 * rng.normal(size=c), rng.normal(size=c)
  return tuple(np.asarray(a, dtype) for a in (x, scale, bias, rng.normal(size=shape)))


def _numpy64(x, scale, bias, dy, eps, dtype=np.float64):
  """The handlers' formulas in NumPy's `dtype`: (y, mean, rstd), (dx, dscale, dbias), and
  the size of dx's terms, max |rstd * dy * scale| (its error's scale: with two features dx
  is a difference of nearly equal terms, ~1e-3 of them)."""
  x, scale, bias, dy = (np.asarray(a, dtype) for a in (x, scale, bias, dy))
  mean = x.mean(-1)
  rstd = 1 / np.sqrt(((x - mean[:, None]) ** 2).mean(-1) + eps)
  xhat = (x - mean[:, None]) * rstd[:, None]
  g = dy * scale
  dx = rstd[:, None] * (g - g.mean(-1, keepdims=True)
                        - xhat * (g * xhat).mean(-1, keepdims=True))
  terms = float(np.max(np.abs(rstd[:, None] * g)))
  return (xhat * scale + bias, mean, rstd), (dx, (dy * xhat).sum(0), dy.sum(0)), terms


def _check(x, scale, bias, ct, eps, bound):
  """The kernel's y and VJP (one jit) against the formulas in NumPy's long double."""
  got_y, got_grads = _output_and_grads(ln.native, x, scale, bias, ct, eps, x.dtype)
  c = x.shape[-1]
  (want_y, _, _), (dx, dscale, dbias), terms = _numpy64(
      x.reshape(-1, c), scale, bias, ct.reshape(-1, c), eps, np.longdouble)
  for name, got, want in zip(("y", "dx", "dscale", "dbias"), (got_y, *got_grads),
                             (want_y.reshape(x.shape), dx.reshape(x.shape), dscale, dbias)):
    assert got.dtype == x.dtype and got.shape == want.shape, name
    floor = terms if name == "dx" else 1e-3
    assert _rel(got, want, floor) < bound, (name, _rel(got, want, floor))


# Ranks 1 to 4; C from 1 to 300 (tails of the 16- and 64-lane blocks); up to ~300 rows.
_SHAPES = st.one_of(
    st.tuples(st.integers(1, 300)),
    st.tuples(st.integers(1, 300), st.integers(1, 300)),
    st.tuples(st.integers(1, 6), st.integers(1, 50), st.integers(1, 300)),
    st.tuples(*[st.integers(1, 4)] * 3, st.integers(1, 300)))


@needs_native
@settings(max_examples=25, deadline=None)
@given(shape=_SHAPES, offset=st.sampled_from([0.0, 3.0, 1e3]), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-6, 1e-5, 1e-3]))
def test_float32_matches_float64_forward_and_gradient_on_any_shape(shape, offset, seed, eps):
  x, scale, bias, ct = _draw(np.random.default_rng(seed), shape, offset, np.float32)
  _check(x, scale, bias, ct, eps, bound=2e-6)


@needs_native
@settings(max_examples=15, deadline=None)
@given(shape=_SHAPES, offset=st.sampled_from([0.0, 3.0, 1e3]), seed=st.integers(0, 2**16))
def test_float64_matches_the_reference_on_any_shape(shape, offset, seed):
  x, scale, bias, ct = _draw(np.random.default_rng(seed), shape, offset, np.float64)
  _check(x, scale, bias, ct, 1e-5, bound=F64_BOUND)


def _handlers(x, scale, bias, dy, eps, threads=3):
  """Both handlers through the harness: (y, mean, rstd), (dx, dscale, dbias)."""
  s = SUFFIX[x.dtype]
  r, c = x.shape
  y, mean, rstd = nh.call(ln.SOURCE, f"TjLayerNormForward{s}", [x, scale, bias],
                          [(r, c), (r,), (r,)], {"epsilon": float(eps)}, threads=threads)
  grads = nh.call(ln.SOURCE, f"TjLayerNormBackward{s}", [x, dy, scale, mean, rstd],
                  [(r, c), (c,), (c,)], threads=threads)
  return (y, mean, rstd), grads


# Features around the 16-lane vectors and 64-lane blocks, one row to several chunks.
TAILS = [(1, 1), (3, 1), (2, 7), (5, 15), (4, 16), (3, 17), (9, 63), (2, 64), (7, 65),
         (3, 100), (5, 129), (2, 255), (6, 256), (3, 300), (1000, 37), (2000, 33)]


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_handlers_match_float64_on_every_tail(dtype):
  rng = np.random.default_rng(1)
  bound = 2e-6 if dtype == np.float32 else F64_BOUND
  for i, shape in enumerate(TAILS):
    x, scale, bias, dy = _draw(rng, shape, 3.0, dtype)
    got = _handlers(x, scale, bias, dy, 1e-5, threads=i % 4)
    want_outs, want_grads, terms = _numpy64(x, scale, bias, dy, 1e-5, np.longdouble)
    for name, g, w in zip(("y", "mean", "rstd", "dx", "dscale", "dbias"),
                          (*got[0], *got[1]), (*want_outs, *want_grads)):
      assert g.dtype == dtype
      floor = terms if name == "dx" else 1e-3
      assert _rel(g, w, floor) < bound, (shape, name, _rel(g, w, floor))


@needs_native
def test_a_large_mean_does_not_cancel_the_variance():
  # Rows of mean ~1e3 (and -3e4) and spread ~1 (0.05): a one-pass float32 variance,
  # E[x^2] - E[x]^2, keeps no digit of it (checked below, so the data is hard enough);
  # the two-pass statistics and the saved mean's low part keep y and every gradient
  # within the bound of the well-conditioned cases.
  rng = np.random.default_rng(2)
  for offset, spread in ((1e3, 1.0), (-3e4, 0.05)):
    x = (offset + spread * rng.normal(size=(64, 96))).astype(np.float32)
    one_pass = np.mean(x * x, -1) - np.mean(x, -1) ** 2
    assert _rel(one_pass, x.astype(np.float64).var(-1)) > 0.1
    _, scale, bias, ct = _draw(rng, x.shape, 0.0, np.float32)
    _check(x, scale, bias, ct, 1e-5, bound=2e-6)


@needs_native
def test_no_less_accurate_than_xla_against_float64():
  # The reference in float32 (XLA's fused reductions) and the kernel, against float64:
  # the kernel's error per output is at most XLA's (times 1.5: both are a few ulp).
  rng = np.random.default_rng(3)
  for shape, offset in (((512, 256), 0.0), ((64, 768), 3.0), ((300, 100), 1e3)):
    x, scale, bias, ct = _draw(rng, shape, offset, np.float32)
    got = _output_and_grads(ln.native, x, scale, bias, ct, 1e-5, np.float32)
    xla = _output_and_grads(reference, x, scale, bias, ct, 1e-5, np.float32)
    want = _output_and_grads(reference, x, scale, bias, ct, 1e-5, np.float64)
    for name, g, x32, w in zip(("y", "dx", "dscale", "dbias"), jax.tree.leaves(got),
                               jax.tree.leaves(xla), jax.tree.leaves(want)):
      assert _rel(g, w) <= 1.5 * _rel(x32, w) + 1e-7, (shape, name, _rel(g, w), _rel(x32, w))


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_bitwise_the_same_whatever_the_threads(dtype):
  # No pool, 1, 2 or 5 threads, on shapes of 8, 1 and 2 row chunks (3000x77, 64x512,
  # 129x300), the column sums' partials added in chunk order. (In float32 these double
  # sums of a few thousand float32 products are exact for data like this, so only
  # float64 would show a change of their order.)
  rng = np.random.default_rng(4)
  for shape in ((3000, 77), (64, 512), (129, 300)):
    x, scale, bias, dy = _draw(rng, shape, 3.0, dtype)
    runs = [_handlers(x, scale, bias, dy, 1e-5, threads=t) for t in (0, 1, 2, 5)]
    for other in runs[1:]:
      for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(other)):
        assert a.tobytes() == b.tobytes(), shape


@needs_native
def test_jit_runs_are_bitwise_reproducible():
  x, scale, bias, ct = _draw(np.random.default_rng(5), (8, 256, 96), 2.0, np.float32)
  runs = [_output_and_grads(ln.native, x, scale, bias, ct, 1e-6, np.float32) for _ in range(3)]
  for other in runs[1:]:
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(other)):
      np.testing.assert_array_equal(a, b)


@needs_native
def test_under_vmap_forward_and_gradient():
  # vmap over a batch axis of x and scale (the calls run once per element: sequential).
  x, scale, bias, ct = _draw(np.random.default_rng(6), (3, 10, 24), 1.0, np.float32)
  scales = np.stack([scale, 2 * scale, -scale])
  spec = LayerNormSpec.from_arrays(x[0], epsilon=1e-5)

  def per_example(fn):
    def loss(x, scale, bias, ct):
      return jnp.sum(fn(x, scale, bias, spec) * ct)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    batched = jax.vmap(lambda *a: (fn(*a[:3], spec), grad(*a)), in_axes=(0, 0, None, 0))
    return jax.tree.map(np.asarray, jax.jit(batched)(x, scales, bias, ct))

  got = per_example(ln.native)
  with jax.enable_x64(True):
    want = per_example(lambda *a: reference(*(jnp.asarray(v, jnp.float64) for v in a[:3]),
                                            a[3]))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == np.float32 and g.shape == w.shape
    assert _rel(g, w) < 1e-5


@needs_native
def test_scale_and_bias_of_another_dtype_are_cast():
  x, scale, bias, ct = _draw(np.random.default_rng(7), (6, 40), 1.0, np.float64)
  with jax.enable_x64(True):
    spec = LayerNormSpec.from_arrays(x)
    s32, b32 = jnp.asarray(scale, jnp.float32), jnp.asarray(bias, jnp.float32)
    y, vjp = jax.vjp(lambda *a: ln.native(*a, spec), x, s32, b32)
    grads = vjp(jnp.asarray(ct))
    want = reference(x, s32.astype(jnp.float64), b32.astype(jnp.float64), spec)
  assert y.dtype == np.float64 and _rel(y, want) < 1e-12
  assert [g.dtype for g in grads] == [np.float64, np.float32, np.float32]


@needs_native
def test_bad_shapes_are_errors_that_write_nothing():
  z = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
  eps = {"epsilon": 1e-5}
  fwd, bwd = "TjLayerNormForwardF32", "TjLayerNormBackwardF32"
  bad = [(fwd, [z(0, 3), z(3), z(3)], [(0, 3), (0,), (0,)], eps),
         (fwd, [z(2, 0), z(0), z(0)], [(2, 0), (2,), (2,)], eps),
         (fwd, [z(2, 3), z(4), z(3)], [(2, 3), (2,), (2,)], eps),
         (fwd, [z(2, 3, 1), z(1), z(1)], [(2, 3, 1), (6,), (6,)], eps),
         (bwd, [z(2, 3), z(2, 4), z(3), z(2), z(2)], [(2, 3), (3,), (3,)], {}),
         (bwd, [z(2, 3), z(2, 3), z(3), z(3), z(2)], [(2, 3), (3,), (3,)], {})]
  for symbol, args, shapes, attrs in bad:
    with pytest.raises(nh.HandlerError, match="expected"):
      nh.call(ln.SOURCE, symbol, args, shapes, attrs)


@needs_native
def test_explicitly_sharded_input_runs_on_auto_axes(mesh8_explicit):
  # The FFI calls have no sharding rule: on Explicit axes they run on Auto axes and y
  # keeps x's sharding (without it, the backward's dx type would not match x's).
  x, scale, bias, ct = _draw(np.random.default_rng(8), (16, 5, 24), 1.0, np.float32)
  sharded = jax.sharding.NamedSharding(mesh8_explicit, jax.sharding.PartitionSpec("data"))
  x = jax.device_put(jnp.asarray(x), sharded)
  spec = LayerNormSpec.from_arrays(x, epsilon=1e-5)

  def step(fn):
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a, spec)))  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  with jax.set_mesh(mesh8_explicit):
    got = step(ln.native)(x, scale, bias)
    want = step(reference)(x, scale, bias)
    y = jax.jit(lambda *a: ln.native(*a, spec))(x, scale, bias)
  assert y.sharding.is_equivalent_to(x.sharding, x.ndim)
  assert got[1][0].sharding.is_equivalent_to(want[1][0].sharding, x.ndim)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _rel(g, w) < 1e-4


def test_applicable_on_cpu_float32_and_float64_only():
  expected = _native.available(ln.SOURCE)
  for shape in ((8,), (4, 8), (2, 3, 4, 1)):
    for dtype in ("float32", "float64"):
      assert ln.native_applicable(LayerNormSpec(shape, dtype), "cpu") == expected
  for platform in ("gpu", "tpu"):
    assert not ln.native_applicable(LayerNormSpec((4, 8), "float32"), platform)
  for dtype in ("float16", "bfloat16"):
    assert not ln.native_applicable(LayerNormSpec((4, 8), dtype), "cpu")
  for shape in ((), (0, 8), (4, 0)):
    assert not ln.native_applicable(LayerNormSpec(shape, "float32"), "cpu")


def test_not_applicable_with_native_kernels_off(monkeypatch):
  monkeypatch.setenv(_native.ENV_VAR, "0")
  _native.reset()
  try:
    assert not ln.native_applicable(LayerNormSpec((4, 8), "float32"), "cpu")
  finally:
    monkeypatch.delenv(_native.ENV_VAR)
    _native.reset()
