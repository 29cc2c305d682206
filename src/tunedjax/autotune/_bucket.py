"""Shape buckets: the cache key under which a convolution's kernel choice is kept.

A bucket key is a plain JSON dict that names everything a timing depends on:
the op, the operand shapes (exact, or rounded up to powers of two with
``kernel.bucket = "pow2"``), the dtypes, every convolution parameter, and the
source hash of every candidate kernel, so that editing a kernel's code makes
its old timings miss. The cache stores the whole key, never a bare hash
(Paddle's hash-only key can return a wrong algorithm on a collision).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tunedjax._config import BUCKETS
from tunedjax._errors import ConfigError, BAD_CHOICE, format_choices

NAMESPACE = "conv"
KEY_VERSION = 1


def _pow2(n: int) -> int:
  """The smallest power of two >= n (n >= 1)."""
  return 1 << max(int(n) - 1, 0).bit_length()


def _dtype_name(dtype: Any) -> str | None:
  if dtype is None:
    return None
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)


def _plain(value: Any) -> Any:
  """Turns tuples, enums, dtypes and numpy scalars into JSON-ready values."""
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value)
  if isinstance(value, enum.Enum):
    return value.name
  if isinstance(value, Mapping):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  if hasattr(value, "lhs_spec"):  # lax.ConvDimensionNumbers
    return [_plain(value.lhs_spec), _plain(value.rhs_spec), _plain(value.out_spec)]
  return str(value)


def bucket_shapes(spec: Any, bucket: str = "exact") -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The (lhs, rhs) shapes that stand for `spec` in its bucket.

  With ``"pow2"`` the batch and spatial dimensions of the input are rounded
  up to powers of two; the channels and the whole kernel shape stay exact
  (they decide which kernels apply), and so does the input's batch
  dimension when ``batch_group_count > 1`` (a weight-gradient convolution,
  whose "batch" is a channel dimension).

  Args:
    spec: a `ConvSpec`.
    bucket: ``"exact"`` or ``"pow2"``.

  Returns:
    ``(lhs_shape, rhs_shape)`` as tuples of ints.

  Example:
    >>> import types
    >>> spec = types.SimpleNamespace(lhs_shape=(3, 30, 30, 8), rhs_shape=(3, 3, 8, 16),
    ...     dimension_numbers=((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)), batch_group_count=1)
    >>> bucket_shapes(spec, "pow2")
    ((4, 32, 32, 8), (3, 3, 8, 16))
  """
  if bucket not in BUCKETS:
    raise ConfigError(BAD_CHOICE.format(key="kernel.bucket",
                                        choices=format_choices(BUCKETS), value=bucket))
  lhs = tuple(int(d) for d in spec.lhs_shape)
  rhs = tuple(int(d) for d in spec.rhs_shape)
  if bucket == "exact":
    return lhs, rhs
  lhs_spec = tuple(_plain(spec.dimension_numbers)[0])
  rounded = list(lhs)
  batch_dim, spatial = lhs_spec[0], lhs_spec[2:]
  dims = list(spatial) + ([batch_dim] if spec.batch_group_count == 1 else [])
  for d in dims:
    rounded[d] = _pow2(rounded[d])
  return tuple(rounded), rhs


def bucket_key(spec: Any, candidates: Iterable[Any], *, bucket: str = "exact",
               op: str = "conv") -> dict[str, Any]:
  """The JSON-serializable cache key of a convolution's shape bucket.

  Args:
    spec: a `ConvSpec` (the equation's shapes, dtypes and parameters).
    candidates: the `Kernel`s that may run it; their names and source hashes
      are part of the key, so a changed kernel re-tunes.
    bucket: ``"exact"`` or ``"pow2"`` (see `bucket_shapes`).
    op: the op name (``"conv"``).

  Returns:
    A dict of plain JSON values, deterministic for equal inputs.

  Example:
    >>> import types
    >>> spec = types.SimpleNamespace(lhs_shape=(2, 8, 8, 4), rhs_shape=(3, 3, 4, 4),
    ...     lhs_dtype="float32", rhs_dtype="float32", out_dtype="float32",
    ...     window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(1, 1),
    ...     rhs_dilation=(1, 1), dimension_numbers=((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
    ...     feature_group_count=1, batch_group_count=1, preferred_element_type=None,
    ...     precision=None)
    >>> xla = types.SimpleNamespace(name="xla", source_hash="abc")
    >>> key = bucket_key(spec, [xla])
    >>> key["lhs_shape"], key["candidates"]
    ([2, 8, 8, 4], {'xla': 'abc'})
  """
  lhs, rhs = bucket_shapes(spec, bucket)
  return {
      "version": KEY_VERSION,
      "op": op,
      "bucket": bucket,
      "lhs_shape": list(lhs),
      "rhs_shape": list(rhs),
      "lhs_dtype": _dtype_name(spec.lhs_dtype),
      "rhs_dtype": _dtype_name(spec.rhs_dtype),
      "out_dtype": _dtype_name(spec.out_dtype),
      "window_strides": _plain(spec.window_strides),
      "padding": _plain(spec.padding),
      "lhs_dilation": _plain(spec.lhs_dilation),
      "rhs_dilation": _plain(spec.rhs_dilation),
      "dimension_numbers": _plain(spec.dimension_numbers),
      "feature_group_count": int(spec.feature_group_count),
      "batch_group_count": int(spec.batch_group_count),
      "preferred_element_type": _dtype_name(spec.preferred_element_type),
      "precision": _plain(spec.precision),
      "candidates": {k.name: str(k.source_hash)
                     for k in sorted(candidates, key=lambda k: k.name)},
  }


def describe(key: Mapping[str, Any]) -> str:
  """A short human-readable name of a bucket, for logs and reports.

  Example:
    >>> describe({"lhs_shape": [8, 56, 56, 128], "rhs_shape": [3, 3, 1, 128],
    ...           "lhs_dtype": "float32", "window_strides": [1, 1],
    ...           "feature_group_count": 128, "batch_group_count": 1})
    'conv 8x56x56x128 * 3x3x1x128 float32 s1x1 fg128'
  """
  parts = [
      f"{key.get('op', 'conv')} " + "x".join(map(str, key["lhs_shape"])),
      "* " + "x".join(map(str, key["rhs_shape"])),
      str(key["lhs_dtype"]),
      "s" + "x".join(map(str, key["window_strides"])),
  ]
  if key.get("lhs_dilation") and any(d != 1 for d in key["lhs_dilation"]):
    parts.append("ld" + "x".join(map(str, key["lhs_dilation"])))
  if key.get("feature_group_count", 1) != 1:
    parts.append(f"fg{key['feature_group_count']}")
  if key.get("batch_group_count", 1) != 1:
    parts.append(f"bg{key['batch_group_count']}")
  return " ".join(parts)
