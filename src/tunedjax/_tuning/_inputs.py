"""Random inputs for measuring, and the error measure candidates are checked with.

Every tuner times candidates on random data of the real shapes and dtypes,
never zeros (a kernel that ignores its input must not pass a check).

Example:
  >>> import numpy as np
  >>> x = random_array((2, 3), "float32", np.random.default_rng(0))
  >>> x.dtype, bool(np.all(x != 0))
  (dtype('float32'), True)
  >>> relative_error(x, x)
  0.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def random_array(shape: Sequence[int], dtype: Any, rng: np.random.Generator,
                 *, integers: str = "small") -> np.ndarray:
  """Random data of `shape` and `dtype` as a NumPy array.

  Args:
    shape: the shape.
    dtype: any NumPy or JAX dtype (bfloat16 included).
    rng: the generator.
    integers: ``"small"`` draws integers in [-3, 3]; ``"zeros"`` gives zeros
      (safe as indices, for whole programs whose integer inputs may index).

  Returns:
    Normal floats (complex: normal real and imaginary parts), or integers.
  """
  dtype = np.dtype(dtype)
  shape = tuple(int(d) for d in shape)
  if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
    if integers == "zeros" or dtype == np.bool_:
      return np.zeros(shape, dtype)
    return rng.integers(-3, 4, size=shape).astype(dtype)
  if np.issubdtype(dtype, np.complexfloating):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def random_inputs(avals: Sequence[Any], seed: int = 0) -> list[np.ndarray]:
  """Random inputs for whole programs: normal floats, zero integers (safe as indices).

  Example:
    >>> import jax
    >>> [a.shape for a in random_inputs([jax.ShapeDtypeStruct((2,), "int32")])]
    [(2,)]
  """
  rng = np.random.default_rng(seed)
  return [random_array(a.shape, a.dtype, rng, integers="zeros") for a in avals]


def relative_error(out: Any, ref: Any) -> float:
  """max |out - ref| / max |ref| in float64 (inf for a shape mismatch or NaN).

  Example:
    >>> relative_error(np.array([1.0, 3.0]), np.array([1.0, 2.0]))
    0.5
  """
  out = np.asarray(out, dtype=np.float64)
  ref = np.asarray(ref, dtype=np.float64)
  if out.shape != ref.shape:
    return math.inf
  scale = float(np.max(np.abs(ref))) if ref.size else 0.0
  err = float(np.max(np.abs(out - ref))) if ref.size else 0.0
  if not math.isfinite(err):
    return math.inf
  return err / scale if scale > 0 else err
