"""`AttentionSpec`: what one attention site is (the ``"attention"`` family's spec).

The layout is `jax.nn.dot_product_attention`'s: query ``[batch, q_len, heads,
head_dim]``, key and value ``[batch, kv_len, kv_heads, head_dim]`` (grouped-query
attention when ``kv_heads < heads``), an optional additive bias and an optional
boolean mask, each 4-D and broadcastable to ``[batch, heads, q_len, kv_len]``.
A kernel's operands are ``(query, key, value)``, then the bias if the spec has
one, then the mask if it has one (`split_operands`).

Example:
  >>> import numpy as np
  >>> q = np.ones((2, 10, 8, 16), np.float32)
  >>> kv = np.ones((2, 12, 2, 16), np.float32)
  >>> spec = AttentionSpec.from_arrays(q, kv, mask=np.ones((2, 1, 1, 12), bool))
  >>> spec.mask_kind, spec.groups, spec.scale == 0.25
  ('bool', 4, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

MASK_KINDS = ("none", "bool", "bias", "bias+bool")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """One scaled dot-product attention call.

  Attributes:
    batch: the batch size (B).
    q_len: query tokens (T).
    kv_len: key/value tokens (S).
    heads: query heads (N).
    kv_heads: key/value heads (K; N is a multiple of K).
    head_dim: the head dimension (H).
    dtype: the query/key/value dtype name (``"float32"``).
    causal: query i attends keys j <= i only (top-left aligned, as JAX's).
    scale: the logits' scale (``1 / sqrt(head_dim)`` unless given).
    bias_shape: the additive bias's 4-D shape, or None.
    bias_dtype: the bias's dtype name, or None.
    mask_shape: the boolean mask's 4-D shape, or None.
  """

  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str
  causal: bool = False
  scale: float = 1.0
  bias_shape: tuple[int, ...] | None = None
  bias_dtype: str | None = None
  mask_shape: tuple[int, ...] | None = None

  @classmethod
  def from_arrays(cls, query: Any, key: Any, bias: Any = None, mask: Any = None, *,
                  scale: float | None = None, is_causal: bool = False) -> AttentionSpec:
    """The spec of an attention of 4-D arrays (or `jax.ShapeDtypeStruct`s); no checks."""
    b, t, n, h = (int(d) for d in query.shape)
    s, k = int(key.shape[1]), int(key.shape[2])
    return cls(
        batch=b, q_len=t, kv_len=s, heads=n, kv_heads=k, head_dim=h,
        dtype=np.dtype(query.dtype).name, causal=bool(is_causal),
        scale=float(1.0 / math.sqrt(h) if scale is None else scale),
        bias_shape=None if bias is None else tuple(int(d) for d in bias.shape),
        bias_dtype=None if bias is None else np.dtype(bias.dtype).name,
        mask_shape=None if mask is None else tuple(int(d) for d in mask.shape))

  @property
  def groups(self) -> int:
    """Query heads per key/value head (1: multi-head attention)."""
    return self.heads // self.kv_heads

  @property
  def has_bias(self) -> bool:
    return self.bias_shape is not None

  @property
  def has_mask(self) -> bool:
    return self.mask_shape is not None

  @property
  def mask_kind(self) -> str:
    """``"none"``, ``"bool"``, ``"bias"`` or ``"bias+bool"``."""
    if self.has_bias and self.has_mask:
      return "bias+bool"
    return "bias" if self.has_bias else "bool" if self.has_mask else "none"

  @property
  def q_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.q_len, self.heads, self.head_dim)

  @property
  def kv_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.kv_len, self.kv_heads, self.head_dim)

  @property
  def logits_shape(self) -> tuple[int, int, int, int]:
    """``[batch, heads, q_len, kv_len]``: what a bias or mask broadcasts to."""
    return (self.batch, self.heads, self.q_len, self.kv_len)


def split_operands(operands: tuple[Any, ...], spec: AttentionSpec
                   ) -> tuple[Any, Any, Any, Any, Any]:
  """``(query, key, value, bias or None, mask or None)`` from a kernel's operands.

  Example:
    >>> spec = AttentionSpec(1, 4, 4, 2, 2, 8, "float32", mask_shape=(1, 1, 4, 4))
    >>> split_operands(("q", "k", "v", "m"), spec)
    ('q', 'k', 'v', None, 'm')
  """
  q, k, v, *rest = operands
  bias = rest.pop(0) if spec.has_bias else None
  mask = rest.pop(0) if spec.has_mask else None
  if rest:
    raise TypeError(f"attention kernel: {len(operands)} operands for a spec with mask kind "
                    f"{spec.mask_kind!r}")
  return q, k, v, bias, mask
