"""Attention written by hand, found in the jaxpr (`ops/attention/_pattern.py`).

Each spelling is found with the right spec, and the match, run on a kernel
other than the reference (``einsum``), computes the original function,
forward and gradient; near misses are not matched, or left alone whole.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from tunedjax import rewrite
from tunedjax.ops.attention import _kernels
from tunedjax.ops.attention._pattern import attention_matches

RTOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _rewrite_pass(kernel=_kernels.einsum):
  """A pass that replaces each match with `kernel` (no kernel selection involved)."""

  def pattern(ctx, jaxpr):
    del ctx
    return [rewrite.Match(eqns=m.eqns, inputs=m.inputs, outputs=(m.output,),
                          rule=functools.partial(_rule, m, kernel), name="attention")
            for m in attention_matches(jaxpr)]

  return rewrite.Pass("attention_test", patterns=(pattern,))


FIRED = []


def _rule(match, kernel, ctx, invals):
  del ctx
  FIRED.append(match.spec)
  return match.call(lambda *ops: kernel(*ops, match.spec), *invals)


def _matches(f, *args):
  return attention_matches(jax.make_jaxpr(f)(*args).jaxpr)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


# -- masks, each a function of (b, t, s, rng) returning (kind, apply(logits [b,h,t,s])) -----


def _causal_tril(t, s):
  return jnp.tril(jnp.ones((t, s), bool))


def _causal_iota(t, s):
  i = jax.lax.broadcasted_iota(jnp.int32, (t, s), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (t, s), 1)
  return i >= j


def _causal_flax(t, s):
  del s
  return nn.make_causal_mask(jnp.ones((1, t)))  # float 0/1, [1, 1, t, t]


MASKS = ("none", "bool", "bias", "additive_bool", "causal_tril", "causal_iota",
         "causal_flax", "causal_additive")


def _mask_fn(kind, b, t, s, rng, dtype):
  """``(apply(logits), extra args, expected (mask_kind, causal))``."""
  if kind == "none":
    return lambda x: x, (), ("none", False)
  if kind == "bool":
    m = rng.random((b, 1, t, s)) < 0.7
    m[..., 0] = True
    return None, (jnp.asarray(m),), ("bool", False)
  if kind == "bias":
    return None, (jnp.asarray(rng.normal(size=(1, 1, t, s)), dtype),), ("bias", False)
  if kind == "additive_bool":
    m = rng.random((b, 1, 1, s)) < 0.7
    m[..., 0] = True
    return None, (jnp.asarray(m),), ("bias", False)
  if kind == "causal_additive":
    return (lambda x: x + jnp.where(_causal_tril(t, s), 0.0, -1e9).astype(x.dtype)), (), \
        ("none", True)
  mask = {"causal_tril": _causal_tril, "causal_iota": _causal_iota,
          "causal_flax": _causal_flax}[kind]
  return (lambda x: jnp.where(mask(t, s), x, -1e9)), (), ("none", True)


def _apply_extra(kind, x, extra):
  if kind == "bool":
    return jnp.where(extra[0], x, jnp.finfo(x.dtype).min)
  if kind == "bias":
    return x + extra[0]
  if kind == "additive_bool":
    return x + (1.0 - extra[0].astype(x.dtype)) * -1e9
  raise AssertionError(kind)


# -- spellings: each takes q, k, v in [b, t, h, d] and returns [b, t, h, d] ------------------


def _softmax_written_out(x, axis=-1):
  x = x - jnp.max(x, axis=axis, keepdims=True)
  e = jnp.exp(x)
  return e / jnp.sum(e, axis=axis, keepdims=True)


def spelling_einsum(q, k, v, masked):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(masked(s), axis=-1), v)


def spelling_bhtd_matmul(q, k, v, masked):
  q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [b, h, t, d], as PyTorch
  s = (q * q.shape[-1] ** -0.5) @ k.swapaxes(-1, -2)
  out = _softmax_written_out(masked(s)) @ v
  return out.transpose(0, 2, 1, 3)


def spelling_scale_on_k(q, k, v, masked):
  s = jnp.einsum("bthd,bshd->bhts", q, k * 0.5)
  p = jax.nn.softmax(masked(s))
  return jnp.einsum("bhts,bshd->bthd", p, v)


def spelling_f32_softmax(q, k, v, masked):
  """Logits and softmax in float32 whatever the inputs, probabilities cast back."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * 0.3
  p = jax.nn.softmax(masked(s), axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


SPELLINGS = {"einsum": spelling_einsum, "bhtd_matmul": spelling_bhtd_matmul,
             "scale_on_k": spelling_scale_on_k, "f32_softmax": spelling_f32_softmax}


def _problem(spelling, kind, b, t, s, h, d, dtype, seed):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), dtype) for _ in range(2))
  masked, extra, expect = _mask_fn(kind, b, t, s, rng, dtype)
  fn = SPELLINGS[spelling]
  if masked is None:
    f = lambda q, k, v, *e: fn(q, k, v, lambda x: _apply_extra(kind, x, e))  # noqa: E731
  else:
    f = lambda q, k, v: fn(q, k, v, masked)  # noqa: E731
  return f, (q, k, v, *extra), expect


def _check(f, args, expect, dtype, kernel=_kernels.einsum):
  (m,) = _matches(f, *args)
  assert (m.spec.mask_kind, m.spec.causal) == expect
  g = rewrite.transform(f, _rewrite_pass(kernel))
  FIRED.clear()
  jax.make_jaxpr(g)(*args)
  assert FIRED == [m.spec]  # the match fired, once
  bound = RTOL[np.dtype(dtype).name]
  assert _rel(jax.jit(g)(*args), f(*args)) < bound
  def loss(fn):
    def scalar(*a):
      y = fn(*a).astype(jnp.float32)
      return jnp.sum(y * jnp.cos(jnp.arange(y.size)).reshape(y.shape))  # a random-ish cotangent
    return scalar

  grads_g = jax.jit(jax.grad(loss(g), argnums=(0, 1, 2)))(*args)
  grads_f = jax.grad(loss(f), argnums=(0, 1, 2))(*args)
  for got, want in zip(grads_g, grads_f):
    assert _rel(got, want) < 4 * bound


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("kind", MASKS)
def test_each_spelling_and_mask_found_and_equal(spelling, kind):
  f, args, expect = _problem(spelling, kind, 2, 6, 6, 2, 8, jnp.float32, 0)
  _check(f, args, expect, jnp.float32)


@pytest.mark.slow
@hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                     phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate))
@hypothesis.given(spelling=st.sampled_from(sorted(SPELLINGS)), kind=st.sampled_from(MASKS),
                  b=st.integers(1, 2), t=st.integers(1, 9), extra_s=st.integers(0, 3),
                  h=st.integers(1, 3), d=st.sampled_from([4, 8]),
                  dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 99))
def test_hypothesis_shapes_masks_dtypes(spelling, kind, b, t, extra_s, h, d, dtype, seed):
  s = t + extra_s
  hypothesis.assume(kind != "causal_flax" or s == t)  # Flax's causal mask is square
  f, args, expect = _problem(spelling, kind, b, t, s, h, d, jnp.dtype(dtype), seed)
  # The einsum kernel's bfloat16 products with float32 results are not on every CPU
  # dot_general path; the reference kernel maps the same operands.
  _check(f, args, expect, dtype, kernel=_kernels.einsum if dtype == "float32" else _kernels.xla)


def test_custom_jvp_softmax_is_found():
  """`jax.nn.softmax` as a custom_jvp_call (jax_softmax_custom_jvp on) is found too."""
  f, args, expect = _problem("einsum", "causal_tril", 1, 8, 8, 2, 8, jnp.float32, 1)
  with _config("jax_softmax_custom_jvp", True):
    assert "custom_jvp_call" in str(jax.make_jaxpr(f)(*args))
    _check(f, args, expect, jnp.float32)


class _config:  # noqa: N801
  def __init__(self, name, value):
    self.name, self.value = name, value

  def __enter__(self):
    self.old = getattr(jax.config, self.name)
    jax.config.update(self.name, self.value)

  def __exit__(self, *exc):
    jax.config.update(self.name, self.old)


def test_single_head_three_axes():
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(3, 7, 8)), jnp.float32) for _ in range(3))

  def f(q, k, v):
    s = q @ k.swapaxes(-1, -2) / 8 ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((7, 7), bool)), s, -jnp.inf)
    return jax.nn.softmax(s) @ v

  (m,) = _matches(f, q, k, v)
  assert (m.spec.heads, m.spec.causal, m.spec.q_len) == (1, True, 7)
  _check(f, (q, k, v), ("none", True), jnp.float32)


def test_causal_kernel_gets_the_causal_site():
  """At 256 tokens the causal block-skipping kernel runs the matched site, equal."""
  f, args, expect = _problem("bhtd_matmul", "causal_iota", 1, 256, 256, 2, 16, jnp.float32, 2)
  (m,) = _matches(f, *args)
  assert m.spec.causal and _kernels.blocked_causal_applicable(128)(m.spec, "cpu")
  _check(f, args, expect, jnp.float32, kernel=_kernels.blocked_causal(128))


# -- near misses -------------------------------------------------------------------------------


def _near_miss_args():
  rng = np.random.default_rng(5)
  return tuple(jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32) for _ in range(3))


def _scores(q, k):
  return jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.35


def _softmax_max_axis(x, max_axis):
  """exp(x - max over `max_axis`) normalised over the last axis: not a softmax unless
  the max is taken over the last axis too."""
  e = jnp.exp(x - jnp.max(x, axis=max_axis, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


NEAR_MISSES = {
    "softmax_wrong_axis": lambda q, k, v: jnp.einsum(
        "bhqk,bkhd->bqhd", jax.nn.softmax(_scores(q, k), axis=-2), v),
    "no_second_product": lambda q, k, v: jax.nn.softmax(_scores(q, k)).sum(-1),
    "fill_not_large": lambda q, k, v: jnp.einsum(
        "bhqk,bkhd->bqhd",
        jax.nn.softmax(jnp.where(_causal_tril(6, 6), _scores(q, k), -3.0)), v),
    "bias_after_mask": lambda q, k, v: jnp.einsum(
        "bhqk,bkhd->bqhd",
        jax.nn.softmax(jnp.where(_causal_tril(6, 6), _scores(q, k), -1e9) + q[:, :, :1, :1]
                       .transpose(0, 2, 1, 3)), v),
    "scale_not_constant": lambda q, k, v: jnp.einsum(
        "bhqk,bkhd->bqhd", jax.nn.softmax(_scores(q, k) * v[0, 0, 0, 0]), v),
    "multiplicative_mask": lambda q, k, v: jnp.einsum(
        "bhqk,bkhd->bqhd", jax.nn.softmax(_scores(q, k) * _causal_tril(6, 6)), v),
    "max_over_other_axis": lambda q, k, v: jnp.einsum(
        "bhqk,bkhd->bqhd", _softmax_max_axis(_scores(q, k), -2), v),
    "not_exp": lambda q, k, v: jnp.einsum(
        "bhqk,bkhd->bqhd", jax.nn.sigmoid(_scores(q, k)), v),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_not_matched_and_left_alone(name):
  f, args = NEAR_MISSES[name], _near_miss_args()
  assert _matches(f, *args) == []
  g = rewrite.transform(f, _rewrite_pass())
  FIRED.clear()
  assert str(jax.make_jaxpr(g)(*args)) == str(jax.make_jaxpr(f)(*args))
  assert not FIRED


def test_mask_not_causal_is_a_general_mask():
  args = _near_miss_args()
  for mask in (jnp.triu(jnp.ones((6, 6), bool)), jnp.tril(jnp.ones((6, 6), bool), k=1),
               jnp.tril(jnp.ones((6, 6), bool), k=-1) | jnp.eye(6, dtype=bool).at[0, 1].set(True)):
    f = lambda q, k, v, mask=mask: jnp.einsum(  # noqa: E731
        "bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, _scores(q, k), -1e9)), v)
    (m,) = _matches(f, *args)
    assert (m.spec.causal, m.spec.mask_kind) == (False, "bool")
    _check(f, args, ("bool", False), jnp.float32)


def test_causal_mask_as_an_input_is_a_general_mask():
  args = _near_miss_args()
  f = lambda q, k, v, m: jnp.einsum(  # noqa: E731
      "bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(m, _scores(q, k), -1e9)), v)
  m = jnp.tril(jnp.ones((6, 6), bool))
  (match,) = _matches(f, *args, m)
  assert (match.spec.causal, match.spec.mask_kind) == (False, "bool")


def test_scores_used_elsewhere_left_alone():
  args = _near_miss_args()

  def f(q, k, v):
    p = jax.nn.softmax(jnp.where(_causal_tril(6, 6), _scores(q, k), -1e9))
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), p  # the attention weights returned

  assert len(_matches(f, *args)) == 1  # recognised, but the planner leaves it alone whole
  g = rewrite.transform(f, _rewrite_pass())
  FIRED.clear()
  assert str(jax.make_jaxpr(g)(*args)) == str(jax.make_jaxpr(f)(*args))
  assert not FIRED


@pytest.mark.parametrize("which", ["nnx", "linen"])
def test_flax_dot_product_attention_with_causal_mask(which):
  """Flax's own function (nnx's grouped layout with groups of one, linen's) with
  `make_causal_mask`: found, and causal."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  fn = nnx.dot_product_attention if which == "nnx" else nn.dot_product_attention
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 2, 8)), jnp.float32) for _ in range(3))
  f = lambda q, k, v: fn(q, k, v, mask=nn.make_causal_mask(q[..., 0, 0]))  # noqa: E731
  _check(f, (q, k, v), ("none", True), jnp.float32)
