"""`tunedjax.attention`: scaled dot-product attention, its kernel chosen per shape bucket.

The arguments are checked here (errors name the bad value), the call becomes
an `AttentionSpec`, and `autotune.dispatch("attention", ...)` runs the kernel
kernel selection chose for its bucket, or the reference outside it. Under a
half-precision autocast policy the operands are cast to its compute dtype
first (`half_compute_dtype`), so the bucket is the one that runs.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax._errors import (AutotuneError, ShapeError, ShapeTypeError, format_choices,
                              show_value)
from tunedjax import autotune
from tunedjax import mixed_precision as mp
from tunedjax.ops.attention import _causal
from tunedjax.ops.attention import _family as _attn_family
from tunedjax.ops.attention._spec import AttentionSpec

_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _bad(message: str, cls: type[AutotuneError] = ShapeError) -> AutotuneError:
  """The error for a bad argument: a `ShapeError` (a `ValueError`, as JAX raises for
  shapes and dtypes) unless `cls` says otherwise (`ShapeTypeError` where JAX raises
  a `TypeError`)."""
  return cls(f"tunedjax.attention: {message}")


def _as_array(name: str, x: Any) -> jax.Array:
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise _bad(f"{name} must be an array, got {show_value(x)} ({type(x).__name__}).",
               ShapeTypeError) from e


def _broadcast_operand(name: str, t: Any, logits: tuple[int, int, int, int],
                       is_mask: bool) -> jax.Array | None:
  """A bias or mask as a 4-D array broadcastable to ``[B, N, T, S]``, or None."""
  if t is None:
    return None
  t = _as_array(name, t)
  if is_mask and t.dtype != np.dtype(bool):
    raise _bad(f"mask must be a boolean array (True: attend), got dtype {t.dtype}; pass an "
               "additive float mask as bias=.")
  if not is_mask and not jnp.issubdtype(t.dtype, jnp.floating):
    raise _bad(f"bias must be a float array, got dtype {t.dtype}.")
  if t.ndim > 4:
    raise _bad(f"{name} must have at most 4 dimensions [batch, heads, q_len, kv_len], got "
               f"shape {tuple(t.shape)}.")
  t = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
  for axis, (got, want) in enumerate(zip(t.shape, logits)):
    if got not in (1, want):
      raise _bad(f"{name} of shape {tuple(t.shape)} does not broadcast to [batch, heads, "
                 f"q_len, kv_len] = {list(logits)}: axis {axis} is {got}, must be 1 or "
                 f"{want}.", ShapeTypeError)
  return t


def attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
              scale: float | None = None, is_causal: bool = False) -> jax.Array:
  """Scaled dot-product attention, the same function as `jax.nn.dot_product_attention`.

  ``softmax(query key^T * scale + bias, masked) value`` per head, in JAX's
  layout: query ``[batch, q_len, heads, head_dim]``, key and value
  ``[batch, kv_len, kv_heads, head_dim]`` (the batch axis may be left out of
  all three). Fewer key/value heads than query heads is grouped-query
  attention (query head ``n`` reads key/value head ``n // (heads // kv_heads)``).
  Logits and softmax are computed in float32 (float64 for float64 inputs);
  masked logits become ``-0.7 * finfo.max``, so a fully masked row averages
  every value, as JAX's does.

  Outside kernel selection (plain `jax.jit`, eager) it runs the reference,
  ``jax.nn.dot_product_attention(implementation="xla")`` (for float64, the same
  formula with a float64 softmax, where JAX's casts the logits to float32). Under `tunedjax.jit`
  or a `Trainer` with kernel selection on (``kernel.enable``), each call's
  bucket (batch, lengths, heads, key/value heads, head dimension, dtype, mask
  kind, causality, platform) runs its measured fastest kernel, each checked
  against the reference first, timed forward and backward: the ``"attention"``
  op family (see `tunedjax.autotune.kernels("attention")`), pinned with
  ``kernel.hints={"attention": "blocked_256"}``. Under mixed precision with a
  float16 or bfloat16 compute dtype (``mixed_precision.enable``, `Trainer`'s
  ``precision``, `mixed_precision.autocast`), the call is decided and run in
  that dtype (its bucket reads it; softmax still in float32) and returns
  `query`'s dtype.

  Args:
    query: ``[batch, q_len, heads, head_dim]``, float16, bfloat16, float32 or float64.
    key: ``[batch, kv_len, kv_heads, head_dim]``, `query`'s dtype; ``heads`` a
      multiple of ``kv_heads``.
    value: `key`'s shape and dtype.
    bias: an additive float bias broadcastable to ``[batch, heads, q_len,
      kv_len]`` (at most 4-D; leading axes may be left out), or None.
    mask: a boolean mask of such a shape, True where a query may attend a
      key, or None. A mask that is the causal mask by how it was computed
      (``jnp.tril`` of ones, ``iota >= iota``, Flax's ``make_causal_mask``),
      alone or ANDed with others (a padding mask), makes the call causal, the
      others remaining its mask: the same function, a causal bucket.
    scale: the logits' scale (default ``1 / sqrt(head_dim)``).
    is_causal: query ``i`` attends keys ``j <= i`` only.

  Returns:
    ``[batch, q_len, heads, head_dim]`` (`query`'s shape), `query`'s dtype.

  Raises:
    ShapeError: an array argument of the wrong rank, shape or dtype (a
      `ValueError`, as JAX's; a `ShapeTypeError`, also a `TypeError`, where
      JAX raises one: an argument that is not an array, a mask or bias that
      does not broadcast); the message names it and says what is allowed.
    AutotuneError: `scale` or `is_causal` not valid.

  Example:
    >>> import jax, numpy as np, tunedjax as tj
    >>> rng = np.random.default_rng(0)
    >>> q = rng.normal(size=(2, 16, 4, 8)).astype(np.float32)
    >>> kv = rng.normal(size=(2, 16, 2, 8)).astype(np.float32)  # grouped-query
    >>> out = tj.attention(q, kv, kv, is_causal=True)
    >>> want = jax.nn.dot_product_attention(q, kv, kv, is_causal=True)
    >>> out.shape, bool(np.allclose(out, want, atol=1e-6))
    ((2, 16, 4, 8), True)
  """
  q, k, v, unbatched = _checked_qkv(query, key, value)
  _check_options(scale, is_causal)
  b, t, n, _ = q.shape
  logits = (b, n, t, k.shape[1])
  bias = _broadcast_operand("bias", bias, logits, is_mask=False)
  mask = _broadcast_operand("mask", mask, logits, is_mask=True)
  causal, mask = _causal.split_mask(mask, t, k.shape[1])  # tril, iota >= iota, and padding
  is_causal = bool(is_causal) or causal
  out = _dispatch(q, k, v, bias, mask, scale=scale, is_causal=bool(is_causal))
  return out[0] if unbatched else out


def half_compute_dtype() -> np.dtype | None:
  """The half-precision dtype the attention traced here is decided and run in, or None.

  Under an autocast pass whose matmuls run in float16 or bfloat16 (`autocast`,
  `tunedjax.jit` with ``mixed_precision.enable``, a `wrap`ped model), that
  dtype, as the pass would compute the kernel's matmuls; None outside one,
  where ``dot_general`` is denied, where the compute dtype is float32, or in a
  float32 `precision_region`.
  """
  compute = mp.trace_compute_dtype("dot_general")
  if compute is None or np.dtype(compute).itemsize > 2:
    return None
  return np.dtype(compute)


def _dispatch(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
              mask: jax.Array | None, *, scale: float | None, is_causal: bool) -> jax.Array:
  """The family's kernel for the call's bucket. Under a half-precision policy
  (`half_compute_dtype`) the operands are cast to it before the bucket is
  known, the kernel runs as traced (`as_traced`: its softmax statistics stay
  float32, the autocast pass adds no cast), and its output is cast back to the
  query's dtype, what the call returns without the pass."""
  compute, out_dtype = half_compute_dtype(), q.dtype
  if compute is not None:
    q, k, v = (x.astype(compute) for x in (q, k, v))
    bias = None if bias is None else bias.astype(compute)
  spec = AttentionSpec.from_arrays(q, k, bias, mask, scale=scale, is_causal=is_causal)
  operands = [q, k, v] + [x for x in (bias, mask) if x is not None]
  if compute is None:
    return autotune.dispatch(_attn_family.NAME, spec, *operands)
  with mp.as_traced():
    out = autotune.dispatch(_attn_family.NAME, spec, *operands)
  return out.astype(out_dtype)


def _checked_qkv(query: Any, key: Any, value: Any) -> tuple[jax.Array, jax.Array, jax.Array, bool]:
  """Query, key and value as 4-D arrays of one dtype that fit each other, and
  whether the batch axis was left out; an `AutotuneError` names what does not fit."""
  q, k, v = (_as_array(n, x) for n, x in (("query", query), ("key", key), ("value", value)))
  if q.ndim not in (3, 4):
    raise _bad(f"query must be [batch, q_len, heads, head_dim] (or without the batch axis), "
               f"got shape {tuple(q.shape)}.")
  for name, x in (("key", k), ("value", v)):
    if x.ndim != q.ndim:
      raise _bad(f"{name} must have query's rank {q.ndim}, got shape {tuple(x.shape)} for "
                 f"query of shape {tuple(q.shape)}.")
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  if np.dtype(q.dtype).name not in _DTYPES:
    raise _bad(f"query's dtype must be one of {format_choices(_DTYPES)}, got {q.dtype}.")
  for name, x in (("key", k), ("value", v)):
    if x.dtype != q.dtype:
      raise _bad(f"{name}'s dtype {x.dtype} differs from query's {q.dtype}; cast them to "
                 "one dtype.")
  if v.shape != k.shape:
    raise _bad(f"value's shape {tuple(v.shape)} must equal key's {tuple(k.shape)}.")
  b, t, n, h = q.shape
  if k.shape[0] != b or k.shape[3] != h:
    raise _bad(f"key of shape {tuple(k.shape)} does not fit query of shape {tuple(q.shape)}: "
               "the batch and head_dim axes must match ([batch, kv_len, kv_heads, head_dim]).")
  kv_heads = k.shape[2]
  if kv_heads < 1 or n % kv_heads:
    raise _bad(f"query's {n} heads must be a multiple of key/value's {kv_heads} heads "
               "(grouped-query attention).")
  if min(q.shape + k.shape) < 1:
    raise _bad(f"empty attention: query {tuple(q.shape)}, key {tuple(k.shape)}.")
  return q, k, v, unbatched


def _check_options(scale: Any, is_causal: Any) -> None:
  if scale is not None and not (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
                                and math.isfinite(scale)):
    raise _bad(f"scale must be a finite number or None (1/sqrt(head_dim)), got "
               f"{show_value(scale)}.", AutotuneError)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise _bad(f"is_causal must be True or False, got {show_value(is_causal)}.", AutotuneError)
