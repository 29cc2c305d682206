"""The cleanup pass folds redundant casts and transposes, and changes no value."""

from __future__ import annotations

import itertools

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tunedjax import rewrite
from tunedjax.rewrite._cleanup import cleanup_pass
from tunedjax.rewrite._cleanup import exact_cast

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


def _cleaned(f, *args):
  counts = {}
  g = rewrite.transform(f, cleanup_pass(), on_trace=lambda ctx: counts.update(ctx.counts))
  return g, jax.make_jaxpr(g)(*args), counts


def _live_primitives(closed) -> list[str]:
  """Primitives of equations whose results are used (dead ones are XLA's to drop)."""
  jaxpr = closed.jaxpr
  used = set(v for v in jaxpr.outvars if isinstance(v, jex_core.Var))
  live = []
  for eqn in reversed(jaxpr.eqns):
    if any(v in used for v in eqn.outvars):
      live.append(eqn.primitive.name)
      used.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
  return live[::-1]


def test_exact_cast_table():
  assert exact_cast(jnp.bfloat16, jnp.float32) and exact_cast(jnp.float16, jnp.float32)
  assert exact_cast(jnp.float32, jnp.float64)
  assert not exact_cast(jnp.float32, jnp.bfloat16)
  assert not exact_cast(jnp.bfloat16, jnp.float16)  # float16 lacks bfloat16's range
  assert not exact_cast(jnp.float16, jnp.bfloat16)  # bfloat16 lacks float16's mantissa
  assert not exact_cast(jnp.int32, jnp.float32)


@pytest.mark.parametrize("src,mid,dst", list(itertools.product(FLOATS, repeat=3)))
def test_cast_chains_fold_only_when_exact(src, mid, dst, rng):
  x = jnp.asarray(rng.normal(size=(4, 5)) * 300, src)  # large values: float16 range matters
  f = lambda x: x.astype(mid).astype(dst)
  g, closed, counts = _cleaned(f, x)
  want, got = f(x), g(x)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  live = _live_primitives(closed).count("convert_element_type")
  expected = (0 if src == dst else 1) if exact_cast(src, mid) else (
      int(src != mid) + int(mid != dst))
  assert live == expected, (src, mid, dst, closed)
  # jnp drops a cast to the dtype a value already has before the pass sees it
  # (src == mid or mid == dst leaves one cast or none); of two casts, the pair
  # is folded exactly when the first one is exact.
  folded = src != mid and mid != dst and exact_cast(src, mid)
  assert dict(counts) == ({"cast pairs folded": 1} if folded else {}), (src, mid, dst, counts)


def test_a_cast_to_the_dtype_a_value_already_has_is_removed(rng):
  """Merged with autocast's rules (as `tj.jit` merges cleanup into kernel
  selection), the program's cast to bfloat16 meets a value autocast already
  holds in bfloat16: it is removed, and the result is autocast's, bitwise."""
  from tunedjax.mixed_precision._autocast import autocast_pass
  w = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
  f = lambda w, x: jnp.tanh((x @ w).astype(jnp.bfloat16))
  autocast = autocast_pass("mixed_bfloat16")
  merged = rewrite.Pass("autocast+cleanup", {**autocast.rules, **cleanup_pass().rules},
                        materialize=autocast.materialize)
  counts = {}
  got = jax.jit(rewrite.transform(f, merged, on_trace=lambda ctx: counts.update(ctx.counts)))(w, x)
  want = jax.jit(rewrite.transform(f, autocast))(w, x)
  assert counts["casts to the same dtype removed"] == 1
  assert got.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@given(st.permutations(range(4)), st.permutations(range(4)))
def test_transpose_pairs_compose(p1, p2):
  x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
  f = lambda x: jnp.transpose(jnp.transpose(x, p1), p2)
  g, closed, _ = _cleaned(f, x)
  np.testing.assert_array_equal(g(x), f(x))
  composed = tuple(p1[i] for i in p2)
  want = 0 if composed == (0, 1, 2, 3) else 1
  assert _live_primitives(closed).count("transpose") == want


def test_folds_inside_loop_bodies_and_keeps_gradients(rng):
  w = jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)

  def f(w, x):
    def body(h, _):
      h = jnp.transpose(jnp.transpose(h)) @ w.astype(jnp.bfloat16).astype(jnp.float32)
      return jnp.tanh(h), None
    return jax.lax.scan(body, x, None, length=3)[0].sum()

  x = jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)
  g, _, counts = _cleaned(f, w, x)
  assert counts["transposes removed"] >= 1
  np.testing.assert_array_equal(g(w, x), f(w, x))
  np.testing.assert_array_equal(jax.grad(g)(w, x), jax.grad(f)(w, x))
