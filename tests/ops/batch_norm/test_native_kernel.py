"""The ``native`` batch-norm kernel (C++ FFI): against float64, deterministic, CPU-only, optional."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import tunedjax as tj
from tunedjax import _native, autotune, ops
from tunedjax.ops.batch_norm import _family as _bn_family
from tunedjax.ops.batch_norm import _kernels as _bn_kernels
from tunedjax.ops.batch_norm import _native_kernel as _bn_native
from tunedjax.ops.batch_norm._spec import BatchNormSpec

needs_native = pytest.mark.skipif(not _native.available(_bn_native.SOURCE),
                                  reason="no native library here (no C++ compiler?)")


def _outputs_and_grads(fn, x, scale, bias, cts, eps, dtype):
  """fn's (y, mean, var) and its VJP of each cotangent triple in `cts`, in `dtype`, one jit."""
  spec = BatchNormSpec.from_arrays(x, epsilon=eps)

  @jax.jit
  def run(x, scale, bias, cts):
    outs, vjp = jax.vjp(lambda *a: fn(*a, spec), x, scale, bias)
    return outs, [vjp(ct) for ct in cts]

  with jax.enable_x64(dtype == np.float64):
    cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)
    return jax.tree.map(np.asarray, run(*cast((x, scale, bias)), cast(cts)))


def _rel(a, b, floor=1e-30):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor))


def _draw(rng, shape, offset, dtype):
  c = shape[-1]
  x = rng.normal(size=shape) * (0.5 + rng.random(c)) + offset * rng.normal(size=c)
  ct = tuple(rng.normal(size=s).astype(dtype) for s in (shape, (c,), (c,)))
  return (x.astype(dtype), rng.normal(size=c).astype(dtype), rng.normal(size=c).astype(dtype),
          ct)


def _check(x, scale, bias, ct, eps, *, fwd_bound, grad_bound):
  # The output's cotangent alone (a loss of y only), then all three (the statistics'
  # cotangents reach dx too).
  cts = [(ct[0], np.zeros_like(ct[1]), np.zeros_like(ct[2])), ct]
  got_outs, got_grads = _outputs_and_grads(_bn_native.native, x, scale, bias, cts, eps, x.dtype)
  want_outs, want_grads = _outputs_and_grads(_bn_kernels.xla, x, scale, bias, cts, eps,
                                             np.float64)
  for name, got, want in zip(("y", "mean", "var"), got_outs, want_outs):
    assert got.dtype == x.dtype and got.shape == want.shape, name
    assert _rel(got, want, floor=1e-3) < fwd_bound, (name, _rel(got, want, floor=1e-3))
  for got3, want3 in zip(got_grads, want_grads):
    for name, got, want in zip(("dx", "dscale", "dbias"), got3, want3):
      assert got.dtype == x.dtype and got.shape == want.shape, name
      assert _rel(got, want, floor=1e-3) < grad_bound, (name, _rel(got, want, floor=1e-3))


_SHAPES = st.integers(2, 4).flatmap(lambda rank: st.tuples(
    *[st.integers(1, 5)] * (rank - 1), st.integers(1, 11)))


@needs_native
@settings(max_examples=12, deadline=None)
@given(shape=_SHAPES, offset=st.sampled_from([0.0, 3.0, 1e3]), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-5, 1e-3]))
def test_float64_matches_the_reference_on_any_shape(shape, offset, seed, eps):
  # float64 against float64: the formula, for every rank, one row, one channel.
  x, scale, bias, ct = _draw(np.random.default_rng(seed), shape, offset, np.float64)
  _check(x, scale, bias, ct, eps, fwd_bound=1e-9, grad_bound=1e-7)


@needs_native
@settings(max_examples=8, deadline=None)
@given(shape=st.tuples(st.integers(4, 9), st.integers(2, 5), st.integers(2, 5),
                       st.integers(1, 19)),
       offset=st.sampled_from([0.0, 3.0, 30.0]), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-5, 1e-3]))
def test_float32_matches_float64_forward_and_gradient(shape, offset, seed, eps):
  x, scale, bias, ct = _draw(np.random.default_rng(seed), shape, offset, np.float32)
  _check(x, scale, bias, ct, eps, fwd_bound=2e-5, grad_bound=2e-4)


@needs_native
@pytest.mark.parametrize("shape,dtype", [
    ((2, 3), np.float32), ((2, 3), np.float64), ((1, 4), np.float64), ((300, 1), np.float32),
    ((64, 16, 16, 8), np.float32), ((64, 16, 16, 8), np.float64), ((3, 130, 70), np.float32)])
def test_rank_rows_and_row_chunks(rng, shape, dtype):
  # 2-D and 3-D, one row (float64: in float32, dx of one row is 0 up to the rounding of
  # scale / sqrt(eps) * dy, ~300x dy), one channel, and inputs split into several row
  # chunks (64x16x16x8: 4 chunks a pass; 3x130x70: 2).
  x, scale, bias, ct = _draw(rng, shape, 2.0, dtype)
  if dtype == np.float64:
    bounds = (1e-9, 1e-7)
  else:  # two rows: dx is a difference of nearly equal terms
    bounds = (2e-5, 2e-3 if shape[0] == 2 else 2e-4)
  _check(x, scale, bias, ct, 1e-5, fwd_bound=bounds[0], grad_bound=bounds[1])


@needs_native
def test_a_large_mean_does_not_cancel_the_variance(rng):
  # mean 1e3, spread 1e-1: E[x^2] - E[x]^2 loses every digit in float32 and most in float64
  # sums of raw float32 values; the shifted sums keep them.
  x = (1e3 + 0.1 * rng.normal(size=(16, 4, 4, 8))).astype(np.float32)
  scale, bias = rng.normal(size=8).astype(np.float32), rng.normal(size=8).astype(np.float32)
  ct = tuple(rng.normal(size=s).astype(np.float32) for s in (x.shape, (8,), (8,)))
  got_outs, (got_grads,) = _outputs_and_grads(_bn_native.native, x, scale, bias, [ct], 1e-5,
                                              np.float32)
  want_outs, (want_grads,) = _outputs_and_grads(_bn_kernels.xla, x, scale, bias, [ct], 1e-5,
                                                np.float64)
  assert _rel(got_outs[2], want_outs[2]) < 1e-4  # the variance, ~1e-2
  assert _rel(got_outs[0], want_outs[0]) < 2e-3  # x - mean is exact to ~6e-5 of 0.1
  for got, want in zip(got_grads, want_grads):
    assert _rel(got, want) < 2e-3


@needs_native
def test_results_are_bitwise_reproducible(rng):
  # 128x16x16x16 = 16 row chunks per pass, run on the thread pool: the same bits each time.
  x, scale, bias, ct = _draw(rng, (128, 16, 16, 16), 3.0, np.float32)
  spec = BatchNormSpec.from_arrays(x)

  @jax.jit
  def f(x, scale, bias, ct):
    outs, vjp = jax.vjp(lambda *a: _bn_native.native(*a, spec), x, scale, bias)
    return outs, vjp(ct)

  first = jax.tree.map(np.asarray, f(x, scale, bias, ct))
  for _ in range(3):
    again = jax.tree.map(np.asarray, f(x, scale, bias, ct))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
      np.testing.assert_array_equal(a, b)


@needs_native
def test_applicable_on_cpu_float32_and_float64_only():
  def spec(shape=(4, 3, 3, 8), dtype="float32"):
    return BatchNormSpec(shape, dtype)

  assert _bn_native.native_applicable(spec(), "cpu")
  assert _bn_native.native_applicable(spec(dtype="float64"), "cpu")
  for platform in ("gpu", "tpu"):
    assert not _bn_native.native_applicable(spec(), platform)
  for dtype in ("float16", "bfloat16"):
    assert not _bn_native.native_applicable(spec(dtype=dtype), "cpu")
  assert not _bn_native.native_applicable(spec((8,)), "cpu")
  assert not _bn_native.native_applicable(spec((0, 8)), "cpu")
  assert "native" in [k.name for k in autotune.kernels("batch_norm")]


@pytest.fixture
def native_off(monkeypatch):
  """``TUNEDJAX_NATIVE=0`` for the test, the process's memo of built libraries forgotten."""
  monkeypatch.setenv(_native.ENV_VAR, "0")
  _native.reset()
  yield
  _native.reset()  # before monkeypatch restores the variable; the next check re-reads it


def test_not_applicable_with_native_kernels_off(native_off):
  assert not _bn_native.native_applicable(BatchNormSpec((4, 8), "float32"), "cpu")


def _mlp_loss(params, x):
  h = x @ params["w"]
  h = jax.nn.relu(_bn_family.batch_norm(h, params["g"], params["b"]))
  return jnp.mean(h ** 2)


def _mlp(rng):
  params = {"w": jnp.asarray(rng.normal(size=(5, 6)), jnp.float32),
            "g": jnp.asarray(1 + 0.2 * rng.normal(size=6), jnp.float32),
            "b": jnp.asarray(rng.normal(size=6), jnp.float32)}
  return params, jnp.asarray(rng.normal(size=(32, 5)) + 2.0, jnp.float32)


def _bn_sites(f):
  return {(c.kernel, c.why): c.count
          for c in f.report(memory=False).last.kernel_report.of("batch_norm")}


@pytest.mark.slow
@needs_native
def test_a_cached_native_winner_where_native_is_off_does_not_crash(rng, tmp_path, monkeypatch):
  params, x = _mlp(rng)
  grad = jax.grad(_mlp_loss)
  want = jax.jit(grad)(params, x)
  config = {"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)}}
  with tj.config_context(config):
    tj.jit(grad, session=autotune.TuningSession())(params, x)  # tunes the one bucket
    cache = autotune.Cache(str(tmp_path))
    (entry,) = cache.entries("batch_norm")
    cache.put("batch_norm", entry.key, {**entry.value, "winner": "native"})  # as if it won
    f = tj.jit(grad, session=autotune.TuningSession())
    f(params, x)
    assert _bn_sites(f) == {("native", "hit"): 1}  # the edited entry is the one read
    # The same cache where native kernels are off (no compiler; TUNEDJAX_NATIVE=0).
    monkeypatch.setenv(_native.ENV_VAR, "0")
    _native.reset()
    try:
      for hints in ({}, {"batch_norm": "native"}):  # the cached winner, a hint
        with tj.config_context({"kernel": {"hints": hints}}):
          f = tj.jit(grad, session=autotune.TuningSession())
          with pytest.warns(autotune.HintWarning) if hints else contextlib.nullcontext():
            got = f(params, x)
        assert "native" not in {k for k, _ in _bn_sites(f)}
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
          assert _rel(g, w) < 1e-4
    finally:
      monkeypatch.delenv(_native.ENV_VAR)
      _native.reset()


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.bn2 = nnx.BatchNorm(8, epsilon=1e-3, use_scale=False, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.bn1(self.conv(x)))
    h = jnp.tanh(self.bn2(h))
    return self.head(h.mean((1, 2)))


@pytest.mark.slow
@needs_native
def test_flax_batch_norm_pinned_to_native_equals_flax(rng, tmp_path):
  graphdef, params, stats = nnx.split(_Net(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
  key = iter(jax.random.split(jax.random.key(1), 64))
  params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(key), p.shape), params)
  x = jnp.asarray(rng.normal(size=(6, 7, 7, 3)) * 2.0 + 0.5, jnp.float32)
  y = jnp.asarray(rng.integers(0, 4, size=6), jnp.int32)

  def loss(params, stats, x, y):
    m = nnx.merge(graphdef, params, stats, copy=True)
    value = optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    return value, nnx.state(m, nnx.BatchStat)

  step = jax.value_and_grad(loss, has_aux=True)
  want = jax.jit(step)(params, stats, x, y)
  config = {"kernel": {"enable": True, "hints": {"conv": "xla", "batch_norm": "native"}},
            "cache": {"dir": str(tmp_path)}}
  with tj.config_context(config):
    f = tj.jit(ops.batch_norm.route_batch_norm()(step), session=autotune.TuningSession())
    got = f(params, stats, x, y)
  assert _bn_sites(f) == {("native", "hint"): 2}
  (loss_got, stats_got), grads_got = got
  (loss_want, stats_want), grads_want = want
  assert _rel(loss_got, loss_want) < 1e-5
  for g, w in zip(jax.tree.leaves(stats_got), jax.tree.leaves(stats_want)):
    assert _rel(g, w) < 1e-5
  for g, w in zip(jax.tree.leaves(grads_got), jax.tree.leaves(grads_want)):
    assert _rel(g, w) < 2e-4


@needs_native
def test_explicitly_sharded_input_runs_on_auto_axes(rng, tmp_path, mesh8_explicit):
  # The FFI calls have no sharding rule: on Explicit axes they run on Auto axes and y keeps
  # x's sharding (without it, the backward's dx type would not match x's).
  x = rng.normal(size=(16, 4, 4, 8)) * 2 + 1
  scale, bias = rng.normal(size=8), rng.normal(size=8)
  sharded = jax.sharding.NamedSharding(mesh8_explicit, jax.sharding.PartitionSpec("data"))
  x = jax.device_put(jnp.asarray(x, jnp.float32), sharded)
  scale, bias = jnp.asarray(scale, jnp.float32), jnp.asarray(bias, jnp.float32)

  def loss(x, scale, bias):
    return jnp.sum(jnp.sin(_bn_family.batch_norm(x, scale, bias)))

  step = jax.value_and_grad(loss, argnums=(0, 1, 2))
  config = {"kernel": {"enable": True, "hints": {"batch_norm": "native"}},
            "cache": {"dir": str(tmp_path)}}
  with jax.set_mesh(mesh8_explicit):
    want = jax.jit(step)(x, scale, bias)
    with tj.config_context(config):
      f = tj.jit(step, session=autotune.TuningSession())
      got = f(x, scale, bias)
  assert _bn_sites(f) == {("native", "hint"): 1}
  assert got[1][0].sharding.spec == want[1][0].sharding.spec
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _rel(g, w) < 1e-4
