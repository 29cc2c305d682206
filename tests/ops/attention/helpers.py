"""Random attention operands and a float64 reference (forward and VJP) for the attention tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax.ops.attention._spec import AttentionSpec


def draw(rng, b, t, s, kv_heads, groups, h, *, dtype=np.float32, bias_shape=None,
         mask_shape=None, padding=False):
  """Query, key, value, bias, mask (None where not asked for) and a cotangent.

  `padding=True` makes the mask a key-padding mask of shape ``mask_shape``
  (``[B, 1, 1, S]``): each batch row keeps a random prefix of at least one key.
  """
  n = kv_heads * groups
  q = rng.normal(size=(b, t, n, h))
  k, v = rng.normal(size=(b, s, kv_heads, h)), rng.normal(size=(b, s, kv_heads, h))
  bias = None if bias_shape is None else rng.normal(size=bias_shape)
  mask = None
  if mask_shape is not None:
    if padding:
      lengths = rng.integers(1, s + 1, size=(mask_shape[0], 1, 1, 1))
      mask = np.broadcast_to(np.arange(s) < lengths, mask_shape)
    else:
      mask = rng.random(mask_shape) < 0.7
  ct = rng.normal(size=(b, t, n, h))
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), cast(bias), None if mask is None else jnp.asarray(mask), \
      cast(ct)


def vjp_of(fn, q, k, v, bias, mask, ct, **kw):
  """``(out, (dq, dk, dv[, dbias]))`` of ``fn(q, k, v, bias, mask, **kw)`` for cotangent `ct`."""
  floats = [q, k, v] + ([bias] if bias is not None else [])

  def f(*xs):
    b = xs[3] if bias is not None else None
    return fn(xs[0], xs[1], xs[2], b, mask, **kw)

  @jax.jit
  def run(floats, ct):
    out, vjp = jax.vjp(f, *floats)
    return out, vjp(ct)

  return run(floats, ct)


def reference64(q, k, v, bias, mask, ct, *, is_causal=False, scale=None):
  """Attention in float64 in NumPy: the output and the gradients ``(dq, dk, dv[, dbias])``
  for cotangent `ct`, as NumPy float64.

  Not `jax.nn.dot_product_attention` in float64: JAX's casts the logits to float32
  before its softmax, so it is no float64 reference.
  """
  f64 = lambda x: None if x is None else np.asarray(x, np.float64)
  q, k, v, bias, ct = f64(q), f64(k), f64(v), f64(bias), f64(ct)
  b, t, n, h = q.shape
  s, groups = k.shape[1], n // k.shape[2]
  kr, vr = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)  # head i reads i // G
  scale = 1 / np.sqrt(h) if scale is None else scale
  logits = np.einsum("btnh,bsnh->bnts", q, kr) * scale
  if bias is not None:
    logits = logits + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  keep = np.ones((b, n, t, s), bool)
  if mask is not None:
    keep = keep & np.asarray(mask, bool).reshape((1,) * (4 - np.ndim(mask)) + np.shape(mask))
  if is_causal:
    keep = keep & (np.arange(s)[None, :] <= np.arange(t)[:, None])
  logits = np.where(keep, logits, -0.7 * float(np.finfo(np.float32).max))
  p = np.exp(logits - logits.max(axis=-1, keepdims=True))
  p = p / p.sum(axis=-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p, vr)
  dp = np.einsum("btnh,bsnh->bnts", ct, vr)
  ds = np.where(keep, p * (dp - np.sum(dp * p, axis=-1, keepdims=True)), 0.0)
  fold = lambda x: x.reshape(b, s, k.shape[2], groups, h).sum(axis=3)
  grads = [np.einsum("bnts,bsnh->btnh", ds, kr) * scale,
           fold(np.einsum("bnts,btnh->bsnh", ds, q) * scale),
           fold(np.einsum("bnts,btnh->bsnh", p, ct))]
  if bias is not None:
    full = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    axes = tuple(i for i, d in enumerate(full.shape) if d == 1)
    grads.append(ds.sum(axis=axes, keepdims=True).reshape(bias.shape))
  return out, grads


def kernel_call(fn):
  """A kernel ``fn(*operands, spec)`` as ``f(q, k, v, bias, mask, is_causal=, scale=)``."""

  def call(q, k, v, bias, mask, *, is_causal=False, scale=None):
    spec = AttentionSpec.from_arrays(q, k, bias, mask, scale=scale, is_causal=is_causal)
    ops = [x for x in (bias, mask) if x is not None]
    return fn(q, k, v, *ops, spec)

  return call


def rel(a, b):
  """max |a - b| / max |b|, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
