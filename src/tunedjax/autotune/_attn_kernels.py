"""The ``"attention"`` family's kernels: scaled dot-product attention, JAX's semantics.

Each kernel is ``fn(query, key, value, [bias], [mask], spec) -> out`` (the
operands as `_attn_spec.split_operands` reads them) computing exactly what
``jax.nn.dot_product_attention(implementation="xla")`` computes: logits
``q k^T * scale`` in float32 (float64 for float64 inputs), plus the bias, the
masked logits (boolean mask, causal) replaced by ``-0.7 * finfo.max`` (so a
fully masked row attends every key evenly, as JAX's does), a float32
softmax, the probabilities cast to the value's dtype, times the value.
Grouped-query attention: query head ``n`` reads key/value head ``n // G``.

- ``xla``: `jax.nn.dot_product_attention(implementation="xla")`. The reference.
- ``einsum``: the formula written out (``einsum, softmax, einsum``), grouped
  heads as an extra axis instead of JAX's `vmap`.

Example:
  >>> import numpy as np
  >>> from tunedjax.autotune._attn_spec import AttentionSpec
  >>> rng = np.random.default_rng(0)
  >>> q, k, v = (rng.normal(size=(1, 6, 2, 4)).astype(np.float32) for _ in range(3))
  >>> spec = AttentionSpec.from_arrays(q, k, is_causal=True)
  >>> bool(np.allclose(einsum(q, k, v, spec), xla(q, k, v, spec), atol=1e-5))
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tunedjax.autotune._attn_spec import AttentionSpec, split_operands


def xla(*operands: Any) -> jax.Array:
  """The reference: `jax.nn.dot_product_attention` with ``implementation="xla"``."""
  *ops, spec = operands
  q, k, v, bias, mask = split_operands(tuple(ops), spec)
  return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=spec.scale,
                                      is_causal=spec.causal, implementation="xla")


def logits_dtype(dtype: Any) -> Any:
  """The dtype logits and softmax are computed in: float32, or float64 for float64."""
  return jnp.promote_types(dtype, jnp.float32)


def large_negative(dtype: Any) -> jax.Array:
  """What a masked logit becomes: JAX's ``-0.7 * finfo.max``, within float32's range."""
  big = min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
  return jnp.asarray(-0.7 * big, dtype)


def grouped(t: Any, spec: AttentionSpec) -> Any:
  """A 4-D bias or mask ``[b, n, t, s]`` as ``[b, K|1, G|1, t, s]`` (n is 1 or N)."""
  if t is None:
    return None
  b, n, tq, s = t.shape
  if n == 1:
    return t[:, :, None]
  return t.reshape(b, spec.kv_heads, spec.groups, tq, s)


def causal_mask(q_start: Any, q_len: int, k_start: Any, k_len: int) -> jax.Array:
  """``[q_len, k_len]``: query ``q_start + i`` may attend key ``k_start + j``."""
  qi = q_start + jnp.arange(q_len)[:, None]
  kj = k_start + jnp.arange(k_len)[None, :]
  return kj <= qi


def einsum(*operands: Any) -> jax.Array:
  """``softmax(q k^T * scale + bias, masked) v`` written out, grouped heads as an axis."""
  *ops, spec = operands
  q, k, v, bias, mask = split_operands(tuple(ops), spec)
  b, t, _, h = q.shape
  dt = logits_dtype(q.dtype)
  qg = q.reshape(b, t, spec.kv_heads, spec.groups, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=dt)
  logits = logits * jnp.asarray(spec.scale, dt)
  if bias is not None:
    logits = (logits + grouped(bias, spec)).astype(dt)
  keep = None if mask is None else grouped(mask, spec)
  if spec.causal:
    c = causal_mask(0, t, 0, spec.kv_len)
    keep = c if keep is None else jnp.logical_and(keep, c)
  if keep is not None:
    logits = jnp.where(keep, logits, large_negative(dt))
  probs = jax.nn.softmax(logits.astype(jnp.promote_types(dt, jnp.float32)), axis=-1)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v)
  return out.reshape(q.shape).astype(q.dtype)


def always(spec: Any, platform: str) -> bool:
  del spec, platform
  return True


# (name, fn, applicable), the default first.
KERNELS = (
    ("xla", xla, always),
    ("einsum", einsum, always),
)
