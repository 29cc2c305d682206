"""Bad shapes and dtypes raise the exceptions JAX and Flax raise.

`tunedjax.attention`'s errors for bad arrays are `ShapeError`s (a `ValueError`;
a `ShapeTypeError`, also a `TypeError`, where JAX raises one), so each is an
instance of what `jax.nn.dot_product_attention` raises for the same arguments;
through `use_tuned_attention` a bad call raises what Flax's own function
raises (nnx: `ValueError`; linen: its `AssertionError`s), tunedjax's error as
its cause. Every `ShapeError` site of `tunedjax.attention` is a case here.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import tunedjax as tj
from tunedjax.ops.attention import _flax as _attention_flax

_Q = (2, 4, 4, 8)
_KV = (2, 5, 4, 8)


def _arr(shape, dtype=np.float32):
  return jnp.asarray(np.random.default_rng(0).normal(size=shape), dtype)


# (name, q, k, v, bias, mask): each is one `ShapeError` site of `_function.py`.
CASES = [
    ("query rank", _arr((4, 8)), _arr((5, 8)), _arr((5, 8)), None, None),
    ("key rank", _arr(_Q), _arr(_KV[1:]), _arr(_KV), None, None),
    ("value rank", _arr(_Q), _arr(_KV), _arr(_KV[1:]), None, None),
    ("batch", _arr(_Q), _arr((3, 5, 4, 8)), _arr((3, 5, 4, 8)), None, None),
    ("head_dim", _arr(_Q), _arr((2, 5, 4, 4)), _arr((2, 5, 4, 4)), None, None),
    ("k/v lengths", _arr(_Q), _arr(_KV), _arr((2, 6, 4, 8)), None, None),
    ("heads multiple", _arr(_Q), _arr((2, 5, 3, 8)), _arr((2, 5, 3, 8)), None, None),
    ("dtypes differ", _arr(_Q), _arr(_KV, jnp.float16), _arr(_KV, jnp.float16), None, None),
    ("mask dtype", _arr(_Q), _arr(_KV), _arr(_KV), None, _arr((2, 4, 4, 5))),
    ("mask broadcast", _arr(_Q), _arr(_KV), _arr(_KV), None, jnp.ones((2, 4, 3, 3), bool)),
    ("bias broadcast", _arr(_Q), _arr(_KV), _arr(_KV), _arr((2, 4, 3, 3)), None),
    ("not an array", "query", _arr(_KV), _arr(_KV), None, None),
]


def _raised(fn, *args, **kw) -> BaseException | None:
  """What ``fn(*args, **kw)`` raises when traced, or None."""
  try:
    jax.eval_shape(lambda: fn(*args, **kw))
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_raises_what_jax_raises(case):
  _, q, k, v, bias, mask = case
  theirs = _raised(jax.nn.dot_product_attention, q, k, v, bias, mask)
  ours = _raised(tj.attention, q, k, v, bias, mask)
  assert theirs is not None
  assert isinstance(ours, tj.ShapeError), ours
  assert isinstance(ours, tj.AutotuneError)
  assert isinstance(ours, type(theirs)), (type(ours), type(theirs), theirs)
  assert str(ours).startswith("tunedjax.attention: ")


def test_the_error_classes():
  assert issubclass(tj.ShapeError, ValueError) and issubclass(tj.ShapeError, tj.AutotuneError)
  from tunedjax._errors import ShapeTypeError
  assert issubclass(ShapeTypeError, TypeError) and issubclass(ShapeTypeError, tj.ShapeError)


def _swapped(kind: str):
  original = nnx.dot_product_attention if kind == "nnx" else nn.dot_product_attention
  record = _attention_flax._Record("test", kind)  # pylint: disable=protected-access
  return original, _attention_flax.TunedAttentionFn(original, record, threading.Lock(), kind)


# Grouped-query heads: nnx's function takes them, linen's asserts equal heads.
SWAP_CASES = [c for c in CASES if c[0] not in ("not an array", "dtypes differ")] + [
    ("grouped heads", _arr(_Q), _arr((2, 5, 2, 8)), _arr((2, 5, 2, 8)), None, None)]


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("case", SWAP_CASES, ids=[c[0] for c in SWAP_CASES])
def test_swapped_attention_fn_raises_what_flax_raises(case, kind):
  """Each error reachable through the swap (Flax promotes the dtypes first, so a
  dtype mismatch never reaches it) is what Flax's function raises, with ours as
  its cause where ours saw it first."""
  _, q, k, v, bias, mask = case
  original, swapped = _swapped(kind)
  theirs = _raised(original, q, k, v, bias=bias, mask=mask)
  ours = _raised(swapped, q, k, v, bias=bias, mask=mask)
  assert type(ours) is type(theirs), (ours, theirs)  # both None: Flax takes it (a float mask)
  assert str(ours) == str(theirs)


def test_swapped_module_raises_what_flax_raises_under_tj_jit():
  """Through the modules (nnx swapped in place, linen intercepted), eagerly and
  under `tj.jit` with kernel selection: batch dims that differ."""
  x, context = _arr((2, 4, 8)), _arr((3, 5, 8))
  layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError) as plain:
    layer(x, context)
  tj.use_tuned_attention(layer)
  with tj.config_context({"kernel": {"enable": True}, "cache": {"dir": None}}):
    for call in (layer, tj.jit(lambda a, b: layer(a, b))):
      with pytest.raises(ValueError) as swapped:
        call(x, context)
      assert str(swapped.value) == str(plain.value)
      assert isinstance(swapped.value.__cause__, tj.ShapeError)
  module = nn.MultiHeadDotProductAttention(num_heads=2)
  params = module.init(jax.random.key(0), x)
  with pytest.raises(AssertionError) as plain:
    module.apply(params, x, context)
  swap = tj.use_tuned_attention(module)
  with swap, pytest.raises(AssertionError) as swapped:
    module.apply(params, x, context)
  assert str(swapped.value) == str(plain.value)
  assert isinstance(swapped.value.__cause__, tj.ShapeError)
