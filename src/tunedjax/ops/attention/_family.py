"""The built-in ``"attention"`` op family: scaled dot-product attention, chosen per bucket.

A call-site family: `tunedjax.attention` builds an `AttentionSpec` and calls
`autotune.dispatch` while it is traced, so that a kernel's own backward (a
blocked attention recomputes its scores per block) is in place before
`jax.grad` runs. Outside kernel selection the reference, ``xla``
(`jax.nn.dot_product_attention(implementation="xla")`), runs; under
`tunedjax.jit` with kernel selection on, the bucket's measured winner among
the kernels of `_attn_kernels`, each checked against ``xla`` on random
operands first, timed forward and backward together.

A bucket's key is the batch, the query and key/value lengths (with
``kernel.bucket = "pow2"`` the batch and lengths rounded up to powers of two),
the heads and key/value heads (so the grouped-query ratio), the head
dimension, the dtype, the mask kind with the axes the bias and mask vary
along, and causality; the platform is in the cache's device fingerprint.

Example:
  >>> spec = AttentionSpec(1, 1000, 1000, 8, 2, 64, "float32", causal=True)
  >>> key = attention_key(spec, "pow2")
  >>> key["q_len"], key["kv_len"], key["kv_heads"], key["mask"]
  (1024, 1024, 2, 'none')
  >>> describe_attention(key)
  'attention 1x1024x1024 h8/2 d64 float32 causal'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunedjax._config import BUCKETS
from tunedjax._errors import BAD_CHOICE, ConfigError, format_choices
from tunedjax._tuning import random_array
from tunedjax import autotune
from tunedjax.autotune import _registry
from tunedjax.ops.attention import _kernels as _attn_kernels
from tunedjax.ops.attention import _native_flash
from tunedjax.ops.attention import _pattern as _attn_pattern
from tunedjax.ops.attention._spec import AttentionSpec
from tunedjax.autotune._bucket import pow2

NAME = "attention"

# Relative error allowed against the reference, over the output and every gradient.
_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


def attention_tolerance(dtype: Any, platform: str = "cpu") -> float:
  """The largest relative difference from ``xla`` an attention kernel may show.

  Example:
    >>> attention_tolerance("float32"), attention_tolerance("bfloat16")
    (0.0001, 0.05)
  """
  return _registry.tolerance_from(_TOLERANCE, dtype, platform)


def _axes(shape: tuple[int, ...] | None) -> str | None:
  """The axes a bias or mask varies along: ``"b.ts"`` for ``[B, 1, T, S]``."""
  if shape is None:
    return None
  return "".join(c if d != 1 else "." for c, d in zip("bnts", shape))


def attention_key(spec: AttentionSpec, bucket: str = "exact") -> dict[str, Any]:
  """What an attention's timing depends on (lengths and batch rounded up with "pow2").

  Example:
    >>> attention_key(AttentionSpec(3, 300, 300, 4, 4, 32, "bfloat16"), "pow2")["batch"]
    4
  """
  if bucket not in BUCKETS:
    raise ConfigError(BAD_CHOICE.format(key="kernel.bucket",
                                        choices=format_choices(BUCKETS), value=bucket))
  r = pow2 if bucket == "pow2" else int
  return {
      "batch": r(spec.batch), "q_len": r(spec.q_len), "kv_len": r(spec.kv_len),
      "heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
      "dtype": spec.dtype, "mask": spec.mask_kind, "bias_axes": _axes(spec.bias_shape),
      "bias_dtype": spec.bias_dtype, "mask_axes": _axes(spec.mask_shape),
      "causal": spec.causal,
  }


def attention_features(key: Mapping[str, Any]) -> dict[str, float]:
  """Numbers that describe an attention bucket, for predicting its kernels'
  times: sizes on a log2 scale, and flags (weight 3) for a causal mask, a
  mask or bias operand and grouped-query heads.

  Example:
    >>> f = attention_features({"batch": 2, "q_len": 1024, "kv_len": 1024, "heads": 8,
    ...                         "kv_heads": 2, "head_dim": 64, "dtype": "float32",
    ...                         "mask": None, "causal": True})
    >>> f["q_len"], f["causal"], f["grouped"]
    (10.0, 3.0, 3.0)
  """
  log2 = lambda n: math.log2(max(int(n), 1))  # pylint: disable=unnecessary-lambda-assignment
  flag = lambda b: 3.0 if b else 0.0  # pylint: disable=unnecessary-lambda-assignment
  return {
      "batch": log2(key["batch"]), "q_len": log2(key["q_len"]), "kv_len": log2(key["kv_len"]),
      "heads": log2(key["heads"]), "head_dim": log2(key["head_dim"]),
      "grouped": flag(key["kv_heads"] != key["heads"]), "causal": flag(key.get("causal")),
      "masked": flag(key.get("mask") or key.get("mask_axes")),
      "biased": flag(key.get("bias_axes")),
      "itemsize": 2.0 * math.log2(np.dtype(key["dtype"]).itemsize),
  }


def describe_attention(key: Mapping[str, Any]) -> str:
  """A bucket's short name.

  Example:
    >>> describe_attention({"batch": 2, "q_len": 128, "kv_len": 256, "heads": 8,
    ...                     "kv_heads": 8, "head_dim": 64, "dtype": "bfloat16",
    ...                     "mask": "bool", "mask_axes": "b..s", "causal": False})
    'attention 2x128x256 h8/8 d64 bfloat16 bool(b..s)'
  """
  parts = [f"{NAME} {key['batch']}x{key['q_len']}x{key['kv_len']}",
           f"h{key['heads']}/{key['kv_heads']}", f"d{key['head_dim']}", key["dtype"]]
  if key.get("bias_axes"):
    parts.append(f"bias({key['bias_axes']})")
  if key.get("mask_axes"):
    parts.append(f"bool({key['mask_axes']})")
  if key.get("causal"):
    parts.append("causal")
  return " ".join(parts)


def attention_operands(spec: AttentionSpec, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
  """Random query, key, value, bias and mask of the spec's shapes; never zeros.

  The mask keeps about 80% of the entries and always the first key, so no
  row is fully masked (a kernel must still match the reference on those:
  the tests check them).
  """
  ops = [random_array(spec.q_shape, spec.dtype, rng),
         random_array(spec.kv_shape, spec.dtype, rng),
         random_array(spec.kv_shape, spec.dtype, rng)]
  if spec.has_bias:
    ops.append(random_array(spec.bias_shape, spec.bias_dtype, rng))
  if spec.has_mask:
    mask = rng.random(spec.mask_shape) < 0.8
    mask[..., 0] = True
    ops.append(mask)
  return tuple(ops)


# Each kernel's time over xla's as presumed on a platform that has measured
# nothing near a bucket (no entries in its device's cache, no priors for its
# machine class). On a GPU, cuDNN's fused flash attention comes first for
# float16/bfloat16 attention that is causal or has no mask and no bias: the one
# GPU measurement there is (an H100, 2026-11-27, bfloat16 causal [8, 2048, 16,
# 128] forward and backward: 1.92 ms, against 7.61 ms for the attention written
# out under jax.jit) puts it near a quarter of xla's time. Every other kernel is
# then presumed no faster than xla, so xla and cudnn alone are compiled until the
# GPU's own measurements or priors say otherwise. Elsewhere the rule says
# nothing: every applicable kernel is a candidate.
PRESUMED = {"gpu": {"first": "cudnn", "ratio": 0.25, "others": 1.0,
                    "dtypes": ("float16", "bfloat16")}}


def attention_presumed(key: Mapping[str, Any], platform: str) -> dict[str, float]:
  """The family's rule for a platform with nothing measured near a bucket (`PRESUMED`).

  Example:
    >>> key = {"dtype": "bfloat16", "causal": True, "mask": "none",
    ...        "candidates": {"xla": "", "cudnn": "", "pallas_gpu": ""}}
    >>> attention_presumed(key, "gpu")
    {'cudnn': 0.25, 'pallas_gpu': 1.0}
    >>> attention_presumed({**key, "dtype": "float32"}, "gpu"), attention_presumed(key, "cpu")
    ({}, {})
  """
  rule = PRESUMED.get(platform)
  names = [n for n in key.get("candidates", {}) if n != "xla"]
  if (rule is None or rule["first"] not in names or key.get("dtype") not in rule["dtypes"]
      or not (key.get("causal") or key.get("mask") == "none")):
    return {}
  return {n: rule["ratio"] if n == rule["first"] else rule["others"] for n in names}


FAMILY = autotune.OpFamily(
    name=NAME, spec_type=AttentionSpec, key=attention_key, operands=attention_operands,
    default="xla", tolerance=attention_tolerance, describe=describe_attention,
    timed="forward+backward",  # blocked kernels differ most in their backward
    features=attention_features, presumed=attention_presumed,
    patterns=(_attn_pattern.attention_sites,),  # attention written out in primitives
    # The accuracy reference: the formula written out computes its softmax in the
    # operands' dtype (float64 there); jax.nn's takes it in float32 whatever they are.
    precise=_attn_kernels.einsum)


def register() -> None:
  """Registers the family and its kernels, in order (xla first; C++ on CPU last)."""
  autotune.register_op_family(FAMILY, replace=True)
  for name, fn, applicable in (*_attn_kernels.KERNELS, *_native_flash.KERNELS):
    autotune.register_kernel(NAME, name, fn, applicable=applicable, replace=True)
