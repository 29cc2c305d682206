"""Axes by label: an attention operand brought to the family's layout, and back.

The attention pattern labels each axis of a matched operand (batch, heads,
query or key tokens, head dim); `to_layout` reorders and reshapes an array to
a given order of labels. It works on jax and NumPy arrays alike (a constant
mask is laid out at trace time with NumPy).

Example:
  >>> import numpy as np
  >>> to_layout(np.zeros((2, 3)), {0: "k", 1: "q"}, ["q", "k"]).shape
  (3, 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def to_layout(x: Any, labels: dict[int, Any], order: Sequence[Any]) -> Any:
  """`x` (axes labelled by `labels`) with its axes in `order`, size 1 where a label of
  `order` is absent (works on jax and NumPy arrays)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  extra = [a for a, lab in sorted(labels.items()) if lab not in order]
  if extra:  # axes of size 1 the family's layout does not have (a squeezed batch axis)
    kept = [a for a in range(np.ndim(x)) if a not in extra]
    x = x.reshape([x.shape[a] for a in kept])
    labels = {j: labels[a] for j, a in enumerate(kept)}
  axis_of = {lab: a for a, lab in labels.items()}
  present = [lab for lab in order if lab in axis_of]
  perm = [axis_of[lab] for lab in present]
  if perm != sorted(perm) or len(perm) != np.ndim(x):
    x = (np.transpose if isinstance(x, np.ndarray) else jnp.transpose)(x, perm)
  shape = [x.shape[present.index(lab)] if lab in axis_of else 1 for lab in order]
  return x.reshape(shape) if tuple(shape) != tuple(x.shape) else x
