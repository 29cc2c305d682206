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

Drawing is deterministic in the generator's state, and a tuning run draws the
same large operands again and again (every bucket starts from the same seed,
and buckets share shapes), so large draws are remembered (`_Drawn`): the same
state, shape and dtype give the same array, read-only, and leave the
generator where drawing would have.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

# Draws of at least this many bytes are remembered, up to _DRAWN_BYTES in all.
_REMEMBER_BYTES = 1 << 20
_DRAWN_BYTES = 128 << 20


class _Drawn:
  """The last large draws: ``(state, shape, dtype, integers) -> (array, state after)``,
  least recently used first out once they pass `_DRAWN_BYTES`."""

  def __init__(self, limit: int):
    self.limit = limit
    self.entries: collections.OrderedDict[Any, tuple[np.ndarray, Any]] = (
        collections.OrderedDict())
    self.bytes = 0
    self.lock = threading.Lock()

  def get(self, key: Any) -> tuple[np.ndarray, Any] | None:
    with self.lock:
      hit = self.entries.get(key)
      if hit is not None:
        self.entries.move_to_end(key)
      return hit

  def put(self, key: Any, array: np.ndarray, after: Any) -> None:
    with self.lock:
      if key in self.entries or array.nbytes > self.limit:
        return
      self.entries[key] = (array, after)
      self.bytes += array.nbytes
      while self.bytes > self.limit:
        _, (old, _) = self.entries.popitem(last=False)
        self.bytes -= old.nbytes


_drawn = _Drawn(_DRAWN_BYTES)


def _state_key(rng: Any) -> Any:
  """A hashable form of a NumPy generator's state, or None (not remembered)."""
  try:
    state = rng.bit_generator.state
  except AttributeError:
    return None
  return repr(sorted(state.items())) if isinstance(state, dict) else None


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
    An array of 1 MiB or more is read-only: the same draw returns it again.
  """
  dtype = np.dtype(dtype)
  shape = tuple(int(d) for d in shape)
  if math.prod(shape) * dtype.itemsize < _REMEMBER_BYTES:
    return _draw(shape, dtype, rng, integers)
  state = _state_key(rng)
  if state is None:
    return _draw(shape, dtype, rng, integers)
  key = (state, shape, dtype.str, integers)
  hit = _drawn.get(key)
  if hit is not None:
    array, after = hit
    rng.bit_generator.state = after
    return array
  array = _draw(shape, dtype, rng, integers)
  array.setflags(write=False)
  _drawn.put(key, array, rng.bit_generator.state)
  return array


def _draw(shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator,
          integers: str) -> np.ndarray:
  if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
    if integers == "zeros" or dtype == np.bool_:
      return np.zeros(shape, dtype)
    return rng.integers(-3, 4, size=shape).astype(dtype)
  # float32 and float64 are drawn in their own precision (float32: about 3x
  # faster than drawing float64 and rounding, for a tuner's 16 MiB operand).
  if np.issubdtype(dtype, np.complexfloating):
    part = np.float32 if dtype == np.complex64 else np.float64
    return (rng.standard_normal(shape, dtype=part)
            + 1j * rng.standard_normal(shape, dtype=part)).astype(dtype)
  if dtype in (np.float32, np.float64):
    return rng.standard_normal(shape, dtype=dtype)
  return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def random_inputs(avals: Sequence[Any], seed: int = 0) -> list[np.ndarray]:
  """Random inputs for whole programs: normal floats, zero integers (safe as indices).

  Example:
    >>> import jax
    >>> [a.shape for a in random_inputs([jax.ShapeDtypeStruct((2,), "int32")])]
    [(2,)]
  """
  rng = np.random.default_rng(seed)
  return [random_array(a.shape, a.dtype, rng, integers="zeros") for a in avals]


def _narrow_float(x: Any) -> bool:
  """Whether `x` holds real floats of at most 32 bits (bfloat16 and float8 included)."""
  dtype = np.dtype(getattr(x, "dtype", np.float64))
  return dtype.itemsize <= 4 and (np.issubdtype(dtype, np.floating)
                                  or dtype.name.startswith(("bfloat16", "float8")))


def relative_error(out: Any, ref: Any, scale: float | None = None) -> float:
  """max |out - ref| / max |ref| (inf for a shape mismatch or NaN).

  Computed in float32 where both are real floats of at most 32 bits (the
  difference of two close float32 values is exact, and a far one is far
  beyond any tolerance), else in float64. `scale` is ``max |ref|`` where the
  caller knows it already (one reference checked against many outputs).

  Example:
    >>> relative_error(np.array([1.0, 3.0]), np.array([1.0, 2.0]))
    0.5
  """
  wide = np.float32 if _narrow_float(out) and _narrow_float(ref) else np.float64
  out, ref = np.asarray(out), np.asarray(ref)
  if out.shape != ref.shape:
    return math.inf
  scale = max_abs_difference(ref, None, wide) if scale is None else scale
  err = max_abs_difference(out, ref, wide)
  if not math.isfinite(err):
    return math.inf
  return err / scale if scale > 0 else err


# Elements per slice in `max_abs_difference`: a slice's float64 temporaries stay
# in the cache and in memory malloc keeps, where whole-array ones (a tuner's
# outputs reach 4M elements) would each be mapped and faulted afresh.
_SLICE = 1 << 16


def max_abs_difference(a: Any, b: Any | None, dtype: Any = np.float64) -> float:
  """``max |a - b|`` (``max |a|`` with `b` None) computed in `dtype`, slice by
  slice; inf where it is not finite. `a` and `b` have one shape.

  Example:
    >>> max_abs_difference(np.array([1.0, -4.0]), np.array([1.5, -1.0]))
    3.0
    >>> max_abs_difference(np.array([1.0, -4.0]), None)
    4.0
  """
  a = np.ravel(np.asarray(a))
  b = None if b is None else np.ravel(np.asarray(b))
  worst = 0.0
  for i in range(0, a.size, _SLICE):
    part = np.asarray(a[i:i + _SLICE], dtype)
    if b is not None:
      part = part - np.asarray(b[i:i + _SLICE], dtype)
    biggest = float(np.max(np.abs(part)))
    if not math.isfinite(biggest):
      return math.inf
    worst = max(worst, biggest)
  return worst
