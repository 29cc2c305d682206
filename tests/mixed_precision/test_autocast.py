"""Tests of the autocast pass: where each op runs, and that the function it
computes (forward and gradient) matches float32 within bfloat16 tolerance."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.rewrite import cases
from tunedjax import mixed_precision as mp
from tunedjax import rewrite

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
CASES = {c.__name__: c for c in cases.ALL_CASES}
# Case -> the higher-order primitive whose body holds a dot to cast.
BODIES = {"scan_rnn": "scan", "cond_while": "cond", "checkpointed_block": "remat2"}


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def assert_close_trees(got, want, tol):
  """Each leaf within `tol` relative error; a leaf that is tiny next to the
  whole tree (a gradient that is zero in exact arithmetic, like a conv bias
  before BatchNorm) is measured against 1% of the tree's norm instead."""
  want_leaves = jax.tree_util.tree_leaves(want)
  floats = [np.asarray(w, np.float64).ravel() for w in want_leaves
            if jnp.issubdtype(w.dtype, jnp.floating)]
  tree_norm = np.linalg.norm(np.concatenate(floats)) if floats else 0.0
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), want_leaves):
    assert g.dtype == w.dtype and g.shape == w.shape, jax.tree_util.keystr(path)
    if jnp.issubdtype(w.dtype, jnp.floating):
      g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
      err = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 0.01 * tree_norm, 1e-30)
      assert err < tol, (jax.tree_util.keystr(path), err)
    else:
      np.testing.assert_array_equal(g, w)


def input_dtypes(closed, name):
  return [tuple(str(v.aval.dtype) for v in e.invars)
          for e in rewrite.iter_equations(closed) if e.primitive.name == name]


@functools.cache
def make(case_name):
  case = CASES[case_name](np.random.default_rng(0))
  out = jax.jit(case.fn)(case.params, case.batch)
  grads = jax.jit(jax.grad(case.fn))(case.params, case.batch) if case.differentiable else None
  return case, out, grads


def test_transformer_block_jaxpr():
  case, _, _ = make("linen_transformer")
  closed = jax.make_jaxpr(mp.autocast(case.fn, "mixed_bfloat16"))(case.params, case.batch)
  dots = [e for e in rewrite.iter_equations(closed) if e.primitive.name == "dot_general"]
  assert len(dots) >= 6  # q, k, v, scores, values, out, two MLP layers
  for e in dots:
    assert [v.aval.dtype for v in e.invars] == [BF16, BF16]
    assert e.params["preferred_element_type"] == F32 and e.outvars[0].aval.dtype == F32
  for name in ("exp", "reduce_sum", "rsqrt"):
    found = input_dtypes(closed, name)
    assert found and all(set(d) == {"float32"} for d in found), (name, found)
  # The original has no bfloat16 at all.
  original = jax.make_jaxpr(case.fn)(case.params, case.batch)
  assert not any("bfloat16" in str(v.aval) for e in rewrite.iter_equations(original)
                 for v in e.outvars)


SLOW_CASES = ("nnx_cnn", "optax_train_step")  # > 10 s on the shared 2-core machine


@pytest.mark.parametrize("case_name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_matches_float32_forward_and_gradient(case_name):
  case, want, want_grads = make(case_name)
  counts = []
  fn = mp.autocast(case.fn, "mixed_bfloat16", on_trace=lambda ctx: counts.append(ctx.counts))
  got = jax.jit(fn)(case.params, case.batch)
  if case_name == "optax_train_step":
    # Adam turns a gradient that is zero in exact arithmetic (a conv bias before
    # BatchNorm) into a full-size step of either sign: new parameters can
    # differ by up to two steps (2 * lr), the loss must still match.
    assert rel_err(got[1], want[1]) < 1e-2
    for g, w in zip(jax.tree_util.tree_leaves(got[0]["params"]),
                    jax.tree_util.tree_leaves(want[0]["params"])):
      np.testing.assert_allclose(g, w, atol=2.5e-2, rtol=0)
  else:
    assert_close_trees(got, want, 1e-2)
  assert any(k.endswith("in bfloat16") for k in counts[0]), counts[0]
  if case.differentiable:
    grads = jax.jit(jax.grad(fn))(case.params, case.batch)
    # BatchNorm's bias gradient is a sum of terms that nearly cancel, which
    # bfloat16 rounding moves by a few percent; every other gradient is < 1e-2.
    assert_close_trees(grads, want_grads, 5e-2 if case_name == "nnx_cnn" else 1e-2)
    # And not exact: the computation really changed precision.
    assert any(rel_err(g, w) > 0 for g, w in zip(jax.tree_util.tree_leaves(grads),
                                                 jax.tree_util.tree_leaves(want_grads)))


def assert_dots_cast_inside(closed, body):
  holders = [e for e in rewrite.iter_equations(closed) if e.primitive.name == body]
  assert holders, f"no {body} equation"
  inner = [d for e in holders for sub in jax.extend.core.jaxprs_in_params(e.params)
           for d in input_dtypes(sub, "dot_general")]
  assert inner and all(d == ("bfloat16", "bfloat16") for d in inner), (body, inner)


@pytest.mark.parametrize("case_name", BODIES)
def test_reaches_into_higher_order_bodies(case_name):
  case, _, _ = make(case_name)
  closed = jax.make_jaxpr(mp.autocast(case.fn, "mixed_bfloat16"))(case.params, case.batch)
  assert_dots_cast_inside(closed, BODIES[case_name])


@jax.custom_vjp
def _vjp_matmul(w, x):
  return jnp.tanh(x @ w)


def _vjp_matmul_fwd(w, x):
  y = jnp.tanh(x @ w)
  return y, (w, x, y)


def _vjp_matmul_bwd(res, g):
  w, x, y = res
  g = g * (1 - y ** 2)
  return x.T @ g, g @ w.T


_vjp_matmul.defvjp(_vjp_matmul_fwd, _vjp_matmul_bwd)


def test_reaches_into_while_custom_vjp_and_jit(rng):
  w = jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32)
  x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  jitted = jax.jit(lambda a, b: a @ b)  # inlined by the pass

  def f(w, x):
    # The while loop has no reverse-mode derivative: it runs on a constant.
    _, y = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.sin(c[1] @ c[1])),
                              (0, jax.lax.stop_gradient(x[:8])))
    return jnp.sum(_vjp_matmul(w, jitted(x, w)) ** 2) + jnp.sum(y)

  fn = mp.autocast(f)
  closed = jax.make_jaxpr(fn)(w, x)
  for body in ("while", "custom_vjp_call"):
    assert_dots_cast_inside(closed, body)
  assert input_dtypes(closed, "dot_general") == [("bfloat16", "bfloat16")] * 3
  assert rel_err(jax.jit(fn)(w, x), f(w, x)) < 1e-2
  assert rel_err(jax.jit(jax.grad(fn))(w, x), jax.grad(f)(w, x)) < 1e-2


def test_grad_inside_and_vmap_compose(rng):
  w = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(4, 3, 8)), jnp.float32)

  def loss(w, x):
    return jnp.sum(jax.nn.softmax(jnp.tanh(x @ w)) ** 2)

  want = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, x)
  got = jax.jit(jax.vmap(mp.autocast(jax.grad(loss)), in_axes=(None, 0)))(w, x)
  assert rel_err(got, want) < 1e-2
  assert got.dtype == F32


@pytest.mark.slow
@settings(max_examples=5, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(batch=st.integers(1, 5), d_in=st.integers(1, 17), d_hidden=st.integers(1, 33),
       d_out=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_mlp_matches_float32_for_any_shapes(batch, d_in, d_hidden, d_out, seed):
  r = np.random.default_rng(seed)
  params = {"w1": r.normal(size=(d_in, d_hidden)) / np.sqrt(d_in),
            "b1": r.normal(size=(d_hidden,)),
            "w2": r.normal(size=(d_hidden, d_out)) / np.sqrt(d_hidden)}
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
  x = jnp.asarray(r.normal(size=(batch, d_in)), jnp.float32)

  def loss(p, x):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean(jax.nn.log_softmax(h @ p["w2"]) ** 2)

  value, got = jax.jit(jax.value_and_grad(mp.autocast(loss, "p=f32,c=bf16,o=f32")))(params, x)
  want_value, want = jax.jit(jax.value_and_grad(loss))(params, x)
  assert rel_err(value, want_value) < 1e-2
  # bfloat16 keeps 8 bits of mantissa: 2**-8 per rounding, a few roundings deep.
  assert_close_trees(got, want, 3e-2)


def test_user_lists_override_the_defaults(rng):
  w = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)

  def f(w):
    return jnp.tanh(w @ w).sum()

  default = jax.make_jaxpr(mp.autocast(f))(w)
  assert input_dtypes(default, "dot_general") == [("bfloat16", "bfloat16")]
  assert input_dtypes(default, "tanh") == [("bfloat16",)]  # follows the dot's output
  kept = jax.make_jaxpr(mp.autocast(f, deny=["dot_general"]))(w)
  assert input_dtypes(kept, "dot_general") == [("float32", "float32")]
  assert input_dtypes(kept, "tanh") == [("float32",)]
  tanh_allowed = jax.make_jaxpr(mp.autocast(f, allow=[jax.lax.tanh_p], deny=["dot_general"]))(w)
  assert input_dtypes(tanh_allowed, "tanh") == [("bfloat16",)]
  no_reduce = jax.make_jaxpr(mp.autocast(f, allow=["reduce_sum"]))(w)
  assert input_dtypes(no_reduce, "reduce_sum") == [("bfloat16",)]


def test_float16_and_output_dtype(rng):
  x = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)
  out = mp.autocast(lambda x: x @ x, "p=f32,c=f16,o=f16")(x)
  assert out.dtype == jnp.float16
  closed = jax.make_jaxpr(mp.autocast(lambda x: x @ x, "mixed_float16"))(x)
  assert input_dtypes(closed, "dot_general") == [("float16", "float16")]
  same = jax.make_jaxpr(mp.autocast(lambda x: x @ x, "float32"))(x)
  assert input_dtypes(same, "dot_general") == [("float32", "float32")]


def test_precision_region_keeps_its_ops_in_its_dtype(rng):
  x = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)

  def f(x):
    y = x @ x
    with mp.precision_region("float32"):
      z = jax.jit(lambda a: jnp.sin(a @ a))(y)  # also through a jit boundary
    return z @ y

  closed = jax.make_jaxpr(mp.autocast(f))(x)
  assert input_dtypes(closed, "dot_general") == [
      ("bfloat16", "bfloat16"), ("float32", "float32"), ("bfloat16", "bfloat16")]
  assert input_dtypes(closed, "sin") == [("float32",)]


@pytest.mark.parametrize("kwargs, shows", [
    ({"allow": ["dot_genral"]}, "did you mean 'dot_general'"),
    ({"deny": ["not_a_primitive"]}, "unknown primitive 'not_a_primitive' in deny"),
    ({"allow": ["exp"], "deny": ["exp"]}, "both allow and deny"),
])
def test_bad_op_lists_name_the_value_and_list_the_known_ones(kwargs, shows):
  with pytest.raises(mp.PolicyError, match=shows) as e:
    mp.autocast(jnp.sin, "mixed_bfloat16", **kwargs)
  if "unknown" in shows or "did you mean" in shows:
    assert "Known primitives: " in str(e.value) and "conv_general_dilated" in str(e.value)


def test_bad_policy_is_rejected():
  with pytest.raises(mp.PolicyError, match="compute_dtype must be a floating dtype"):
    mp.autocast(jnp.sin, "p=f32,c=int32")


def test_half_dots_with_any_batch_dims_run(rng):
  """Every layout of a 4-d dot with two batch dims runs after autocast and
  matches float32 (XLA:CPU lacks kernels for 22 of them as written)."""
  import itertools  # pylint: disable=import-outside-toplevel
  sizes = {"b0": 3, "b1": 2, "c": 8, "lf": 5, "rf": 4}
  checked = 0
  for l_batch in itertools.permutations(range(4), 2):
    for r_batch in itertools.permutations(range(4), 2):
      if (l_batch, r_batch) not in (((0, 1), (0, 2)), ((0, 1), (2, 3)), ((0, 2), (0, 2)),
                                    ((0, 1), (0, 1)), ((1, 0), (0, 1))):
        continue
      for lc, rc in itertools.product(*[[d for d in range(4) if d not in b]
                                        for b in (l_batch, r_batch)]):
        l_shape, r_shape = [0] * 4, [0] * 4
        for d, name in zip(l_batch, ("b0", "b1")):
          l_shape[d] = sizes[name]
        for d, name in zip(r_batch, ("b0", "b1")):
          r_shape[d] = sizes[name]
        l_shape[lc] = r_shape[rc] = sizes["c"]
        l_shape[l_shape.index(0)], r_shape[r_shape.index(0)] = sizes["lf"], sizes["rf"]
        a = jnp.asarray(rng.normal(size=l_shape), jnp.float32)
        b = jnp.asarray(rng.normal(size=r_shape), jnp.float32)
        dims = (((lc,), (rc,)), (l_batch, r_batch))
        f = functools.partial(jax.lax.dot_general, dimension_numbers=dims)
        got = jax.jit(mp.autocast(f, "mixed_bfloat16"))(a, b)
        want = f(a, b)
        assert got.shape == want.shape, dims
        err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        assert err < 1e-2, (dims, err)
        checked += 1
  assert checked == 20
