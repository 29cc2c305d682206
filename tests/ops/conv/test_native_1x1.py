"""`matmul_1x1_native`: pointwise convolutions in C++ against lax in float64.

Each of the three convolutions a 1x1 conv takes in a train step (forward,
input gradient, weight gradient, as autodiff emits them for any dimension
numbers) is run through the kernel and compared with
`lax.conv_general_dilated` in float64; a small model's gradient under
`tunedjax.jit` with the kernel pinned matches `jax.grad`; results are bitwise
reproducible; the kernel is not applicable off CPU or without native kernels,
and a tuning cache that chose it still works where it cannot run.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import tunedjax as tj
from tests.autotune import selection_helpers as h
from tunedjax import _native, _tuning
from tunedjax.ops.conv import _native_1x1 as native_1x1
from tunedjax.autotune import _multihost, _registry, _report, _select
from tunedjax.ops.conv._spec import ConvSpec

NAME = native_1x1.NAME
NHWC = ("NHWC", "HWIO", "NHWC")

pytestmark = pytest.mark.skipif(not _native.available(native_1x1.SOURCE),
                                reason="native kernels unavailable (no C++ compiler?)")


def test_the_kernel_is_built_in():
  assert NAME in [k.name for k in _registry.kernels("conv")]


@contextlib.contextmanager
def x64():
  old = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", old)


def train_step_convs(lhs_shape, rhs_shape, dtype, **kwargs):
  """The forward, weight-gradient and input-gradient equations of one conv: [(spec, params)]."""
  def step(x, w, g):
    y, vjp = jax.vjp(lambda a, b: lax.conv_general_dilated(a, b, **kwargs), x, w)
    return y, vjp(g)
  x = jax.ShapeDtypeStruct(lhs_shape, dtype)
  w = jax.ShapeDtypeStruct(rhs_shape, dtype)
  g = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kwargs), x, w)
  found = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "conv_general_dilated":
        found.append((ConvSpec.from_equation(e), e.params))
      for p in e.params.values():
        inner = getattr(p, "jaxpr", p)
        if hasattr(inner, "eqns"):
          walk(inner)

  walk(jax.make_jaxpr(step)(x, w, g).jaxpr)
  assert len(found) == 3, found
  return found


def check_train_step(lhs_shape, rhs_shape, dtype, rtol, seed=0, **kwargs):
  """Runs the kernel on each train-step conv (random operands of its shapes);
  compares with the equation itself, `lax.conv_general_dilated`, in float64."""
  kernel = _registry.get_kernel("conv", NAME)
  rng = np.random.default_rng(seed)
  forms = []
  with x64():
    for spec, params in train_step_convs(lhs_shape, rhs_shape, dtype, **kwargs):
      assert kernel.applicable(spec, "cpu"), spec
      forms.append("wgrad" if native_1x1.is_weight_grad_form(spec) else "matmul")
      lhs = rng.normal(size=spec.lhs_shape).astype(dtype)
      rhs = rng.normal(size=spec.rhs_shape).astype(dtype)
      both = jax.jit(lambda a, b, s=spec, p=params: (
          kernel.fn(a, b, s),
          lax.conv_general_dilated_p.bind(a.astype(jnp.float64), b.astype(jnp.float64), **p)))
      got, want = jax.device_get(both(lhs, rhs))
      assert got.shape == want.shape == spec.out_shape and got.dtype == np.dtype(dtype)
      err = float(np.max(np.abs(got.astype(np.float64) - want)) / (np.max(np.abs(want)) + 1e-30))
      assert err < rtol, f"relative error {err:.3g} on {spec}"
  # With every spatial size 1 each conv is also a whole-window conv (either form computes it).
  assert "wgrad" in forms
  return sorted(forms)


@st.composite
def pointwise_cases(draw, nsp=(1, 2), channels=(1, 70)):
  """A 1x1 conv with random dimension numbers: (lhs shape, rhs shape, kwargs)."""
  n_sp = draw(st.sampled_from(nsp))
  n = draw(st.integers(1, 3))
  c, o = draw(st.integers(*channels)), draw(st.integers(*channels))
  xs = [draw(st.integers(1, 7)) for _ in range(n_sp)]
  specs = [tuple(draw(st.permutations(range(n_sp + 2)))) for _ in range(3)]
  lhs_shape, rhs_shape = [0] * (n_sp + 2), [0] * (n_sp + 2)
  for dim, size in zip(specs[0], (n, c, *xs)):
    lhs_shape[dim] = size
  for dim, size in zip(specs[1], (o, c, *[1] * n_sp)):
    rhs_shape[dim] = size
  kwargs = {"window_strides": (1,) * n_sp, "padding": [(0, 0)] * n_sp,
            "dimension_numbers": lax.ConvDimensionNumbers(*specs)}
  return tuple(lhs_shape), tuple(rhs_shape), kwargs


@settings(max_examples=12)
@given(pointwise_cases())
def test_every_train_step_form_matches_lax_float64(case):
  lhs_shape, rhs_shape, kwargs = case
  check_train_step(lhs_shape, rhs_shape, np.float64, 1e-12, **kwargs)


@settings(max_examples=5)
@given(pointwise_cases(nsp=(2,)))
def test_every_train_step_form_matches_lax_float32(case):
  lhs_shape, rhs_shape, kwargs = case
  check_train_step(lhs_shape, rhs_shape, np.float32, 1e-5, **kwargs)


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("cin,cout", [(32, 32), (24, 70), (128, 9), (5, 130)])
def test_many_rows_split_in_chunks_match_lax(dtype, rtol, cin, cout):
  # 8x16x16 = 2048 rows: the weight gradient's sums are split over row chunks;
  # channel counts with and without vector tails, every register-tile width.
  forms = check_train_step((8, 16, 16, cin), (1, 1, cin, cout), dtype, rtol, seed=1,
                           window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)
  assert forms == ["matmul", "matmul", "wgrad"]


def test_results_are_bitwise_reproducible(rng):
  kernel = _registry.get_kernel("conv", NAME)
  for spec, _ in train_step_convs((16, 16, 16, 40), (1, 1, 40, 48), jnp.float32,
                                  window_strides=(1, 1), padding="VALID",
                                  dimension_numbers=NHWC):
    lhs = jnp.asarray(rng.normal(size=spec.lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
    run = jax.jit(kernel.fn, static_argnums=2)
    runs = [np.asarray(run(lhs, rhs, spec)) for _ in range(3)]
    assert all(np.array_equal(runs[0], r) for r in runs[1:]), spec


def _terms(x, w1, w2):
  y = lax.conv_general_dilated(x, w1, (1, 1), "VALID", dimension_numbers=NHWC)
  y = lax.conv_general_dilated(jax.nn.relu(y), w2, (1, 1), "VALID", dimension_numbers=NHWC)
  return jnp.sin(y)


def _model(x, w1, w2):
  return jnp.sum(_terms(x, w1, w2))


def _config(tmp_path, **kernel):
  return {"kernel": {"enable": True, **kernel}, "cache": {"dir": str(tmp_path / "cache")},
          "layout": {"enable": False}, "mixed_precision": {"enable": False}}


def test_pinned_model_gradient_matches_jax_grad(tmp_path, rng):
  args = [jnp.asarray(rng.normal(size=s), jnp.float32)
          for s in ((4, 6, 6, 20), (1, 1, 20, 36), (1, 1, 36, 12))]
  grad = jax.value_and_grad(_model, argnums=(0, 1, 2))
  with tj.config_context(_config(tmp_path, hints={"conv": NAME})):
    step = tj.jit(grad)
    got = step(*args)
    hlo = step.lower(*args).compile().as_text()
  # two forwards, two weight gradients, two input gradients
  assert hlo.count('custom_call_target="tunedjax_TjPointwise') == 6, hlo
  # Judged against float64 beside XLA's own float32. The loss, a sum of 1,728 sines,
  # cancels (6.6 of a sum of magnitudes near 1,000): its error is judged against the
  # sum of its terms' magnitudes, what a float32 sum in any order can promise; a
  # gradient's against its largest entry.
  with jax.enable_x64():
    args64 = [jnp.asarray(a, jnp.float64) for a in args]
    want = jax.tree.map(np.asarray, grad(*args64))
    scales = [float(np.sum(np.abs(_terms(*args64))))] + [
        float(np.max(np.abs(g))) for g in jax.tree.leaves(want[1])]
  def err(a):  # the largest over leaves of max|a - want| / scale, in float64
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - v))) / scale
               for u, v, scale in zip(jax.tree.leaves(a), jax.tree.leaves(want), scales))
  assert err(got) <= 3 * err(grad(*args)) + 1e-6, (err(got), err(grad(*args)))


def test_not_applicable_off_cpu_or_outside_its_forms():
  spec = ConvSpec.from_arrays(np.ones((2, 4, 4, 8), np.float32),
                              np.ones((1, 1, 8, 16), np.float32), dimension_numbers=NHWC)
  kernel = _registry.get_kernel("conv", NAME)
  assert kernel.applicable(spec, "cpu")
  assert not kernel.applicable(spec, "gpu") and not kernel.applicable(spec, "tpu")

  def spec_of(lhs=(2, 8, 8, 8), rhs=(1, 1, 8, 16), dtype=np.float32, **kw):
    kw.setdefault("dimension_numbers", NHWC)
    kw.setdefault("padding", [(0, 0), (0, 0)])
    return ConvSpec.from_arrays(np.ones(lhs, dtype), np.ones(rhs, dtype), **kw)

  outside = [spec_of(rhs=(3, 3, 8, 16)),                         # 3x3
             spec_of(window_strides=(2, 2)),                     # strided
             spec_of(padding=[(1, 1), (0, 0)]),                  # padded
             spec_of(lhs_dilation=(2, 1)),
             spec_of(rhs=(1, 1, 4, 16), feature_group_count=2),  # grouped
             spec_of(dtype=np.int32),
             spec_of(dtype=jnp.bfloat16),
             spec_of(rhs=(6, 8, 8, 16))]  # a window covering all but the lhs's first 2 rows
  for s in outside:
    assert not kernel.applicable(s, "cpu"), s
  # the strided 1x1 conv's weight gradient carries rhs dilation: not this kernel's form
  convs = train_step_convs((2, 5, 5, 4), (1, 1, 4, 6), jnp.float32, window_strides=(2, 2),
                           padding="VALID", dimension_numbers=NHWC)
  assert [kernel.applicable(s, "cpu") for s, _ in convs] == [False, False, False]


@pytest.fixture
def native_off_later(monkeypatch):
  """A function that sets TUNEDJAX_NATIVE=0 when called; native kernels back after the test."""
  def turn_off():
    monkeypatch.setenv(_native.ENV_VAR, "0")
    _native.reset()
  yield turn_off
  monkeypatch.delenv(_native.ENV_VAR, raising=False)
  _native.reset()


@pytest.fixture
def native_off(native_off_later):
  """TUNEDJAX_NATIVE=0 for the test; native kernels back afterwards."""
  native_off_later()


def test_not_applicable_with_native_kernels_off(native_off):
  spec = ConvSpec.from_arrays(np.ones((2, 4, 4, 8), np.float32),
                              np.ones((1, 1, 8, 16), np.float32), dimension_numbers=NHWC)
  assert not _registry.get_kernel("conv", NAME).applicable(spec, "cpu")
  assert "matmul_1x1" in [k.name for k in _registry.applicable_kernels(spec, "cpu")]


def _set_winners(cache_dir: pathlib.Path, name: str) -> int:
  count = 0
  for path in cache_dir.glob("*.json"):
    text = path.read_text()
    data = json.loads(text)

    def visit(value):
      nonlocal count
      if isinstance(value, dict):
        if "winner" in value and "timings" in value:
          value["winner"] = name
          count += 1
        for v in value.values():
          visit(v)
      elif isinstance(value, list):
        for v in value:
          visit(v)

    visit(data)
    path.write_text(json.dumps(data))
  return count


@pytest.mark.slow
def test_a_cache_that_chose_it_still_runs_without_native_kernels(tmp_path, rng, native_off_later):
  args = [jnp.asarray(rng.normal(size=s), jnp.float32)
          for s in ((2, 4, 4, 8), (1, 1, 8, 16), (1, 1, 16, 8))]
  grad = jax.value_and_grad(_model, argnums=(0, 1, 2))
  want = grad(*args)
  with h.isolated_selection(tmp_path):
    jax.jit(_select.select_kernels(grad, rounds=1, budget_s=2.0))(*args)
    assert _set_winners(tmp_path / "cache", NAME) >= 3  # as if it had won every bucket
    native_off_later()
    _tuning.default_session().forget_measured()  # read the cache file again
    counts = {}
    got = jax.jit(_select.select_kernels(
        grad, rounds=1, budget_s=2.0, on_report=lambda r: counts.update(r.counts())))(*args)
  assert h.max_rel_err(got, want) < 1e-5
  assert counts and not any(NAME in k for k in counts), counts


def test_a_leader_that_chose_it_gives_the_default_where_it_cannot_run(native_off, monkeypatch):
  # A multi-host job: process 0 decided (with native kernels); this process,
  # without them, receives the name and runs the default instead.
  monkeypatch.setattr(_multihost, "agree", lambda decide, names: NAME)
  spec = ConvSpec.from_arrays(np.ones((2, 4, 4, 8), np.float32),
                              np.ones((1, 1, 8, 16), np.float32), dimension_numbers=NHWC)
  selection = _select.new_selection(platform="cpu", cache=False)
  name, why = _select.decide(_registry.op_family("conv"), spec, selection)
  assert name == "xla" and why == _report.NOT_APPLICABLE
