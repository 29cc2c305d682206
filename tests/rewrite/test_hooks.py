"""The engine's hooks: inlining plain calls and rebuilding across a boundary.

A toy pass keeps the result of `sin` on a matrix *transposed* (a `T` value:
the logical value is `T.array.T`) and runs elementwise ops on such values in
that form, as the layout pass does with re-laid activations. Each hook is
used on `jit`, `custom_jvp_call`, `custom_vjp_call` and `remat`, and the
result is compared against the untransformed function, forward and
gradient, on random non-square inputs (a transpose in the wrong place fails
with a shape error or a wrong value).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import source_info_util

from tunedjax import rewrite
from tunedjax.rewrite import _compat

ELEMENTWISE = ("cos", "tanh", "mul", "add", "sub", "neg", "exp", "max", "select_n", "gt",
               "integer_pow", "convert_element_type", "round", "div", "log1p", "logistic")
RTOL = 1e-5


@dataclasses.dataclass(frozen=True, eq=False)
class T:
  """A matrix held transposed: its logical value is `array.T`."""

  array: jax.Array


def _materialize(value, aval):
  del aval
  return value.array.T if isinstance(value, T) else value


def _sin_rule(ctx, eqn, invals):
  (x,) = invals
  if eqn.outvars[0].aval.ndim != 2:
    return ctx.default(eqn, invals)
  ctx.count("sin held transposed")
  x = x.array if isinstance(x, T) else x.T
  return [T(ctx.bind(eqn, [x])[0])]


def _elementwise_rule(ctx, eqn, invals):
  ranks = [v.aval.ndim for v in eqn.invars]
  if not any(isinstance(x, T) for x in invals) or any(r not in (0, 2) for r in ranks):
    return ctx.default(eqn, invals)
  ctx.count("ops on transposed values")
  new = [x.array if isinstance(x, T) else (x.T if r == 2 else x) for x, r in zip(invals, ranks)]
  return [T(o) for o in ctx.bind(eqn, new)]


class TBoundary(rewrite.Boundary):
  """`T` values cross a rebuilt call as their transposed arrays."""

  def __init__(self):
    self.rebuilt: list[str] = []

  def tag(self, value):
    return "T" if isinstance(value, T) else None

  def to_physical(self, value, tag):
    assert tag == "T"
    return value.array if isinstance(value, T) else value.T

  def from_physical(self, array, tag):
    assert tag == "T"
    return T(array)

  def physical_aval(self, aval, tag):
    return aval.update(shape=aval.shape[::-1])

  def on_rebuild(self, ctx, eqn, kind):
    self.rebuilt.append(kind)


def toy_pass(*, inline_calls=False, boundary=None, extra=None):
  rules = {"sin": _sin_rule, **dict.fromkeys(ELEMENTWISE, _elementwise_rule), **(extra or {})}
  return rewrite.Pass("transpose_sin", rules, materialize=_materialize,
                      inline_calls=inline_calls, boundary=boundary)


# -- the functions: each puts a transposed value into one higher-order primitive


def fn_jit(x, w):
  inner = jax.jit(lambda y, w: jnp.tanh(y) * w + jnp.cos(y))
  return inner(jnp.sin(x), w)


@jax.custom_jvp
def ste_round(y):
  """Rounds to quarters; its derivative is the identity (a straight-through estimator)."""
  return jnp.round(y * 4.0) / 4.0


@ste_round.defjvp
def _ste_round_jvp(primals, tangents):
  (y,), (t,) = primals, tangents
  return ste_round(y), t * 1.0


def fn_custom_jvp(x, w):
  y = jnp.sin(x)
  return ste_round(y) * w + jax.nn.relu(y) + jax.nn.gelu(y * w)


@jax.custom_vjp
def clipped_tanh(y):
  return jnp.tanh(y)


def _clipped_tanh_fwd(y):
  t = jnp.tanh(y)
  return t, (t, y)


def _clipped_tanh_bwd(res, g):
  t, y = res
  return (jnp.clip(g * (1.0 - t * t), -0.5, 0.5) + 0.0 * y,)


clipped_tanh.defvjp(_clipped_tanh_fwd, _clipped_tanh_bwd)


def fn_custom_vjp(x, w):
  return clipped_tanh(jnp.sin(x) * w) * jnp.cos(x)


def fn_remat(x, w):
  body = jax.checkpoint(lambda y, w: jnp.tanh(y * w) * jnp.cos(y) + w,
                        policy=jax.checkpoint_policies.nothing_saveable)
  return body(jnp.sin(x), w)


FUNCTIONS = {"jit": fn_jit, "custom_jvp": fn_custom_jvp, "custom_vjp": fn_custom_vjp,
             "remat": fn_remat}
HIGHER_ORDER = {"jit": "jit", "custom_jvp": "custom_jvp_call", "custom_vjp": "custom_vjp_call",
                "remat": "remat2"}


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
  return x, w


def _loss(f):
  return lambda x, w: jnp.sum(f(x, w) * jnp.arange(15.0).reshape(3, 5))


def _assert_close(got, want):
  for g, h in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert g.shape == h.shape and g.dtype == h.dtype
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=RTOL, atol=1e-6)


def _check_matches(f, pass_, x, w):
  """Forward, gradient of the rewritten function, and the rewritten gradient."""
  g = rewrite.transform(f, pass_)
  _assert_close(jax.jit(g)(x, w), f(x, w))
  want = jax.grad(_loss(f), argnums=(0, 1))(x, w)
  _assert_close(jax.jit(jax.grad(_loss(g), argnums=(0, 1)))(x, w), want)
  _assert_close(jax.jit(rewrite.transform(jax.grad(_loss(f), argnums=(0, 1)), pass_))(x, w),
                want)


def _eqns(f, pass_, *args, name):
  closed = jax.make_jaxpr(rewrite.transform(f, pass_))(*args)
  return [e for e in rewrite.iter_equations(closed) if e.primitive.name == name]


def _counts(f, pass_, *args):
  counts = {}
  jax.make_jaxpr(rewrite.transform(f, pass_, on_trace=lambda c: counts.update(c.counts)))(*args)
  return counts


# -- every variant matches the untransformed function ------------------------

VARIANTS = {
    "none": lambda: toy_pass(),
    "inline": lambda: toy_pass(inline_calls=True),
    "boundary": lambda: toy_pass(boundary=TBoundary()),
    "both": lambda: toy_pass(inline_calls=True, boundary=TBoundary()),
    # A pass's own rules calling the Context hooks directly.
    "rules": lambda: toy_pass(extra={
        "jit": lambda ctx, eqn, invals: ctx.inline(eqn, invals),
        **{name: lambda ctx, eqn, invals: ctx.rebuild(eqn, invals, TBoundary())
           for name in ("custom_jvp_call", "custom_vjp_call", "remat2")}}),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_hooks_match_the_untransformed_function(fn_name, variant):
  x, w = _data(list(FUNCTIONS).index(fn_name) * 10 + list(VARIANTS).index(variant))
  _check_matches(FUNCTIONS[fn_name], VARIANTS[variant](), x, w)


def test_under_vmap():
  x, w = _data(1)
  xs, ws = jnp.stack([x, 2 * x]), jnp.stack([w, -w])
  for f in FUNCTIONS.values():
    g = rewrite.transform(f, toy_pass(inline_calls=True, boundary=TBoundary()))
    _assert_close(jax.jit(jax.vmap(g))(xs, ws), jax.vmap(f)(xs, ws))


# -- and each hook does what it says -----------------------------------------


def test_inline_sees_through_a_plain_jit():
  x, w = _data()
  plain = toy_pass()
  inline = toy_pass(inline_calls=True)
  # Rebuilt: the body gets a materialized (plain) value, so only `sin` fires.
  assert len(_eqns(fn_jit, plain, x, w, name="jit")) == 1
  assert _counts(fn_jit, plain, x, w).get("ops on transposed values", 0) == 0
  # Inlined: no call is left, and tanh, mul, cos, add run on the transposed value.
  assert not _eqns(fn_jit, inline, x, w, name="jit")
  assert _counts(fn_jit, inline, x, w)["ops on transposed values"] == 4


def test_inline_predicate_chooses_per_call():
  x, w = _data()
  seen = []

  def only_transposed(ctx, eqn, invals):
    seen.append(eqn.primitive.name)
    return any(isinstance(v, T) for v in invals)

  def f(x, w):
    return jax.jit(jnp.tanh)(jnp.sin(x)) + jax.jit(jnp.tanh)(w)

  p = toy_pass(inline_calls=only_transposed)
  assert len(_eqns(f, p, x, w, name="jit")) == 1  # the call on `w` stays a call
  assert seen == ["jit", "jit"]
  _check_matches(f, p, x, w)


@pytest.mark.parametrize("fn_name,kind", [("jit", "call"), ("custom_jvp", "custom_jvp"),
                                          ("remat", "remat")])
def test_boundary_rebuilds_on_the_physical_array(fn_name, kind):
  x, w = _data()
  boundary = TBoundary()
  p = toy_pass(boundary=boundary)
  (eqn, *_) = _eqns(FUNCTIONS[fn_name], p, x, w, name=HIGHER_ORDER[fn_name])
  # The transposed value enters the call as it is held: a (5, 3) operand.
  assert (5, 3) in [v.aval.shape for v in eqn.invars]
  assert kind in boundary.rebuilt
  counts = _counts(FUNCTIONS[fn_name], toy_pass(boundary=TBoundary()), x, w)
  assert counts["ops on transposed values"] >= 2  # the body saw `T` values


def test_boundary_rebuilds_the_custom_jvp_rule():
  """`ste_round`'s derivative is its rule (1), not autodiff of `round` (0)."""
  x, w = _data(3)
  boundary = TBoundary()
  g = rewrite.transform(lambda x: ste_round(jnp.sin(x)), toy_pass(boundary=boundary))
  grad = jax.jit(jax.grad(lambda x: jnp.sum(g(x))))(x)
  _assert_close(grad, jnp.cos(x))
  # The rule was traced through the pass on the physical tangent too.
  _, tangent = jax.jvp(g, (x,), (jnp.ones_like(x),))
  _assert_close(tangent, jnp.cos(x))
  assert boundary.rebuilt.count("custom_jvp") >= 1


def test_a_custom_vjp_call_is_the_boundary_edge():
  """Its backward rule is user code on plain values: the operand is materialized,
  and the body (and its forward rule) is still rewritten by the pass's rules."""
  x, w = _data()
  boundary = TBoundary()
  p = toy_pass(inline_calls=True, boundary=boundary)
  (eqn,) = _eqns(fn_custom_vjp, p, x, w, name="custom_vjp_call")
  assert [v.aval.shape for v in eqn.invars] == [(3, 5)]
  assert boundary.rebuilt == []
  inner = rewrite.count_primitives(eqn.params["call_jaxpr"])
  assert inner["tanh"] == 1 and inner["transpose"] == 0  # rebuilt, plain inside


def test_boundary_does_not_apply_without_transposed_operands():
  x, w = _data()
  boundary = TBoundary()

  def f(x, w):
    return jax.checkpoint(jnp.tanh)(w) + jnp.sin(x)

  _check_matches(f, toy_pass(boundary=boundary), x, w)
  assert boundary.rebuilt == []


def test_a_call_that_pins_shardings_is_neither_inlined_nor_rebuilt():
  x, w = _data()
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def f(x, w):
    return jax.jit(lambda y: jnp.tanh(y) * 2.0, out_shardings=sharding)(jnp.sin(x)) + w

  boundary = TBoundary()
  p = toy_pass(inline_calls=True, boundary=boundary)
  (eqn,) = _eqns(f, p, x, w, name="jit")
  assert [v.aval.shape for v in eqn.invars] == [(3, 5)]
  assert boundary.rebuilt == []
  _check_matches(f, p, x, w)


def _as_closed_call(f, *args):
  """The jaxpr of `f` with its nested `jit` equations turned into `closed_call`s."""
  closed = jax.make_jaxpr(f)(*args)
  eqns = [e.replace(primitive=jax.extend.core.primitives.closed_call_p,
                    params={"call_jaxpr": e.params["jaxpr"]})
          if e.primitive.name == "jit" else e for e in closed.jaxpr.eqns]
  return jax.extend.core.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def test_is_plain_call():
  x = jnp.ones((3, 5))
  plain = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x))(x).eqns[0]
  donating = jax.make_jaxpr(lambda x: jax.jit(jnp.sin, donate_argnums=0)(x))(x).eqns[0]
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  pinned = jax.make_jaxpr(lambda x: jax.jit(jnp.sin, in_shardings=device)(x))(x).eqns[0]
  call = _as_closed_call(lambda x: jax.jit(jnp.sin)(x), x).eqns[0]
  remat = jax.make_jaxpr(jax.checkpoint(jnp.sin))(x).eqns[0]
  assert call.primitive is jax.extend.core.primitives.closed_call_p
  assert _compat.is_plain_call(plain) and _compat.is_plain_call(call)
  assert not _compat.is_plain_call(donating) and not _compat.is_plain_call(pinned)
  assert not _compat.is_plain_call(remat)
  assert _compat.boundary_kind(plain) == "call" and _compat.boundary_kind(remat) == "remat"
  assert _compat.boundary_kind(donating) is None


@pytest.mark.parametrize("inline", [False, True])
def test_closed_call(inline):
  x, w = _data()
  f = lambda x, w: jax.jit(lambda y: jnp.tanh(y) * 3.0)(jnp.sin(x)) + w
  closed = _as_closed_call(f, x, w)
  p = toy_pass(inline_calls=inline)
  ctx = rewrite.Context(p)
  rewritten = rewrite.rewrite_jaxpr(closed, p, context=ctx)
  closed_call = jax.extend.core.primitives.closed_call_p.name  # "eval_jaxpr" in jax 0.12
  assert rewrite.count_primitives(rewritten)[closed_call] == (0 if inline else 1)
  assert ctx.counts["ops on transposed values"] == (3 if inline else 0)
  got = jax.jit(lambda x, w: rewrite.eval_jaxpr(closed, [x, w], toy_pass(inline_calls=inline)))(x, w)
  _assert_close(got, [f(x, w)])


def _in_kept(ctx, eqn):
  del eqn
  return "kept" in str(source_info_util.current_name_stack())


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_keep_binds_a_marked_region_as_traced(fn_name):
  """Inside ``named_scope("kept")`` no rule fires, not even in a call's body; a value
  the pass holds enters the region materialized; outside, the rules fire as before."""
  x, w = _data(7)
  f = FUNCTIONS[fn_name]

  def all_kept(x, w):
    with jax.named_scope("kept"):
      return f(x, w)

  def sin_outside(x, w):
    y = jnp.sin(x)
    with jax.named_scope("kept"):
      kept = f(jnp.arcsin(y), w)
    return kept + jnp.tanh(y)

  p = dataclasses.replace(toy_pass(inline_calls=True, boundary=TBoundary()), keep=_in_kept)
  assert _counts(all_kept, p, x, w) == {}
  counts = _counts(sin_outside, p, x, w)
  assert counts == {"sin held transposed": 1, "ops on transposed values": 2}, counts
  _check_matches(all_kept, p, x, w)
  _check_matches(sin_outside, p, x, w)


def test_pass_checks_its_hook_arguments():
  with pytest.raises(TypeError, match="boundary must be a rewrite.Boundary"):
    rewrite.Pass("p", boundary=object())
  with pytest.raises(TypeError, match="keep must be None or a predicate"):
    rewrite.Pass("p", keep="yes")
  with pytest.raises(TypeError, match="inline_calls must be a bool or a predicate"):
    rewrite.Pass("p", inline_calls="yes")
