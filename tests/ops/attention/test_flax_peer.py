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


def _nnx_pair(model, *, calls=None, collections=()):
  """``(plain, swapped, swap)``: functions of ``(params, rest, *inputs)`` giving ``(output,
  gradients of params and inputs, stored state)`` of ``call(model, *inputs)`` for a
  fixed cotangent, pure over `nnx.split`; the plain model under `jax.jit`
  (``calls[0]``), a clone swapped by `use_tuned_attention` under `tj.jit`
  (``calls[1]``); and the swap."""
  calls = calls or (lambda m, *xs: m(*xs),) * 2

  def pure(graphdef, call):
    def f(params, rest, *xs):
      def loss(params, *xs):
        m = nnx.merge(graphdef, params, rest, copy=True)
        y = call(m, *xs)
        kept = tuple(nnx.state(m, c) for c in collections)
        return _dot_cos(y), (y, kept)
      grads, (y, kept) = jax.grad(loss, argnums=_float_args(xs), has_aux=True)(params, *xs)
      return y, grads, kept
    return f

  swapped_model = nnx.clone(model)
  swap = tj.use_tuned_attention(swapped_model)
  swapped = tj.jit(pure(nnx.graphdef(swapped_model), calls[1]))

  def run_swapped(*args):
    with tj.config_context(SWAPPED):
      return swapped(*args)

  return jax.jit(pure(nnx.graphdef(model), calls[0])), run_swapped, swap


def _mha(**kw):
  kw = {"num_heads": 2, "in_features": 8, "qkv_features": 16, "decode": False,
        "rngs": nnx.Rngs(0), **kw}
  return nnx.MultiHeadAttention(**kw)


class _Cases(nnx.Module):
  """Flax's cases in one program: self-attention plain, with a padding mask, with a
  causal mask; cross-attention; grouped-query heads (`num_kv_heads`); attention
  dropout while training with its weights sown; autoregressive decoding, one token
  a step from an initialised cache, three steps; bfloat16."""

  def __init__(self, x):
    self.plain, self.padded, self.causal, self.cross = (_mha(rngs=nnx.Rngs(i)) for i in range(4))
    self.gqa = _mha(num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(4))
    self.dropout = _mha(dropout_rate=0.5, deterministic=False, rngs=nnx.Rngs(5, dropout=1))
    self.decoder = _mha(decode=True, rngs=nnx.Rngs(6))
    self.decoder.init_cache(x.shape, dtype=x.dtype)
    self.half = _mha(dtype=jnp.bfloat16, rngs=nnx.Rngs(7))

  def __call__(self, x, ctx, padding, causal, xb):
    cases = [self.plain(x), self.padded(x, mask=padding), self.causal(x, mask=causal),
             self.cross(x, ctx), self.gqa(x), self.dropout(x, sow_weights=True)]
    steps = [self.decoder(x[:, s:s + 1]) for s in range(3)]
    return {"cases": jnp.concatenate(cases, -1), "decode": jnp.concatenate(steps, 1),
            "bfloat16": self.half(xb)}


def _dot_cos(y):
  """A fixed cotangent's loss: every leaf of `y` against a cosine, summed in float32."""
  return sum(jnp.sum(v.astype(jnp.float32) * jnp.cos(jnp.arange(v.size).reshape(v.shape)))
             for v in jax.tree.leaves(y))


def _split_half(result):
  """``(float32 parts, bfloat16 parts)`` of an nnx `_Cases` result: the bfloat16
  module's output, the gradients of its parameters and of its input."""
  y, grads, kept = result
  params = nnx.to_pure_dict(grads[0])
  half = params.pop("half")
  return ((y["cases"], y["decode"], params, grads[1:-1], kept),
          (y["bfloat16"], half, grads[-1]))


def _inputs():
  x, ctx = _x((2, 7, 8)), _x((2, 5, 8), seed=1)
  valid = np.arange(7)[None, :] < np.array([[7], [4]])
  return x, ctx, valid


def test_nnx_cases():
  """Every case in one program: outputs, gradients, the decoder's cache after three
  steps and the sown weights agree; dropout and sown weights keep Flax's function
  (same draws, same weights) and the swap says why; the rest ran tuned."""
  x, ctx, valid = _inputs()
  padding, causal = nnx.make_attention_mask(valid, valid), nnx.make_causal_mask(jnp.ones((2, 7)))
  model = _Cases(x)
  plain_fn, swapped_fn, swap = _nnx_pair(model, collections=(nnx.Cache, nnx.Intermediate))
  state = nnx.split(model, nnx.Param, ...)[1:]
  inputs = (x, ctx, padding, causal, x.astype(jnp.bfloat16))
  plain, swapped = plain_fn(*state, *inputs), swapped_fn(*state, *inputs)
  (plain32, plain16), (swapped32, swapped16) = _split_half(plain), _split_half(swapped)
  _agree(plain32, swapped32)
  _agree(plain16, swapped16, "bfloat16")
  assert swapped[0]["bfloat16"].dtype == jnp.bfloat16
  assert jax.tree.leaves(plain[2][1])  # the weights were sown
  assert not jnp.array_equal(plain[2][0]["decoder"]["cache_index"][...], 0)
  assert sorted(swap.fallbacks) == ["dropout"], swap.fallbacks
  assert sorted(swap.tuned) == ["causal", "cross", "decoder", "gqa", "half", "padded", "plain"]


def test_float64_stays_float64():
  """float64 stays float64 (plain nnx sends float64 to `jax.nn.dot_product_attention`,
  which softmaxes in float32: the reference here is the same module sowing its
  weights, which keeps float64); linen decoding, three steps from its cache, float64
  to 1e-12 (its softmax stays float64)."""
  with jax.enable_x64(True):
    x = _x((2, 4, 8), "float64")
    model = _mha(param_dtype=jnp.float64, dtype=jnp.float64)
    sowing, swapped_fn, swap = _nnx_pair(
        model, calls=(lambda m, x: m(x, sow_weights=True), lambda m, x: m(x)))
    state = nnx.split(model, nnx.Param, ...)[1:]
    reference, swapped = sowing(*state, x), swapped_fn(*state, x)
    assert swapped[0].dtype == jnp.float64 and swap.tuned
    _agree(reference[:2], swapped[:2], "float64")
    module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, decode=True,
                                             dtype=jnp.float64, param_dtype=jnp.float64)
    variables = module.init(jax.random.key(0), x)
    plain_fn, swapped_fn, _ = _linen_pair(module, apply=_decode(module), mutable=("cache",))
    plain, swapped = plain_fn(variables, x), swapped_fn(variables, x)
    assert swapped[0].dtype == jnp.float64
    _agree(plain, swapped, "float64")


# -- linen -------------------------------------------------------------------------------


def _linen_pair(module, *, apply=None, mutable=(), rngs=None):
  """``(plain, swapped, swap)``: functions of ``(variables, *inputs)`` giving ``(output,
  gradients of params and inputs, mutated collections)`` of ``module.apply`` (or
  `apply`); plain under `jax.jit`, swapped (`use_tuned_attention`) under `tj.jit`."""
  apply = apply or module.apply

  def f(variables, *xs):
    def loss(params, *xs):
      y, mutated = apply({**variables, "params": params}, *xs, mutable=list(mutable),
                                rngs=rngs)
      return _dot_cos(y), (y, mutated)
    grads, (y, mutated) = jax.grad(loss, argnums=_float_args(xs), has_aux=True)(
        variables["params"], *xs)
    return y, grads, mutated

  swap, swapped = tj.use_tuned_attention(module), tj.jit(f)

  def run_swapped(*args):
    with tj.config_context(SWAPPED), swap:
      return swapped(*args)

  return jax.jit(f), run_swapped, swap


def _decode(module):
  """``apply`` of a decoding module (`decode=True`, its cache from `init`) over the
  first three tokens, one a step, chaining the cache: the steps' outputs."""

  def apply(variables, x, mutable, rngs=None):
    steps = []
    for s in range(3):
      y, mutated = module.apply(variables, x[:, s:s + 1], mutable=mutable, rngs=rngs)
      steps.append(y)
      variables = {**variables, **mutated}
    return jnp.concatenate(steps, 1), mutated

  return apply


class _LinenCases(nn.Module):
  """linen's cases in one program: self-attention plain, padded, causal;
  cross-attention; attention dropout while training with its weights sown; bfloat16."""

  @nn.compact
  def __call__(self, x, ctx, padding, causal, xb):
    attend = lambda **kw: nn.MultiHeadDotProductAttention(  # noqa: E731
        num_heads=2, qkv_features=16, **kw)
    cases = [attend(name="plain")(x), attend(name="padded")(x, mask=padding),
             attend(name="causal")(x, mask=causal), attend(name="cross")(x, ctx),
             attend(name="dropout", dropout_rate=0.5, deterministic=False)(x, sow_weights=True)]
    return {"cases": jnp.concatenate(cases, -1),
            "bfloat16": attend(name="half", dtype=jnp.bfloat16)(xb)}


def _split_linen(result):
  """``(float32 parts, bfloat16 parts)`` of a `_LinenCases` result (as `_split_half`)."""
  y, grads, mutated = result
  params = {k: v for k, v in grads[0].items() if k != "half"}
  return (y["cases"], params, grads[1:-1], mutated), (y["bfloat16"], grads[0]["half"], grads[-1])


def test_linen_cases():
  """Every case in one program (and decoding, three steps from the cache, in another):
  outputs, gradients, the cache and the sown weights agree; dropout and sown weights
  keep Flax's function and the swap says why; the rest ran tuned."""
  x, ctx, valid = _inputs()
  padding, causal = nn.make_attention_mask(valid, valid), nn.make_causal_mask(jnp.ones((2, 7)))
  module = _LinenCases()
  inputs = (x, ctx, padding, causal, x.astype(jnp.bfloat16))
  variables = module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, *inputs)
  plain_fn, swapped_fn, swap = _linen_pair(module, mutable=("intermediates",),
                                           rngs={"dropout": jax.random.key(1)})
  plain, swapped = plain_fn(variables, *inputs), swapped_fn(variables, *inputs)
  (plain32, plain16), (swapped32, swapped16) = _split_linen(plain), _split_linen(swapped)
  _agree(plain32, swapped32)
  _agree(plain16, swapped16, "bfloat16")
  assert swapped[0]["bfloat16"].dtype == jnp.bfloat16
  assert jax.tree.leaves(plain[2])  # the weights were sown
  assert len(swap.tuned) == 5 and len(swap.fallbacks) == 1, (swap.tuned, swap.fallbacks)
  decoder = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, decode=True)
  variables = decoder.init(jax.random.key(0), x)
  plain_fn, swapped_fn, _ = _linen_pair(decoder, apply=_decode(decoder), mutable=("cache",))
  _agree(plain_fn(variables, x), swapped_fn(variables, x))
