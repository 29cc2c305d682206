"""Tests of loss scaling, all_finite, select_tree, scaled_value_and_grad and
skip_nonfinite, including a float16 CNN trained against its float32 twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tunedjax as tj
from tunedjax import mixed_precision as mp


def test_every_field_survives_jit():
  # jmp PR #44: min_loss_scale was dropped by tree_flatten and reset under jit.
  ls = mp.DynamicLossScale(1024.0, growth_interval=7, growth_factor=3.0,
                           backoff_factor=0.25, min_scale=4.0, counter=5)
  out = jax.jit(lambda s: s)(ls)
  adjusted = jax.jit(lambda s: s.adjust(jnp.bool_(False)))(ls)
  for obj in (out, adjusted):
    assert (obj.growth_interval, obj.growth_factor, obj.backoff_factor, obj.min_scale) == (
        7, 3.0, 0.25, 4.0)
  assert float(out.loss_scale) == 1024.0 and int(out.counter) == 5
  assert float(adjusted.loss_scale) == 256.0 and int(adjusted.counter) == 0
  # min_scale holds after the round trip: backing off stops at 4.
  s = adjusted
  for _ in range(10):
    s = jax.jit(lambda s: s.adjust(jnp.bool_(False)))(s)
  assert float(s.loss_scale) == 4.0
  static = jax.jit(lambda s: s)(mp.StaticLossScale(8.0))
  assert float(static.loss_scale) == 8.0
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
  assert paths == [".loss_scale", ".counter"]


def test_scale_stays_float32_in_a_float16_model():
  # jmp issue #47: a float16 scale broke adjust() and overflows when grown.
  ls = mp.DynamicLossScale(jnp.float16(2**15), growth_interval=1)
  assert ls.loss_scale.dtype == jnp.float32
  grads = jnp.ones(5, jnp.float16)
  grown = ls.adjust(mp.all_finite(grads))
  assert grown.loss_scale.dtype == jnp.float32 and float(grown.loss_scale) == 2.0**16
  backed = ls.adjust(~mp.all_finite(grads))
  assert backed.loss_scale.dtype == jnp.float32 and float(backed.loss_scale) == 2.0**14
  scaled = grown.scale(jnp.float16(0.5))  # 2**15: representable in float16
  assert scaled.dtype == jnp.float16 and float(scaled) == 2.0**15
  assert grown.unscale(scaled).dtype == jnp.float16 and float(grown.unscale(scaled)) == 0.5


def test_dynamic_schedule(rng):
  ls = mp.DynamicLossScale(64.0, growth_interval=3, min_scale=16.0)
  finite = [True, True, True, False, True, False, False, False, True, True, True]
  scales = []
  for f in finite:
    ls = ls.adjust(jnp.bool_(f))
    scales.append(float(ls.loss_scale))
  assert scales == [64, 64, 128, 64, 64, 32, 16, 16, 16, 16, 32]
  g = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
  np.testing.assert_allclose(ls.unscale(ls.scale(g)), g, rtol=1e-6)
  assert ls.scale(g).dtype == jnp.float32
  assert ls.scale({"n": jnp.arange(3)})["n"].dtype == jnp.arange(3).dtype  # ints untouched


def test_scale_objects_are_immutable_and_return_new_objects():
  ls = mp.DynamicLossScale()
  assert float(ls.loss_scale) == 2.0**15 and ls.growth_interval == 2000
  new = ls.adjust(jnp.bool_(False))
  assert new is not ls and float(ls.loss_scale) == 2.0**15
  with pytest.raises(AttributeError):
    ls.min_scale = 2.0
  noop = mp.NoOpLossScale()
  assert noop.adjust(jnp.bool_(False)) is noop and noop.unscale(3.0) == 3.0


@pytest.mark.parametrize("kwargs, shows", [
    ({"growth_interval": 0}, "growth_interval"),
    ({"backoff_factor": 1.5}, "backoff_factor"),
    ({"min_scale": 0.0}, "min_scale"),
    ({"growth_factor": 0.5}, "growth_factor"),
])
def test_bad_schedules_are_rejected(kwargs, shows):
  with pytest.raises(ValueError, match=shows):
    mp.DynamicLossScale(**kwargs)


def test_all_finite_and_select_tree(rng):
  a = {"w": jnp.asarray(rng.normal(size=(3,)), jnp.float16), "i": jnp.arange(2)}
  assert bool(mp.all_finite(a)) and bool(mp.all_finite({}))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    assert not bool(mp.all_finite({**a, "w": a["w"].at[1].set(bad)}))
  b = jax.tree_util.tree_map(lambda x: x + 1, a)
  picked = jax.jit(mp.select_tree)(jnp.bool_(False), a, b)
  np.testing.assert_array_equal(picked["w"], b["w"])
  with pytest.raises(ValueError, match="same structure"):
    mp.select_tree(jnp.bool_(True), a, {"w": a["w"]})


def test_scaled_value_and_grad_returns_unscaled_gradients(rng):
  w = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)

  def loss_fn(w, x):
    y = jnp.tanh(x @ w)
    return jnp.mean(y ** 2), {"y": y}

  (want_loss, aux), want = jax.value_and_grad(loss_fn, has_aux=True)(w, x)
  fn = jax.jit(mp.scaled_value_and_grad(loss_fn, has_aux=True))
  (loss, got_aux), grads, finite = fn(mp.DynamicLossScale(2.0**12), w, x)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(got_aux["y"], aux["y"], rtol=1e-6)
  np.testing.assert_allclose(grads, want, rtol=1e-5)
  assert bool(finite)
  _, gx, _ = mp.scaled_value_and_grad(lambda w, x: loss_fn(w, x)[0], argnums=1)(
      mp.StaticLossScale(8.0), w, x)
  np.testing.assert_allclose(gx, jax.grad(lambda x: loss_fn(w, x)[0])(x), rtol=1e-5)


def test_an_injected_inf_gradient_is_skipped(rng):
  params = {"w": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
  opt = mp.skip_nonfinite(optax.adam(0.1))
  state = opt.init(params)
  good = {"w": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
  update = jax.jit(opt.update)
  u, state = update(good, state, params)
  params = optax.apply_updates(params, u)
  before_params, before_state = params, state
  u, state = update({"w": good["w"].at[0].set(jnp.inf)}, state, params)
  after = optax.apply_updates(params, u)
  np.testing.assert_array_equal(after["w"], before_params["w"])
  for x, y in zip(jax.tree_util.tree_leaves(state.inner_state),
                  jax.tree_util.tree_leaves(before_state.inner_state)):
    np.testing.assert_array_equal(x, y)
  assert (int(state.skipped), int(state.consecutive_skipped), bool(state.last_finite)) == (
      1, 1, False)
  u, state = update(good, state, params)
  assert (int(state.skipped), int(state.consecutive_skipped)) == (1, 0)
  assert not np.array_equal(optax.apply_updates(params, u)["w"], params["w"])


def test_loss_scale_for_follows_the_config_values():
  assert isinstance(mp.loss_scale_for("mixed_float16"), mp.DynamicLossScale)
  assert isinstance(mp.loss_scale_for("mixed_bfloat16"), mp.NoOpLossScale)
  assert isinstance(mp.loss_scale_for("mixed_bfloat16", "dynamic"), mp.DynamicLossScale)
  assert float(mp.loss_scale_for("mixed_float16", "static").loss_scale) == 2.0**15
  assert isinstance(mp.loss_scale_for("mixed_float16", "none"), mp.NoOpLossScale)
  with pytest.raises(ValueError, match="'auto', 'dynamic', 'static' or 'none'"):
    mp.loss_scale_for("mixed_float16", "always")
  # With no arguments, the active config decides.
  with tj.config_context({"mixed_precision": {"policy": "p=f32,c=f16,o=f32"}}):
    assert isinstance(mp.loss_scale_for(), mp.DynamicLossScale)
    with tj.config_context({"mixed_precision": {"loss_scale": "static"}}):
      assert isinstance(mp.loss_scale_for(), mp.StaticLossScale)
  assert isinstance(mp.loss_scale_for(), mp.NoOpLossScale)  # default policy: bfloat16


# A small CNN in float16 against its float32 twin.


def _cnn_problem():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(32, 8, 8, 3)), jnp.float32)
  teacher = rng.normal(size=(8 * 8 * 3, 4))
  y = jnp.asarray(np.argmax(np.asarray(x).reshape(32, -1) @ teacher, -1), jnp.int32)
  k = jax.random.split(jax.random.key(0), 3)
  params = {"c1": jax.random.normal(k[0], (3, 3, 3, 8)) * 0.3,
            "c2": jax.random.normal(k[1], (3, 3, 8, 8)) * 0.2,
            "fc": jax.random.normal(k[2], (8 * 16, 4)) * 0.1}
  return params, x, y


def _cnn_loss(policy):
  def loss_fn(params, x, y):
    p, x = policy.cast_to_compute((params, x))
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dn))
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn))
    logits = policy.cast_to_output(h.reshape(h.shape[0], -1) @ p["fc"])
    # A summed (not averaged) loss: its gradients overflow float16 at 2**15.
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
  return loss_fn


def _train(policy, loss_scale, updates):
  """Trains until `updates` steps were applied (skipped steps don't count)."""
  params, x, y = _cnn_problem()
  opt = mp.skip_nonfinite(optax.adam(3e-3))
  grad_fn = mp.scaled_value_and_grad(_cnn_loss(policy))

  @jax.jit
  def step(params, opt_state, ls):
    loss, grads, finite = grad_fn(ls, params, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ls.adjust(finite), loss

  opt_state = opt.init(params)
  scales, losses = [], []
  while len(scales) - int(opt_state.skipped) < updates and len(scales) < 2 * updates:
    params, opt_state, loss_scale, loss = step(params, opt_state, loss_scale)
    assert bool(mp.all_finite(params)), "a non-finite value reached the parameters"
    scales.append(float(loss_scale.loss_scale))
    losses.append(float(loss))
  final = float(_cnn_loss(mp.get_policy("float32"))(params, x, y))
  return final, scales, losses, int(opt_state.skipped)


@pytest.mark.slow
def test_float16_cnn_overflows_backs_off_grows_and_matches_float32():
  updates = 30
  want, _, want_losses, skipped32 = _train(mp.get_policy("float32"), mp.NoOpLossScale(), updates)
  got, scales, _, skipped = _train(mp.get_policy("mixed_float16"),
                                   mp.DynamicLossScale(2.0**15, growth_interval=10), updates)
  assert skipped32 == 0 and want < 0.5 * want_losses[0]  # float32 learns
  assert scales[0] < 2.0**15, "the first step should overflow float16 and back off"
  low = min(scales)
  assert low < 2.0**15 and scales[-1] > low, "the scale should grow after backing off"
  assert skipped >= 1 and skipped == sum(
      1 for a, b in zip([2.0**15] + scales, scales) if b < a)  # every back-off was a skip
  assert len(scales) == updates + skipped
  # The same number of applied updates: float16 with loss scaling tracks float32.
  assert abs(got - want) / want < 0.05, (got, want)


# --- issue 19: adjust takes a boolean scalar; the schedule's numbers are checked ------------


@pytest.mark.parametrize("flag", [
    jnp.isfinite(jnp.array([1.0, jnp.inf, 2.0])),   # per-element: the careless call
    np.array([True, True]),
    jnp.float32(1.0),                                # a number, not a flag
    [True],
])
def test_adjust_needs_a_boolean_scalar(flag):
  """jmp asserts "Expected boolean scalar"; the scale silently became a vector."""
  ls = mp.DynamicLossScale(8.0)
  with pytest.raises(ValueError, match=r"grads_finite=.*boolean scalar") as e:
    ls.adjust(flag)
  assert "all_finite" in str(e.value)
  with pytest.raises(ValueError, match="boolean scalar"):
    jax.jit(lambda s, f: s.adjust(f))(ls, flag)


@pytest.mark.parametrize("flag", [True, np.bool_(False), jnp.bool_(True)])
def test_adjust_takes_python_and_numpy_booleans(flag):
  adjusted = mp.DynamicLossScale(8.0, growth_interval=1).adjust(flag)
  assert adjusted.loss_scale.shape == () and float(adjusted.loss_scale) == (
      16.0 if flag else 4.0)


@pytest.mark.parametrize("kwargs, shows", [
    ({"initial_scale": -1.0}, "initial_scale"),
    ({"initial_scale": float("nan")}, "initial_scale"),
    ({"initial_scale": float("inf")}, "initial_scale"),
    ({"initial_scale": jnp.ones(3)}, "initial_scale"),
    ({"initial_scale": "big"}, "initial_scale"),
    ({"initial_scale": None}, "initial_scale"),
    ({"counter": -1}, "counter"),
    ({"counter": 1.5}, "counter"),
    ({"growth_factor": "2"}, "growth_factor"),
    ({"growth_factor": float("inf")}, "growth_factor"),
    ({"min_scale": float("nan")}, "min_scale"),
    ({"growth_interval": True}, "growth_interval"),
])
def test_bad_dynamic_values_name_the_argument(kwargs, shows):
  with pytest.raises(tj.ConfigError, match=shows):
    mp.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("value", [0, -2.0, float("nan"), jnp.ones(2), "1", None, True])
def test_bad_static_values_name_the_argument(value):
  with pytest.raises(tj.ConfigError, match="StaticLossScale.value"):
    mp.StaticLossScale(value)


# Ported from jmp's loss_scale_test.py (scale/unscale, adjust up and down, min scale).


@pytest.mark.parametrize("cls, scale", [(mp.StaticLossScale, 2), (mp.StaticLossScale, 3),
                                        (mp.DynamicLossScale, 2.0), (mp.DynamicLossScale, 4.0)])
def test_jmp_scale_unscale(cls, scale):
  loss_scale = cls(scale)
  assert float(loss_scale.scale({"a": jnp.array(1.0)})["a"]) == 1.0 * scale
  assert float(loss_scale.unscale({"a": jnp.array(1.0 * scale)})["a"]) == 1.0


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_jmp_adjust_increases_on_finite(period, factor):
  ls = mp.DynamicLossScale(jnp.float32(10), counter=jnp.int32(0), growth_interval=period,
                           growth_factor=factor)
  for i in range(1, period):
    ls = ls.adjust(jnp.bool_(True))
    assert float(ls.loss_scale) == 10 and int(ls.counter) == i
  ls = ls.adjust(jnp.bool_(True))
  assert float(ls.loss_scale) == 10 * factor and int(ls.counter) == 0


@pytest.mark.parametrize("factor, min_scale", [(2, 1.0), (3, 0.37), (2, 0.3125)])
def test_jmp_adjust_reduces_on_non_finite_down_to_the_minimum(factor, min_scale):
  ls = mp.DynamicLossScale(np.float32(10), backoff_factor=1 / factor, min_scale=min_scale)
  for i in range(100):
    ls = ls.adjust(jnp.bool_(False))
    np.testing.assert_allclose(ls.loss_scale, max(min_scale, 10 / factor ** (i + 1)),
                               rtol=1e-5)
    assert int(ls.counter) == 0
