"""Layout helpers shared by the conv kernels: to and from channels-last.

Kernels compute in one canonical layout, lhs ``(N, *spatial, C)``, rhs
``(*spatial, I, O)`` and out ``(N, *spatial, C)``, and transpose the
equation's operands into it; XLA folds these transposes into neighbours.

Example:
  >>> import numpy as np
  >>> from tunedjax.autotune._registry import ConvSpec
  >>> x = np.ones((2, 3, 5, 7), np.float32)                  # NCHW
  >>> spec = ConvSpec.from_arrays(x, np.ones((4, 3, 1, 1), np.float32))
  >>> lhs_to_channels_last(x, spec).shape
  (2, 5, 7, 3)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

if TYPE_CHECKING:
  from tunedjax.autotune._registry import ConvSpec


def _maybe_transpose(x: Any, perm: tuple[int, ...]) -> Any:
  if perm == tuple(range(len(perm))):
    return x
  return jnp.transpose(x, perm)


def lhs_to_channels_last(lhs: Any, spec: ConvSpec) -> Any:
  """Transposes the equation's lhs to ``(N, *spatial, C)``."""
  s = spec.dimension_numbers[0]
  return _maybe_transpose(lhs, (s[0], *s[2:], s[1]))


def rhs_to_channels_last(rhs: Any, spec: ConvSpec) -> Any:
  """Transposes the equation's rhs to ``(*spatial, I, O)``."""
  s = spec.dimension_numbers[1]
  return _maybe_transpose(rhs, (*s[2:], s[1], s[0]))


def out_from_channels_last(y: Any, spec: ConvSpec) -> Any:
  """Transposes a ``(N, *spatial, C)`` result to the equation's out layout."""
  s = spec.dimension_numbers[2]
  nsp = len(s) - 2
  perm = [0] * (nsp + 2)
  perm[s[0]] = 0
  perm[s[1]] = nsp + 1
  for i, d in enumerate(s[2:]):
    perm[d] = 1 + i
  return _maybe_transpose(y, tuple(perm))


def lhs_shape_channels_last(spec: ConvSpec) -> tuple[int, ...]:
  """The lhs shape in ``(N, *spatial, C)`` order."""
  s, shape = spec.dimension_numbers[0], spec.lhs_shape
  return (shape[s[0]], *(shape[d] for d in s[2:]), shape[s[1]])


def rhs_shape_channels_last(spec: ConvSpec) -> tuple[int, ...]:
  """The rhs shape in ``(*spatial, I, O)`` order."""
  s, shape = spec.dimension_numbers[1], spec.rhs_shape
  return (*(shape[d] for d in s[2:]), shape[s[1]], shape[s[0]])


def out_shape_channels_last(spec: ConvSpec) -> tuple[int, ...]:
  """The output shape in ``(N, *spatial, C)`` order."""
  s, shape = spec.dimension_numbers[2], spec.out_shape
  return (shape[s[0]], *(shape[d] for d in s[2:]), shape[s[1]])


def out_dtype(spec: ConvSpec) -> Any:
  """The equation's output dtype as a jnp dtype."""
  return jnp.dtype(spec.out_dtype)
