"""`LayerNormSpec`: what one layer-norm site is (the ``"layer_norm"`` family's spec).

Example:
  >>> import numpy as np
  >>> spec = LayerNormSpec.from_arrays(np.ones((2, 128, 64), np.float32), epsilon=1e-6)
  >>> spec.shape, spec.dtype, spec.rows, spec.features
  ((2, 128, 64), 'float32', 256, 64)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class LayerNormSpec:
  """One layer norm over the last axis: each row normalised by its own statistics.

  Attributes:
    shape: the input's shape (the normalised features last).
    dtype: the input's dtype name (``"float32"``).
    epsilon: added to each row's variance before the reciprocal square root.
  """

  shape: tuple[int, ...]
  dtype: str
  epsilon: float = 1e-6

  @classmethod
  def from_arrays(cls, x: Any, *, epsilon: float = 1e-6) -> LayerNormSpec:
    """The spec of a layer norm of `x` (an array or `jax.ShapeDtypeStruct`)."""
    return cls(tuple(int(d) for d in x.shape), np.dtype(x.dtype).name, float(epsilon))

  @property
  def features(self) -> int:
    """How many values each row's statistics are taken over (the last axis)."""
    return self.shape[-1]

  @property
  def rows(self) -> int:
    """How many rows are normalised, each on its own (every axis but the last)."""
    return math.prod(self.shape[:-1])
