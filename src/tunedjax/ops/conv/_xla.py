"""The ``xla`` conv kernel: the equation as written, the default.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x, w = np.ones((1, 4, 4, 2), np.float32), np.ones((3, 3, 2, 5), np.float32)
  >>> spec = ConvSpec.from_arrays(x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> conv_xla(x, w, spec).shape
  (1, 2, 2, 5)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jax import lax

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec


def conv_xla(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """Binds `conv_general_dilated` with the spec's params, unchanged."""
  return lax.conv_general_dilated_p.bind(lhs, rhs, **spec.params())


def applicable(spec: ConvSpec, platform: str) -> bool:
  """Always true: XLA handles every convolution."""
  del spec, platform
  return True


KERNELS = (("xla", conv_xla, applicable),)
