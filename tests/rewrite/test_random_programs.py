"""Property tests: on random programs of random shapes, the identity pass is
exact and a value-preserving rule changes no value, inside loops and branches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tunedjax import rewrite

IDENTITY_REBUILD = rewrite.Pass("identity_rebuild", skip_untouched=False)
# Rewrites tanh as 2*sigmoid(2x)-1 and keeps a count: same values within float32 rounding.
TANH_AS_SIGMOID = rewrite.Pass(
    "tanh_as_sigmoid", {"tanh": lambda ctx, eqn, x: [2.0 * jax.nn.sigmoid(2.0 * x[0]) - 1.0]})

UNARY = {"sin": jnp.sin, "tanh": jnp.tanh, "softplus": jax.nn.softplus,
         "square": jnp.square, "relu": jax.nn.relu}
WRAPPERS = ("plain", "jit", "checkpoint", "scan", "cond", "fori")


def _wrap(kind: str, op):
  if kind == "jit":
    return jax.jit(op)
  if kind == "checkpoint":
    return jax.checkpoint(op)
  if kind == "scan":
    return lambda x: jax.lax.scan(lambda c, a: (c, op(a)), 0.0, x)[1]
  if kind == "cond":
    return lambda x: jax.lax.cond(jnp.sum(x) > 0, op, lambda y: op(-y), x)
  if kind == "fori":
    return lambda x: jax.lax.fori_loop(0, 2, lambda i, y: op(y) * 0.5, x)
  return op


programs = st.lists(st.tuples(st.sampled_from(sorted(UNARY)), st.sampled_from(WRAPPERS)),
                    min_size=1, max_size=5)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def _build(program):
  steps = [_wrap(kind, UNARY[name]) for name, kind in program]

  def fn(x, w):
    for i, step in enumerate(steps):
      x = step(x) + w * (i + 1)  # the weight makes gradients flow through every step
    return jnp.sum(x * jnp.cos(x))

  return fn


def _inputs(shape, seed):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=shape), jnp.float32),
          jnp.asarray(rng.normal(size=shape[-1:]), jnp.float32))


@settings(max_examples=12)  # two compiles an example: the suite's budget
@given(program=programs, shape=shapes, seed=st.integers(0, 2**16))
def test_identity_is_bitwise_on_random_programs(program, shape, seed):
  fn, x, w = _build(program), *_inputs(shape, seed)
  want = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(x, w)
  got = jax.jit(jax.value_and_grad(rewrite.transform(fn, IDENTITY_REBUILD), argnums=(0, 1)))(x, w)
  for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=12)  # two compiles an example: the suite's budget
@given(program=programs, shape=shapes, seed=st.integers(0, 2**16))
def test_value_preserving_rule_matches_within_rounding(program, shape, seed):
  fn, x, w = _build(program), *_inputs(shape, seed)
  counted = []
  rewritten = rewrite.transform(fn, TANH_AS_SIGMOID, on_trace=counted.append)
  want = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(x, w)
  got = jax.jit(jax.value_and_grad(rewritten, argnums=(0, 1)))(x, w)
  for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-4 * max(1.0, float(np.abs(a).max())))
  closed = jax.make_jaxpr(rewritten)(x, w)
  assert rewrite.count_primitives(closed)["tanh"] == 0
  assert rewrite.count_primitives(closed)["logistic"] >= sum(n == "tanh" for n, _ in program)
