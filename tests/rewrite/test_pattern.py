"""The pattern mechanism of the rewrite engine: `Match`, planning, firing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunedjax import rewrite
from tunedjax.rewrite import _pattern


def _sin_mul(ctx, jaxpr):
  """Toy pattern: ``sin(x) * c`` -> one rule computing ``c * cos(x)`` (visibly different)."""
  del ctx
  found = []
  for i, e in enumerate(jaxpr.eqns):
    if e.primitive.name != "sin":
      continue
    for j, f in enumerate(jaxpr.eqns):
      if f.primitive.name == "mul" and f.invars[0] is e.outvars[0]:
        found.append(rewrite.Match(
            eqns=(i, j), inputs=(e.invars[0], f.invars[1]), outputs=(f.outvars[0],),
            rule=lambda ctx, v: [v[1] * jnp.cos(v[0])], name="sin*c"))
  return found


TOY = rewrite.Pass("toy", patterns=(_sin_mul,))


def _names(f, *args):
  return [e.primitive.name for e in jax.make_jaxpr(f)(*args).eqns]


def test_toy_pattern_replaces_its_equations():
  f = lambda x, c: jnp.sin(x) * c + 1.0
  g = rewrite.transform(f, TOY)
  assert _names(g, 0.3, 2.0) == ["cos", "mul", "add"]
  np.testing.assert_allclose(g(0.3, 2.0), 2.0 * np.cos(0.3) + 1.0, rtol=1e-6)


def test_match_fires_when_its_inputs_are_defined():
  # c is computed after sin: the match fires once c exists, before its reader.
  f = lambda x, y: jnp.sin(x) * jnp.exp(y) - 1.0
  g = rewrite.transform(f, TOY)
  assert _names(g, 0.3, 0.1) == ["exp", "cos", "mul", "sub"]
  np.testing.assert_allclose(g(0.3, 0.1), np.exp(0.1) * np.cos(0.3) - 1.0, rtol=1e-5)


def test_intermediate_read_elsewhere_is_left_alone():
  def shared(x, c):
    s = jnp.sin(x)
    return s * c + s  # s is read by the add too: not the match's to replace
  closed = jax.make_jaxpr(shared)(0.3, 2.0)
  assert _names(rewrite.transform(shared, TOY), 0.3, 2.0) == [e.primitive.name
                                                              for e in closed.eqns]


def test_match_that_cannot_fire_before_a_reader_is_left_alone():
  def f(x, y):
    s = jnp.sin(x)
    z = jnp.exp(s)      # reads s: the match would have to fire before this...
    c = jnp.cos(z)      # ...but its input c is defined only here
    return s * c
  closed = jax.make_jaxpr(f)(0.3, 0.1)
  # s is read by exp: the match's equations define s, which is not an output.
  got = rewrite.transform(f, TOY)
  assert _names(got, 0.3, 0.1) == [e.primitive.name for e in closed.eqns]


def test_plan_drops_a_match_whose_output_is_read_before_it_can_fire():
  def f(x, y):
    s = jnp.sin(x) * y
    return s
  jaxpr = jax.make_jaxpr(f)(0.3, 0.1).jaxpr
  sin_i, mul_i = 0, 1
  # Pretend the match also needs the output of the mul itself as an input: a cycle.
  bad = rewrite.Match((sin_i,), (jaxpr.invars[0], jaxpr.eqns[mul_i].outvars[0]),
                      (jaxpr.eqns[sin_i].outvars[0],), lambda ctx, v: [v[0]], name="late")
  planned = _pattern.plan(jaxpr, [bad])
  assert not planned.matches and planned.dropped[0][0] is bad


def test_overlapping_matches_first_wins():
  jaxpr = jax.make_jaxpr(lambda x, c: jnp.sin(x) * c)(0.3, 2.0).jaxpr
  a = rewrite.Match((0, 1), jaxpr.invars, jaxpr.outvars, lambda ctx, v: [v[0]], name="a")
  b = rewrite.Match((1,), (jaxpr.eqns[0].outvars[0], jaxpr.invars[1]), jaxpr.outvars,
                    lambda ctx, v: [v[0]], name="b")
  planned = _pattern.plan(jaxpr, [a, b])
  assert planned.matches == (a,) and planned.dropped[0][0] is b
  assert planned.skip == {0, 1}


def test_linked_matches_fire_together_or_not_at_all():
  def f(x, c):
    s = jnp.sin(x)
    return s * c, jnp.exp(s)
  jaxpr = jax.make_jaxpr(f)(0.3, 2.0).jaxpr
  sin_e, mul_e, exp_e = jaxpr.eqns
  first = rewrite.Match((0, 1), jaxpr.invars, (mul_e.outvars[0],),
                        lambda ctx, v: [v[1] * jnp.cos(v[0])], name="first")
  # exp reads sin's output, which `first` does not output: alone, `first` is dropped...
  assert not _pattern.plan(jaxpr, [first]).matches
  # ...linked with a match replacing exp (fed through shared state), both fire.
  second = rewrite.Match((2,), (mul_e.outvars[0],), (exp_e.outvars[0],),
                         lambda ctx, v: [v[0]], name="second", requires=(first,))
  planned = _pattern.plan(jaxpr, [first, second])
  assert planned.matches == (first, second)
  # A broken partner takes the whole group down.
  broken = rewrite.Match((2,), (jaxpr.invars[0],), (), lambda ctx, v: [], name="broken",
                         requires=(first,))
  planned = _pattern.plan(jaxpr, [first, broken])
  assert not planned.matches and {m.name for m, _ in planned.dropped} == {"first", "broken"}


@pytest.mark.parametrize("wrap", ["jit", "scan", "cond", "checkpoint"])
def test_patterns_reach_nested_bodies(wrap):
  body = lambda x, c: jnp.sin(x) * c
  if wrap == "jit":
    f = lambda x, c: jax.jit(body)(x, c)
  elif wrap == "scan":
    f = lambda x, c: jax.lax.scan(lambda s, _: (body(s, c), None), x, None, length=2)[0]
  elif wrap == "cond":
    f = lambda x, c: jax.lax.cond(x > 0, body, lambda x, c: x, x, c)
  else:
    f = lambda x, c: jax.checkpoint(body)(x, c)
  g = rewrite.transform(f, TOY)
  counts = rewrite.count_primitives(jax.make_jaxpr(g)(0.3, 2.0))
  assert counts["cos"] >= 1 and counts["sin"] == 0
  assert not np.allclose(g(0.3, 2.0), f(0.3, 2.0))  # the toy rule changes the value


def test_pattern_composes_with_jit_and_grad():
  f = lambda x, c: (jnp.sin(x) * c).sum()
  g = rewrite.transform(f, TOY)
  x, c = jnp.array([0.1, 0.7]), 3.0
  np.testing.assert_allclose(jax.jit(g)(x, c), (c * jnp.cos(x)).sum(), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(g)(x, c), -c * jnp.sin(x), rtol=1e-6)


def test_rule_with_wrong_arity_is_an_error():
  def bad(ctx, jaxpr):
    return [rewrite.Match((0,), jaxpr.invars, jaxpr.outvars, lambda ctx, v: [], name="bad")]
  with pytest.raises(Exception, match="returned 0 values for 1 outputs"):
    rewrite.transform(jnp.sin, rewrite.Pass("bad", patterns=(bad,)))(0.3)


def test_bad_patterns_argument():
  with pytest.raises(TypeError, match="patterns must be functions"):
    rewrite.Pass("p", patterns=(1,))
  with pytest.raises(TypeError, match="rule must be callable"):
    rewrite.Match((0,), (), (), rule=None)
