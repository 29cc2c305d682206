"""`BatchNormSpec`: what one batch-norm site is (the ``"batch_norm"`` family's spec).

Example:
  >>> import numpy as np
  >>> spec = BatchNormSpec.from_arrays(np.ones((8, 4, 4, 16), np.float32), epsilon=1e-3)
  >>> spec.shape, spec.dtype, spec.rows, spec.channels
  ((8, 4, 4, 16), 'float32', 128, 16)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class BatchNormSpec:
  """One batch norm on batch statistics over every axis but the last.

  Attributes:
    shape: the input's shape (channels last).
    dtype: the input's dtype name (``"float32"``).
    epsilon: added to the variance before the reciprocal square root.
  """

  shape: tuple[int, ...]
  dtype: str
  epsilon: float = 1e-5

  @classmethod
  def from_arrays(cls, x: Any, *, epsilon: float = 1e-5) -> BatchNormSpec:
    """The spec of a batch norm of `x` (an array or `jax.ShapeDtypeStruct`)."""
    return cls(tuple(int(d) for d in x.shape), np.dtype(x.dtype).name, float(epsilon))

  @property
  def channels(self) -> int:
    return self.shape[-1]

  @property
  def rows(self) -> int:
    """How many values each channel's statistics are taken over."""
    return math.prod(self.shape[:-1])
