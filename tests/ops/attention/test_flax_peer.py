"""Flax's own attention test cases, run plain and through the swap: the swap is a drop-in.

The behaviours Flax's linen and nnx attention tests exercise (padding masks,
causal masks, cross attention, autoregressive decoding with a cache,
attention dropout while training, ``sow_weights``, grouped-query heads,
float64, bfloat16), each run twice: the plain module under `jax.jit`, and the
module swapped by `tunedjax.use_tuned_attention` under `tunedjax.jit` with
kernel selection on (the attention pinned to ``einsum``, a kernel other than
the reference, so nothing is tuned). Outputs, the gradients of the
parameters and the inputs, and what the module stores (its cache, the sown
weights) must agree: float32 to 2e-5, bfloat16 to 2e-2, float64 to 1e-12.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import tunedjax as tj

pytestmark = pytest.mark.slow  # each test compiles its program twice (2-5 s each, unloaded)

TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float64": 1e-12}
SWAPPED = {"kernel": {"enable": True, "hints": {"attention": "einsum"}}, "cache": {"dir": None}}


def _rel(a, b):
  flat = lambda t: np.concatenate(  # noqa: E731
      [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
  assert jax.tree.structure(a) == jax.tree.structure(b)
  if not jax.tree.leaves(b):
    return 0.0
  a, b = flat(a), flat(b)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _x(shape, dtype="float32", seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _float_args(xs):
  """The parameters' argument and the floating inputs': what the gradients are of."""
  return (0,) + tuple(i + 1 for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.floating))


def _agree(plain, swapped, dtype="float32"):
  for got, want in zip(swapped, plain):
    assert _rel(got, want) <= TOL[dtype], _rel(got, want)


# -- nnx ---------------------------------------------------------------------------------


def _nnx_pair(model, *, call=None, collections=()):
  """``(plain, swapped)``: functions of ``(params, rest, *inputs)`` giving ``(output,
  gradients of params and inputs, stored state)`` of ``call(model, *inputs)`` for a
  fixed cotangent, pure over `nnx.split`; the plain model under `jax.jit`, a clone
  swapped by `use_tuned_attention` under `tj.jit`; and the swap."""
  call = call or (lambda m, *xs: m(*xs))

  def pure(graphdef):
    def f(params, rest, *xs):
      def loss(params, *xs):
        m = nnx.merge(graphdef, params, rest, copy=True)
        y = call(m, *xs)
        ct = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))
        kept = tuple(nnx.state(m, c) for c in collections)
        return jnp.sum(y * ct), (y, kept)
      grads, (y, kept) = jax.grad(loss, argnums=_float_args(xs), has_aux=True)(params, *xs)
      return y, grads, kept
    return f

  swapped_model = nnx.clone(model)
  swap = tj.use_tuned_attention(swapped_model)
  swapped = tj.jit(pure(nnx.graphdef(swapped_model)))

  def run_swapped(*args):
    with tj.config_context(SWAPPED):
      return swapped(*args)

  return jax.jit(pure(nnx.graphdef(model))), run_swapped, swap


def _nnx_run(model, inputs, **kw):
  """Plain and swapped results of one call (`_nnx_pair`) on the model's state."""
  plain, swapped, swap = _nnx_pair(model, **kw)
  state = nnx.split(model, nnx.Param, ...)[1:]
  return plain(*state, *inputs), swapped(*state, *inputs), swap


def _mha(**kw):
  kw = {"num_heads": 2, "in_features": 8, "qkv_features": 16, "decode": False,
        "rngs": nnx.Rngs(0), **kw}
  return nnx.MultiHeadAttention(**kw)


class _Cases(nnx.Module):
  """Flax's cases in one program: self-attention plain, with a padding mask, with a
  causal mask; cross-attention; grouped-query heads (`num_kv_heads`)."""

  def __init__(self):
    self.plain, self.padded, self.causal, self.cross = (_mha(rngs=nnx.Rngs(i)) for i in range(4))
    self.gqa = _mha(num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(4))

  def __call__(self, x, ctx, padding, causal):
    return jnp.concatenate([self.plain(x), self.padded(x, mask=padding),
                            self.causal(x, mask=causal), self.cross(x, ctx), self.gqa(x)], -1)


def test_nnx_cases():
  x, ctx = _x((2, 7, 8)), _x((2, 5, 8), seed=1)
  valid = np.arange(7)[None, :] < np.array([[7], [4]])
  padding, causal = nnx.make_attention_mask(valid, valid), nnx.make_causal_mask(jnp.ones((2, 7)))
  plain, swapped, swap = _nnx_run(_Cases(), (x, ctx, padding, causal))
  _agree(plain, swapped)
  assert len(swap.tuned) == 5 and not swap.fallbacks


def test_nnx_decode_with_cache():
  """Decoding one token at a time from an initialised cache, three steps, each step's
  output, gradients and cache."""
  x = _x((2, 4, 8))
  model = _mha(decode=True)
  model.init_cache(x.shape, dtype=x.dtype)
  plain_fn, swapped_fn, _ = _nnx_pair(model, collections=(nnx.Cache,))
  state = nnx.split(model, nnx.Param, ...)[1:]
  for step in range(3):
    plain = plain_fn(*state, x[:, step:step + 1])
    _agree(plain, swapped_fn(*state, x[:, step:step + 1]))
    nnx.update(model, plain[2][0])  # the next step from the plain cache
    state = nnx.split(model, nnx.Param, ...)[1:]


def test_nnx_dropout_and_sow_keep_flax():
  """Attention dropout while training and sown weights keep Flax's function: same
  draws, same weights, and the swap says why."""
  x = _x((2, 6, 8))
  model = _mha(dropout_rate=0.5, deterministic=False, rngs=nnx.Rngs(0, dropout=1))
  plain, swapped, swap = _nnx_run(model, (x,), call=lambda m, x: m(x, sow_weights=True),
                                  collections=(nnx.Intermediate,))
  _agree(plain, swapped)
  assert jax.tree.leaves(plain[2])  # the weights were sown
  assert swap.fallbacks and not swap.tuned


def test_nnx_float64_and_bfloat16():
  """float64 stays float64 (plain nnx sends float64 to `jax.nn.dot_product_attention`,
  which softmaxes in float32: the reference here is the same module sowing its
  weights, which keeps float64); bfloat16 as plain."""
  with jax.enable_x64(True):
    x = _x((2, 5, 8), "float64")
    model = _mha(param_dtype=jnp.float64, dtype=jnp.float64)
    sowing = _nnx_pair(model, call=lambda m, x: m(x, sow_weights=True))[0]  # plain, float64
    _, swapped_fn, swap = _nnx_pair(model)
    state = nnx.split(model, nnx.Param, ...)[1:]
    reference, swapped = sowing(*state, x), swapped_fn(*state, x)
    assert swapped[0].dtype == jnp.float64 and swap.tuned
    _agree(reference[:2], swapped[:2], "float64")
  x = _x((2, 5, 8), "bfloat16")
  plain, swapped, swap = _nnx_run(_mha(dtype=jnp.bfloat16), (x,))
  assert swapped[0].dtype == jnp.bfloat16 and swap.tuned
  _agree(plain[:1], swapped[:1], "bfloat16")


# -- linen -------------------------------------------------------------------------------


def _linen_pair(module, *, mutable=(), rngs=None, **kw):
  """``(plain, swapped, swap)``: functions of ``(variables, *inputs)`` giving ``(output,
  gradients of params and inputs, mutated collections)`` of ``module.apply``; plain
  under `jax.jit`, swapped (`use_tuned_attention`) under `tj.jit`."""

  def f(variables, *xs):
    def loss(params, *xs):
      y, mutated = module.apply({**variables, "params": params}, *xs, mutable=list(mutable),
                                rngs=rngs, **kw)
      ct = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))
      return jnp.sum(y * ct), (y, mutated)
    grads, (y, mutated) = jax.grad(loss, argnums=_float_args(xs), has_aux=True)(
        variables["params"], *xs)
    return y, grads, mutated

  swap, swapped = tj.use_tuned_attention(module), tj.jit(f)

  def run_swapped(*args):
    with tj.config_context(SWAPPED), swap:
      return swapped(*args)

  return jax.jit(f), run_swapped, swap


def _linen_run(module, variables, inputs, **kw):
  plain, swapped, swap = _linen_pair(module, **kw)
  return plain(variables, *inputs), swapped(variables, *inputs), swap


class _LinenCases(nn.Module):
  """linen's cases in one program: self-attention plain, padded, causal; cross-attention."""

  @nn.compact
  def __call__(self, x, ctx, padding, causal):
    attend = lambda: nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)  # noqa: E731
    return jnp.concatenate([attend()(x), attend()(x, mask=padding), attend()(x, mask=causal),
                            attend()(x, ctx)], -1)


def test_linen_cases():
  x, ctx = _x((2, 7, 8)), _x((2, 5, 8), seed=1)
  valid = np.arange(7)[None, :] < np.array([[7], [4]])
  padding, causal = nn.make_attention_mask(valid, valid), nn.make_causal_mask(jnp.ones((2, 7)))
  module = _LinenCases()
  inputs = (x, ctx, padding, causal)
  variables = module.init(jax.random.key(0), *inputs)
  plain, swapped, swap = _linen_run(module, variables, inputs)
  _agree(plain, swapped)
  assert len(swap.tuned) == 4 and not swap.fallbacks


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_linen_decode_with_cache(dtype):
  """Autoregressive decoding, one token a step from the cache `init` made: each step's
  output, gradients and cache; float64 to 1e-12 (its softmax stays float64)."""
  with jax.enable_x64(dtype == "float64"):
    x = _x((2, 4, 8), dtype)
    module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, decode=True,
                                             dtype=dtype, param_dtype=dtype)
    variables = module.init(jax.random.key(0), x)
    plain_fn, swapped_fn, _ = _linen_pair(module, mutable=("cache",))
    for step in range(3):
      plain = plain_fn(variables, x[:, step:step + 1])
      swapped = swapped_fn(variables, x[:, step:step + 1])
      assert swapped[0].dtype == np.dtype(dtype)
      _agree(plain, swapped, dtype)
      variables = {**variables, **plain[2]}


def test_linen_dropout_and_sow_keep_flax():
  x = _x((2, 6, 8))
  module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, dropout_rate=0.5,
                                           deterministic=False)
  variables = module.init(jax.random.key(0), x)
  plain, swapped, swap = _linen_run(module, variables, (x,), mutable=("intermediates",),
                                    rngs={"dropout": jax.random.key(1)}, sow_weights=True)
  _agree(plain, swapped)
  assert jax.tree.leaves(plain[2])
  assert swap.fallbacks and not swap.tuned


def test_linen_bfloat16():
  x = _x((2, 5, 8), "bfloat16")
  module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, dtype=jnp.bfloat16)
  variables = module.init(jax.random.key(0), x)
  plain, swapped, swap = _linen_run(module, variables, (x,))
  assert swapped[0].dtype == jnp.bfloat16 and swap.tuned
  _agree(plain[:1], swapped[:1], "bfloat16")
