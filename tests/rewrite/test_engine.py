"""Tests of the rewrite engine: the identity pass is exact, rules reach into
every higher-order primitive, and misuse gives clear errors."""

from __future__ import annotations

import functools
import logging

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tunedjax as tj
from tests.rewrite import cases
from tunedjax import rewrite

IDENTITY = rewrite.Pass("identity")
# Re-traces every sub-jaxpr even though no rule fires: the engine's full path.
IDENTITY_REBUILD = rewrite.Pass("identity_rebuild", skip_untouched=False)

CASES = {c.__name__: c for c in cases.ALL_CASES}


def assert_trees_bitwise_equal(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


@functools.cache
def make(case_name):
  """The case and its reference outputs and gradients (built once per session)."""
  case = CASES[case_name](np.random.default_rng(0))
  return case, outputs_and_grads(case.fn, case)


def outputs_and_grads(fn, case):
  out = jax.jit(fn)(case.params, case.batch)
  grads = jax.jit(jax.grad(fn))(case.params, case.batch) if case.differentiable else None
  return out, grads


@pytest.mark.parametrize("pass_", [IDENTITY, IDENTITY_REBUILD], ids=lambda p: p.name)
@pytest.mark.parametrize("case_name", CASES)
def test_identity_pass_is_bitwise_exact(case_name, pass_):
  case, want = make(case_name)
  got = outputs_and_grads(rewrite.transform(case.fn, pass_), case)
  assert_trees_bitwise_equal(want, got)
  if case.differentiable:
    # A function that already contains grad (its backward pass is equations too).
    got_inside = jax.jit(rewrite.transform(jax.grad(case.fn), pass_))(case.params, case.batch)
    assert_trees_bitwise_equal(want[1], got_inside)


@pytest.mark.parametrize("case_name", CASES)
def test_identity_pass_under_vmap(case_name):
  case, _ = make(case_name)
  # Two independent half-batches, mapped over a new leading axis.
  batch = jax.tree_util.tree_map(lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:]), case.batch)
  want = jax.jit(jax.vmap(case.fn, in_axes=(None, 0)))(case.params, batch)
  got = jax.jit(jax.vmap(rewrite.transform(case.fn, IDENTITY_REBUILD), in_axes=(None, 0)))(
      case.params, batch)
  assert_trees_bitwise_equal(want, got)


@pytest.mark.parametrize("case_name", CASES)
def test_identity_pass_with_sharded_batch(case_name, mesh8_auto):
  mesh8 = mesh8_auto  # Explicit axes: tests/test_explicit_sharding.py
  case, _ = make(case_name)
  params = jax.device_put(case.params, NamedSharding(mesh8, P()))
  batch = jax.device_put(case.batch, NamedSharding(mesh8, P("data")))
  sharded = cases.Case(case.name, case.fn, params, batch, case.differentiable)
  want = outputs_and_grads(case.fn, sharded)
  got = outputs_and_grads(rewrite.transform(case.fn, IDENTITY_REBUILD), sharded)
  assert_trees_bitwise_equal(want, got)
  leaf = jax.tree_util.tree_leaves(got[0])[0]
  assert len(leaf.sharding.device_set) == 8


# -- rules apply inside every higher-order primitive ---------------------------


def _times_one(ctx, eqn, invals):
  ctx.count("sin")
  (y,) = ctx.bind(eqn, invals)
  return [y * 1.0]


SIN_TIMES_ONE = rewrite.Pass("sin_times_one", {"sin": _times_one})
SIN_TO_COS = rewrite.Pass("sin_to_cos", {"sin": lambda ctx, eqn, x: [jnp.cos(x[0])]})


@jax.custom_jvp
def _custom_jvp_sin(x):
  return jnp.sin(x)


_custom_jvp_sin.defjvp(lambda p, t: (_custom_jvp_sin(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _custom_vjp_sin(x):
  return jnp.sin(x)


_custom_vjp_sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))


def _nested(trig):
  """A function with `trig` inside jit, remat, custom_jvp/vjp, scan, cond and while."""

  @jax.jit
  def jitted(x):
    return trig(x) * 2.0

  def fn(x):
    y = jitted(x)
    y = jax.checkpoint(lambda z: trig(z) ** 2)(y)
    y = y + trig(x)
    c, ys = jax.lax.scan(lambda c, a: (c + trig(a), c * 0.5), 0.0, y)
    y = jax.lax.cond(c > -10.0, trig, jnp.negative, y + ys)
    _, w = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, trig(s[1])),
                              (0, jax.lax.stop_gradient(y)))
    return jnp.sum(y) + c + jnp.sum(w)

  return fn


HIGHER_ORDER = ("jit", "remat2", "scan", "cond", "while", "custom_jvp_call", "custom_vjp_call")


def _sin_outputs_multiplied(jaxpr) -> bool:
  """Whether every sin in `jaxpr` (this level only) feeds a mul."""
  eqns = list(rewrite.iter_equations(jaxpr, recursive=False))
  sins = [e.outvars[0] for e in eqns if e.primitive.name == "sin"]
  mul_inputs = {id(v) for e in eqns if e.primitive.name == "mul" for v in e.invars}
  return bool(sins) and all(id(v) in mul_inputs for v in sins)


def test_rule_applies_inside_every_higher_order_primitive(rng):
  x = jnp.asarray(rng.normal(size=5).astype(np.float32))
  fn = _nested(lambda z: _custom_vjp_sin(_custom_jvp_sin(jnp.sin(z))))
  closed = jax.make_jaxpr(fn)(x)
  new = rewrite.rewrite_jaxpr(closed, SIN_TIMES_ONE)
  jex_core.check_jaxpr(new.jaxpr)

  seen = set()
  for eqn in rewrite.iter_equations(new):
    for sub in jex_core.jaxprs_in_params(eqn.params):
      if any(e.primitive.name == "sin" for e in sub.eqns):
        assert _sin_outputs_multiplied(sub), f"a sin inside {eqn.primitive.name} was not rewritten"
        seen.add(eqn.primitive.name)
  assert set(HIGHER_ORDER) <= seen
  assert _sin_outputs_multiplied(new.jaxpr)
  assert rewrite.count_primitives(new)["sin"] == rewrite.count_primitives(closed)["sin"]
  np.testing.assert_array_equal(jax.jit(fn)(x), jax.jit(rewrite.transform(fn, SIN_TIMES_ONE))(x))


def test_rule_changes_values_inside_bodies_and_gradients_follow(rng):
  x = jnp.asarray(rng.normal(size=5).astype(np.float32))
  with_sin, with_cos = _nested(jnp.sin), _nested(jnp.cos)
  got = jax.jit(rewrite.transform(with_sin, SIN_TO_COS))
  np.testing.assert_allclose(got(x), jax.jit(with_cos)(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(got)(x), jax.jit(jax.grad(with_cos))(x), rtol=1e-5)


def test_rule_applies_to_custom_vjp_forward_when_differentiated_outside(rng):
  x = jnp.asarray(rng.normal(size=5).astype(np.float32))
  fn = lambda z: jnp.sum(_custom_vjp_sin(z) ** 2)
  rewritten = rewrite.transform(fn, SIN_TO_COS)
  # Forward under grad goes through the custom_vjp's fwd rule: it must be
  # rewritten too (residual cos(x) is kept as written: bwd is user code).
  value, grad = jax.value_and_grad(rewritten)(x)
  np.testing.assert_allclose(value, jnp.sum(jnp.cos(x) ** 2), rtol=1e-6)
  np.testing.assert_allclose(grad, 2 * jnp.cos(x) * jnp.cos(x), rtol=1e-6)


def test_untouched_jaxpr_is_returned_as_is():
  closed = jax.make_jaxpr(_nested(jnp.cos))(jnp.ones(3))
  assert rewrite.rewrite_jaxpr(closed, SIN_TIMES_ONE) is closed


def test_counts_reach_on_trace_once_per_signature():
  seen = []
  fn = jax.jit(rewrite.transform(_nested(jnp.sin), SIN_TIMES_ONE, on_trace=seen.append))
  fn(jnp.ones(3))
  fn(jnp.ones(3) * 2)
  fn(jnp.ones(4))
  assert len(seen) == 2
  assert all(ctx.counts["sin"] == 6 for ctx in seen)  # one sin in each region
  assert seen[0].platform == jax.default_backend()


def test_context_sees_the_active_config():
  levels = []

  def record(ctx, eqn, invals):
    levels.append(ctx.config.level)
    return ctx.default(eqn, invals)

  fn = rewrite.transform(jnp.sin, rewrite.Pass("record", {"sin": record}))
  with tj.config_context({"level": "O2"}):
    fn(1.0)
  fn(1.0)
  assert levels == ["O2", tj.get_config().level]


def test_pytree_args_and_kwargs_keep_their_order(rng):
  a = {"b": jnp.asarray(rng.normal(size=3), jnp.float32), "a": jnp.float32(2.0)}

  def fn(x, tree, *, scale, offset=None):
    return {"out": (x * tree["a"] - tree["b"]) * scale + offset[0], "n": offset[1]}

  kwargs = dict(scale=jnp.float32(3.0), offset=(jnp.float32(0.5), jnp.int32(7)))
  x = jnp.arange(3.0)
  assert_trees_bitwise_equal(fn(x, a, **kwargs),
                             rewrite.transform(fn, IDENTITY_REBUILD)(x, a, **kwargs))


def test_weak_types_survive_a_rebuilt_loop_carry():
  fn = lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5 + jnp.sin(x), 1.0)
  x = jnp.float32(0.3)
  new = rewrite.rewrite_jaxpr(jax.make_jaxpr(fn)(x), SIN_TIMES_ONE)
  jex_core.check_jaxpr(new.jaxpr)
  assert jax.jit(rewrite.transform(fn, SIN_TIMES_ONE))(x) == jax.jit(fn)(x)


# -- passes that keep values in their own representation -----------------------


class _Negated:
  """A value `-x` kept as `x`: two negations cancel without any equation."""

  def __init__(self, x):
    self.x = x


def _lazy_neg(ctx, eqn, invals):
  (x,) = invals
  if isinstance(x, _Negated):
    ctx.count("negations cancelled")
    return [x.x]
  return [_Negated(x)]


LAZY_NEG = rewrite.Pass(
    "lazy_neg", {"neg": _lazy_neg},
    materialize=lambda v, aval: -v.x if isinstance(v, _Negated) else v)


def test_materialize_hook_applies_at_every_boundary(rng):
  x = jnp.asarray(rng.normal(size=4).astype(np.float32))

  def fn(x):
    y = -(-(jnp.sin(x)))                      # cancels: no neg at all
    c, _ = jax.lax.scan(lambda c, a: (-c + a, -a), 0.0, y)  # carry leaves the body
    return jnp.sum(-y) + c, -x                # default bind, and an output

  closed = jax.make_jaxpr(fn)(x)
  new = rewrite.rewrite_jaxpr(closed, LAZY_NEG)
  assert rewrite.count_primitives(new)["neg"] < rewrite.count_primitives(closed)["neg"]
  assert_trees_bitwise_equal(jax.jit(fn)(x), jax.jit(rewrite.transform(fn, LAZY_NEG))(x))


# -- misuse gives clear errors -------------------------------------------------


def test_rule_returning_the_wrong_number_of_values_is_named():
  bad = rewrite.Pass("bad_arity", {"sin": lambda ctx, eqn, x: []})
  with pytest.raises(tj.RewriteError, match=r"'bad_arity'.*'sin'.*returned 0 values for 1"):
    rewrite.transform(jnp.sin, bad)(1.0)


def test_type_change_leaving_a_loop_body_is_named():
  to_f16 = rewrite.Pass("to_f16", {"sin": lambda ctx, eqn, x: [jnp.sin(x[0]).astype(jnp.float16)]})
  fn = lambda x: jax.lax.scan(lambda c, a: (jnp.sin(c), a), x, None, length=2)[0]
  with pytest.raises(tj.RewriteError, match=r"'to_f16'.*'scan'.*float32\[3\].*float16\[3\].*materialize"):
    rewrite.transform(fn, to_f16)(jnp.ones(3))


def test_passes_are_hashable_and_their_rules_read_only_copies():
  rules = {"sin": _times_one}
  p = rewrite.Pass("p", rules)
  rules["cos"] = _times_one
  assert set(p.rules) == {"sin"} and len({p, rewrite.Pass("p", {"sin": _times_one})}) == 2
  with pytest.raises(TypeError):
    p.rules["cos"] = _times_one


def test_pass_rejects_rule_keys_that_are_not_names():
  with pytest.raises(TypeError, match="primitive names"):
    rewrite.Pass("keys", {jax.lax.sin_p: _times_one})


def test_unknown_higher_order_primitive_is_left_untouched(caplog):
  hop = jex_core.Primitive("tunedjax_test_hop")
  hop.multiple_results = True
  hop.def_impl(lambda *args, body: jex_core.jaxpr_as_fun(body)(*args))
  hop.def_abstract_eval(lambda *avals, body: body.out_avals)
  body = jax.make_jaxpr(jnp.sin)(1.0)

  def fn(x):
    return hop.bind(jnp.sin(x), body=body)[0]

  with caplog.at_level(logging.DEBUG, logger="tunedjax.rewrite"):
    closed = jax.make_jaxpr(fn)(0.5)
    ctx = rewrite.Context(SIN_TIMES_ONE)
    out = rewrite.eval_jaxpr(closed, [0.5], SIN_TIMES_ONE, context=ctx)
  assert ctx.counts["sin"] == 1  # the outer sin only
  assert float(out[0]) == pytest.approx(float(jnp.sin(jnp.sin(0.5))))
  assert "tunedjax_test_hop" in caplog.text and "left untouched" in caplog.text


# -- what research code also does ----------------------------------------------


def _with_effects_and_keys(key, x):
  def body(c, a):
    jax.debug.print("carry {c}", c=c)
    return c + jnp.sin(a), None

  c, _ = jax.lax.scan(body, 0.0, x + jax.random.normal(key, x.shape))
  doubled = jax.pure_callback(lambda v: v * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.sin(x))
  return {"c": c, "doubled": doubled, "none": None, "const": 3}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_effects_keys_callbacks_and_constant_outputs(jit, capfd):
  key, x = jax.random.key(0), jnp.arange(3.0)
  wrap = jax.jit if jit else (lambda f: f)
  want = wrap(_with_effects_and_keys)(key, x)
  jax.effects_barrier()
  printed = capfd.readouterr().out
  got = wrap(rewrite.transform(_with_effects_and_keys, SIN_TIMES_ONE))(key, x)
  jax.effects_barrier()
  assert capfd.readouterr().out == printed and printed.count("carry") == 3
  # A constant output is an Array, as under jit (eagerly, the original returns the int).
  assert got["none"] is None and isinstance(got["const"], jax.Array) and got.pop("const") == 3
  want.pop("const")
  assert_trees_bitwise_equal(want, got)
