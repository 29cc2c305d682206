"""Tests of `wrap` on nnx and linen models: they train, parameters stay
float32 (O1) or half except norms (O2), norm layers run in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from tests.rewrite import cases
from tunedjax import mixed_precision as mp
from tunedjax import rewrite

REGION_F32 = "tunedjax_precision_float32"


class _Net(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.ln = nnx.LayerNorm(16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.bn(self.ln(self.l1(x)))))


def _data(rng):
  x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
  return x, y


def _param_dtypes(module):
  return {jax.tree_util.keystr(p): v.dtype
          for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(module, nnx.Param))}


def _eqn_dtypes(closed, name, *, in_region):
  return [tuple(str(v.aval.dtype) for v in e.invars) for e in rewrite.iter_equations(closed)
          if e.primitive.name == name and (REGION_F32 in str(e.source_info.name_stack)) == in_region]


def _train_nnx(model, x, y, steps, opt=optax.adam(1e-2)):
  optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return [float(step(model, optimizer)) for _ in range(steps)]


@pytest.mark.slow
def test_nnx_o1_trains_with_float32_params_and_float32_norms(rng):
  x, y = _data(rng)
  reference = _Net(nnx.Rngs(0))
  model = mp.wrap(_Net(nnx.Rngs(0)), "mixed_bfloat16")
  assert isinstance(model, mp.MixedPrecision)
  out = model(x)
  assert out.dtype == jnp.float32
  err = np.linalg.norm(out - reference(x)) / np.linalg.norm(reference(x))
  assert 0 < err < 1e-2
  graphdef, state = nnx.split(model)
  closed = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  assert _eqn_dtypes(closed, "dot_general", in_region=False) == [("bfloat16", "bfloat16")] * 2
  normed = [d for n in ("sub", "mul", "add", "reduce_sum", "rsqrt")
            for d in _eqn_dtypes(closed, n, in_region=True)]
  assert len(normed) > 10 and all(set(d) == {"float32"} for d in normed), normed
  want = _train_nnx(reference, x, y, 8)
  losses = _train_nnx(model, x, y, 8)
  assert losses[-1] < 0.7 * losses[0]
  assert abs(losses[-1] - want[-1]) / want[-1] < 5e-2
  assert set(_param_dtypes(model.module).values()) == {jnp.dtype(jnp.float32)}
  # Batch statistics were updated through the wrapper.
  assert not np.allclose(model.module.bn.mean.get_value(), 0.0)


def test_nnx_overrides_per_class(rng):
  x, _ = _data(rng)
  model = mp.wrap(_Net(nnx.Rngs(0)), "mixed_bfloat16", overrides={nnx.Linear: "float32"})
  graphdef, state = nnx.split(model)
  closed = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  assert _eqn_dtypes(closed, "dot_general", in_region=True) == [("float32", "float32")] * 2
  # And the other way round: a norm layer put in bfloat16 on request.
  model = mp.wrap(_Net(nnx.Rngs(0)), "mixed_bfloat16", overrides={nnx.LayerNorm: "bf16"})
  graphdef, state = nnx.split(model)
  closed = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
  ln_scoped = [tuple(str(v.aval.dtype) for v in e.invars) for e in rewrite.iter_equations(closed)
               if "tunedjax_precision_bfloat16" in str(e.source_info.name_stack)
               and e.primitive.name == "mul"]
  assert ln_scoped and all(set(d) == {"bfloat16"} for d in ln_scoped)


def test_nnx_o2_half_params_except_norms_with_master_weights(rng):
  x, y = _data(rng)
  model = mp.wrap(_Net(nnx.Rngs(0)), "mixed_bfloat16", params="compute")
  dtypes = _param_dtypes(model.module)
  for path, dtype in dtypes.items():
    want = jnp.float32 if ("'ln'" in path or "'bn'" in path) else jnp.bfloat16
    assert dtype == want, (path, dtype)
  losses = _train_nnx(model, x, y, 8, mp.master_weights(optax.adam(1e-2)))
  assert losses[-1] < 0.7 * losses[0]
  assert _param_dtypes(model.module) == dtypes


@pytest.mark.slow
def test_linen_transformer_trains_under_o1_and_o2(rng):
  block = cases._Block()
  x = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)
  target = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)
  variables = block.init(jax.random.key(0), x)
  for level in ("O1", "O2"):
    wrapped = mp.wrap(block, "mixed_bfloat16", level=level)
    params = wrapped.init(jax.random.key(0), x)
    dtypes = {jax.tree_util.keystr(p): v.dtype for p, v in jax.tree_util.tree_leaves_with_path(params)}
    for path, dtype in dtypes.items():
      half = level == "O2" and "LayerNorm" not in path
      assert dtype == (jnp.bfloat16 if half else jnp.float32), (level, path)
    out = jax.jit(wrapped.apply)(params, x)
    want = block.apply(variables, x)
    assert out.dtype == jnp.float32
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 2e-2
    closed = jax.make_jaxpr(wrapped.apply)(params, x)
    assert all(d == ("bfloat16", "bfloat16")
               for d in _eqn_dtypes(closed, "dot_general", in_region=False))
    normed = _eqn_dtypes(closed, "reduce_sum", in_region=True) + _eqn_dtypes(
        closed, "mul", in_region=True)
    assert normed and all(set(d) == {"float32"} for d in normed)

    opt = mp.master_weights(optax.adam(3e-3)) if level == "O2" else optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state):
      loss, grads = jax.value_and_grad(
          lambda p: jnp.mean((wrapped.apply(p, x) - target) ** 2))(params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    losses = []
    for _ in range(6):
      params, opt_state, loss = step(params, opt_state)
      losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0], (level, losses)
    assert {jax.tree_util.keystr(p): v.dtype
            for p, v in jax.tree_util.tree_leaves_with_path(params)} == dtypes


def test_linen_mutable_batch_stats(rng):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      x = nn.Dense(8)(x)
      return nn.BatchNorm(use_running_average=not train)(x)

  x, _ = _data(rng)
  wrapped = mp.wrap(Net(), "mixed_bfloat16")
  variables = wrapped.init(jax.random.key(0), x, train=False)
  out, updates = wrapped.apply(variables, x, train=True, mutable=["batch_stats"])
  assert out.dtype == jnp.float32 and updates["batch_stats"]["BatchNorm_0"]["mean"].dtype == jnp.float32
  assert not np.allclose(updates["batch_stats"]["BatchNorm_0"]["mean"], 0.0)


def test_bad_arguments():
  with pytest.raises(mp.PolicyError, match="'O1' or 'O2'"):
    mp.wrap(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), level="O3")
  with pytest.raises(mp.PolicyError, match=r"params must be one of 'master' or 'compute'.*'O2'"):
    mp.wrap(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), params="O2")


def test_paddle_level_names_mean_the_same_storage(rng):
  for level, params in (("O1", "master"), ("O2", "compute")):
    a = mp.wrap(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16", level=level)
    b = mp.wrap(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16", params=params)
    assert a.module.kernel.get_value().dtype == b.module.kernel.get_value().dtype
    x = jnp.asarray(rng.normal(size=(3, 4)).astype(np.float32))
    np.testing.assert_array_equal(a(x), b(x))
  with pytest.raises(mp.PolicyError, match="nnx.Module or linen.Module"):
    mp.wrap(lambda x: x)
  with pytest.raises(mp.PolicyError, match="module classes"):
    mp.wrap(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), overrides={"Linear": "float32"})
  with pytest.raises(mp.PolicyError, match="floating"):
    mp.wrap(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "p=f32,c=int8")
