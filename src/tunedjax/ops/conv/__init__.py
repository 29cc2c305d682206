"""The ``"conv"`` op family: every `conv_general_dilated` equation is a site.

Its kernels: ``xla`` (the reference), ``matmul_1x1``, ``im2col``,
``window_matmul``, ``fft``, ``depthwise``, ``pallas`` and, on CPU where a C++
compiler builds them (``csrc/``), ``depthwise_native``, ``direct_native`` and
``matmul_1x1_native``. Importing this package registers them.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.conv import ConvSpec
  >>> spec = ConvSpec.from_arrays(np.ones((2, 4, 8, 8), np.float32),
  ...                             np.ones((4, 4, 3, 3), np.float32), padding="SAME")
  >>> spec.feature_group_count
  1
"""

from tunedjax.ops.conv import _family
from tunedjax.ops.conv._spec import ConvSpec as ConvSpec

_family.register()

__all__ = ["ConvSpec"]
