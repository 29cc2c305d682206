"""The prior: which activation layout convolutions should run in.

`preferred(dtype, platform)` is the table the layout pass starts from when it
is not told a layout (``target="auto"``) and does not measure. Each entry says
where it comes from:

* **CPU, every dtype: NHWC.** XLA:CPU runs convolutions channels-last (its
  Eigen/oneDNN kernels take ``(N, *spatial, C)`` inputs and ``(*spatial, I, O)``
  kernels) and rewrites an NCHW convolution into that form with transposes
  around it. Measured on this project's CPU (jax 0.10.2): NCHW convolutions ran
  at 0.48-0.94x the speed of NHWC ones in float32 (1x1: 0.48x, 7x7 stem:
  0.56x), and likewise in bfloat16.
* **GPU, float16 / bfloat16 / int8: NHWC.** Tensor Core convolutions in cuDNN
  want channels-last; XLA:GPU itself picks NHWC for these dtypes.
* **GPU, float32 (and float64): NCHW.** Without Tensor Cores cuDNN's NCHW
  kernels are at least as fast (PaddlePaddle's layout autotune keeps NCHW for
  float32). This is a prior, not a measurement, and it predates TF32 Tensor
  Cores.

On a GPU the layout pass does not apply these entries: XLA:GPU assigns every
convolution's physical layout itself (``layout_assignment.cc``), so with
``target="auto"`` the pass keeps the user's layout, NHWC or NCHW, unless
``mode="measure"`` timed the other one on that GPU (`optimize`).
* **TPU, every dtype: NHWC.** The TPU convolution unit puts the feature
  dimension on the minor (lane) axis.

Example:
  >>> import jax.numpy as jnp
  >>> preferred(jnp.float32, "cpu"), preferred(jnp.float32, "gpu")
  ('NHWC', 'NCHW')
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tunedjax import _errors
from tunedjax._tuning import PLATFORMS as PLATFORMS
from tunedjax._tuning import canonical_platform as canonical_platform

LAYOUTS = ("NHWC", "NCHW")
_HALF = frozenset({"float16", "bfloat16", "int8", "uint8", "float8_e4m3fn", "float8_e5m2"})


def preferred(dtype: Any, platform: str) -> str:
  """Returns the layout convolutions of `dtype` should run in on `platform`.

  Args:
    dtype: the convolution's input dtype (anything `numpy.dtype` accepts,
      including ``jnp.bfloat16``).
    platform: ``"cpu"``, ``"gpu"`` (or ``"cuda"``/``"rocm"``) or ``"tpu"``.

  Returns:
    ``"NHWC"`` (channels last) or ``"NCHW"`` (channels first); see the module
    docstring for where each entry comes from.

  Example:
    >>> import jax.numpy as jnp
    >>> preferred(jnp.bfloat16, "gpu"), preferred("float32", "tpu")
    ('NHWC', 'NHWC')
  """
  name = np.dtype(dtype).name
  platform = canonical_platform(platform)
  if platform == "gpu":
    return "NHWC" if name in _HALF else "NCHW"
  return "NHWC"


def check_target(target: str) -> str:
  """Validates a ``target`` option: ``"auto"``, ``"NHWC"`` or ``"NCHW"`` (any case)."""
  choices = ("auto", *LAYOUTS)
  if isinstance(target, str):
    for choice in choices:
      if target.lower() == choice.lower():
        return choice
  raise _errors.LayoutError(
      f"layout target must be one of {_errors.format_choices(choices)}, got {target!r}"
      f"{_errors.did_you_mean(str(target), choices)}.")
