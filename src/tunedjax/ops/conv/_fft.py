"""The ``fft`` conv kernel: large kernels as products in the frequency domain.

The padded input and the kernel go through a real FFT over the spatial dims,
are multiplied and summed over input channels per frequency, and come back
through the inverse FFT; the valid part of the circular correlation is the
convolution. Work grows with the image, not the kernel, which is why it wins
for 15x15 and 31x31 kernels (and for the weight gradient of any large
kernel, where the "kernel" is the output gradient). Handles any dimension
numbers and padding (negative too), for stride 1, no lhs or rhs dilation,
no feature or batch groups, one floating dtype, and kernels of at least 25
taps. It computes in float32 (float64 for float64 inputs).

Example:
  >>> import numpy as np
  >>> from jax import lax
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x = np.random.default_rng(0).normal(size=(1, 2, 12, 12)).astype(np.float32)
  >>> w = np.random.default_rng(1).normal(size=(3, 2, 5, 5)).astype(np.float32)
  >>> spec = ConvSpec.from_arrays(x, w, padding="SAME")
  >>> ref = lax.conv_general_dilated(x, w, (1, 1), "SAME")
  >>> bool(np.allclose(conv_fft(x, w, spec), ref, atol=1e-4))
  True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from tunedjax.ops.conv import _layout as layout

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec

FFT_MIN_TAPS = 25


def _fast_length(n: int) -> int:
  """The smallest 2^a 3^b 5^c >= n (FFTs of such lengths are fastest)."""
  best = 1
  while best < n:
    best *= 2
  p5 = 1
  while p5 < 2 * n:
    p35 = p5
    while p35 < 2 * n:
      p = p35
      while p < n:
        p *= 2
      best = min(best, p)
      p35 *= 3
    p5 *= 5
  return best


def conv_fft(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A stride-1 convolution through rfftn / irfftn over the spatial dims."""
  with layout.kernel_scope("fft"):
    return _conv_fft(lhs, rhs, spec)


def _conv_fft(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  compute = jnp.promote_types(jnp.dtype(spec.lhs_dtype), jnp.float32)
  x = layout.lhs_to_channels_first(lhs, spec).astype(compute)
  x = layout.pad_spatial(x, spec, 2)
  w = layout.rhs_to_channels_first(rhs, spec).astype(compute)
  nsp = spec.num_spatial
  axes = tuple(range(2, 2 + nsp))
  padded = x.shape[2:]
  ks = w.shape[2:]
  lengths = tuple(_fast_length(p) for p in padded)
  # Correlation = convolution with the kernel flipped.
  w = jnp.flip(w, axes)
  fx = jnp.fft.rfftn(x, s=lengths, axes=axes)
  fw = jnp.fft.rfftn(w, s=lengths, axes=axes)
  letters = "abcdefgh"[:nsp]
  fy = jnp.einsum(f"nc{letters},oc{letters}->no{letters}", fx, fw)
  y = jnp.fft.irfftn(fy, s=lengths, axes=axes)
  index = (slice(None), slice(None)) + tuple(
      slice(k - 1, p) for k, p in zip(ks, padded))
  y = y[index].astype(layout.out_dtype(spec))
  return layout.out_from_channels_first(y, spec)


def applicable(spec: ConvSpec, platform: str) -> bool:
  """Stride 1, no dilation, no groups, one float dtype, >= 25 kernel taps."""
  del platform
  return (layout.is_float(spec)
          and all(s == 1 for s in spec.window_strides)
          and all(d == 1 for d in spec.lhs_dilation)
          and all(d == 1 for d in spec.rhs_dilation)
          and spec.feature_group_count == 1
          and spec.batch_group_count == 1
          and layout.window_count(spec) >= FFT_MIN_TAPS)


KERNELS = (("fft", conv_fft, applicable),)
