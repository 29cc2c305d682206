"""Conv kernels built on matrix multiplies: ``matmul_1x1``, ``im2col``, ``window_matmul``.

``matmul_1x1`` handles kernels whose every spatial size is 1: the convolution
is then a (grouped) matrix product over channels, after padding, lhs dilation
and strides are applied to the input by `lax.pad` and a strided slice.
``im2col`` gathers the input values every kernel tap meets with one gather
whose indices are fixed at trace time (not `lax.conv_general_dilated_patches`,
whose backward crashes XLA:CPU at 15x15) and multiplies once. Both handle any dimension
numbers (transposed to channels-last), padding (negative too), strides, lhs
and rhs dilation and feature groups, for operands of one floating dtype;
neither handles ``batch_group_count > 1``. ``im2col`` is limited to kernels
of 2 to 49 taps whose patch matrix fits in 256 MiB.

``window_matmul`` turns im2col around for convolutions with few output
positions and a large window: each output position's whole window (a strided
slice of the input) is multiplied by the whole kernel, one matrix product per
position. That is the shape of a weight gradient (the "kernel" is the output
gradient, as large as the image; the output is the few taps of the weights),
which XLA:CPU runs as a slow direct convolution: a 3x3 weight gradient at
32x32x32, batch 128, 512 ms with ``xla``, 107 ms with ``fft``.

Example:
  >>> import numpy as np
  >>> from jax import lax
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x = np.random.default_rng(0).normal(size=(2, 6, 6, 4)).astype(np.float32)
  >>> w = np.random.default_rng(1).normal(size=(3, 3, 4, 5)).astype(np.float32)
  >>> spec = ConvSpec.from_arrays(x, w, padding="SAME",
  ...                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> ref = lax.conv_general_dilated(x, w, (1, 1), "SAME",
  ...                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> bool(np.allclose(conv_im2col(x, w, spec), ref, atol=1e-4))
  True
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunedjax.ops.conv import _layout as layout

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec

IM2COL_MAX_TAPS = 49
IM2COL_MAX_BYTES = 256 * 2**20
# window_matmul: one matrix product per output position, so few positions.
WINDOW_MAX_OUTPUTS = 16


def _grouped_matmul(patches: Any, w: Any, groups: int, spec: ConvSpec) -> Any:
  """``(M, K, C) x (K, C/G, O) -> (M, O)`` with feature groups G."""
  m, k, c = patches.shape
  o = w.shape[-1]
  precision = spec.params()["precision"]
  acc = layout.accumulation_dtype(spec)
  if groups == 1:
    return lax.dot_general(
        patches.reshape(m, k * c), w.reshape(k * c, o),
        (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=acc)
  cg, og = c // groups, o // groups
  lhs = patches.reshape(m, k, groups, cg).transpose(2, 0, 1, 3)
  lhs = lhs.reshape(groups, m, k * cg)
  rhs = w.reshape(k, cg, groups, og).transpose(2, 0, 1, 3)
  rhs = rhs.reshape(groups, k * cg, og)
  y = lax.dot_general(lhs, rhs, (((2,), (1,)), ((0,), (0,))),
                      precision=precision, preferred_element_type=acc)
  return y.transpose(1, 0, 2).reshape(m, o)


def _patch_index(padded: tuple[int, ...], out_spatial: tuple[int, ...],
                 taps: list[tuple[int, ...]], spec: ConvSpec) -> np.ndarray:
  """``[*out_spatial, taps]`` flat positions of the padded input each tap meets.

  Position ``(o, t)`` is where output position ``o`` reads kernel tap ``t``
  (strides and rhs dilation applied): the strided slices `window_slice`
  takes, computed on an index grid instead of the values.
  """
  grid = np.arange(math.prod(padded)).reshape(padded)
  columns = []
  for tap in taps:
    window = tuple(slice(k * rd, k * rd + (o - 1) * ws + 1, ws) for k, rd, ws, o in
                   zip(tap, spec.rhs_dilation, spec.window_strides, out_spatial))
    columns.append(grid[window])
  return np.stack(columns, -1).astype(np.int32)


def _conv_by_taps(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  x = layout.lhs_to_channels_last(lhs, spec)
  w = layout.rhs_to_channels_last(rhs, spec)
  if jax.default_backend() == "cpu":
    # XLA:CPU multiplies bfloat16/float16 slowly; float32 operands give the
    # same float32-accumulated result (7x7x512 bf16: 0.74x -> 1.27x of XLA).
    acc = layout.accumulation_dtype(spec)
    x, w = x.astype(acc), w.astype(acc)
  x = layout.pad_spatial(x, spec, 1)
  out_cl = layout.out_shape_channels_last(spec)
  out_spatial = out_cl[1:-1]
  taps = list(itertools.product(*(range(k) for k in w.shape[:-2])))
  m = math.prod(out_cl[:-1])
  if len(taps) == 1:
    patches = layout.window_slice(x, taps[0], out_spatial, spec)
  else:
    # One gather of every tap's positions (indices fixed at trace time) rather
    # than a strided slice per tap and a stack: the same values and run time,
    # about 6x less XLA compile time (a ResNet-18 step's ten im2col sites
    # compiled in 1.2-1.7 s more than xla's; with the gather, as fast as xla's).
    n, c = x.shape[0], x.shape[-1]
    index = _patch_index(x.shape[1:-1], out_spatial, taps, spec)
    patches = jnp.asarray(x).reshape(n, -1, c).at[:, index].get(mode="promise_in_bounds")
  patches = patches.reshape(m, len(taps), x.shape[-1])
  y = _grouped_matmul(patches, w, spec.feature_group_count, spec)
  y = y.reshape(out_cl).astype(layout.out_dtype(spec))
  return layout.out_from_channels_last(y, spec)


def conv_matmul_1x1(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A 1x1 convolution as a (grouped) matrix product over channels."""
  with layout.kernel_scope("matmul_1x1"):
    return _conv_by_taps(lhs, rhs, spec)


def conv_im2col(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A convolution as one gather of every tap's inputs times the reshaped kernel."""
  with layout.kernel_scope("im2col"):
    return _conv_by_taps(lhs, rhs, spec)


def conv_window_matmul(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A convolution as one matrix product per output position (few outputs).

  Works in the operands' own layouts: each position's window is a strided
  slice of the padded lhs, contracted with the whole rhs over channels and
  window by one `lax.dot_general`, so nothing as large as the input is
  transposed.
  """
  with layout.kernel_scope("window_matmul"):
    return _window_matmul(lhs, rhs, spec)


def _window_matmul(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  lhs_spec, rhs_spec, _ = spec.dimension_numbers
  if jax.default_backend() == "cpu":
    acc = layout.accumulation_dtype(spec)
    lhs, rhs = lhs.astype(acc), rhs.astype(acc)
  config = [(0, 0, 0)] * lhs.ndim
  for d, (lo, hi), dil in zip(lhs_spec[2:], spec.padding, spec.lhs_dilation):
    config[d] = (lo, hi, dil - 1)
  if any(c != (0, 0, 0) for c in config):
    lhs = lax.pad(lhs, jnp.zeros((), lhs.dtype), config)
  window = [rhs.shape[d] for d in rhs_spec[2:]]
  out_cl = layout.out_shape_channels_last(spec)
  contract = ((lhs_spec[1], *lhs_spec[2:]), (rhs_spec[1], *rhs_spec[2:]))
  precision = spec.params()["precision"]
  rows = []
  for position in itertools.product(*(range(o) for o in out_cl[1:-1])):
    start, limit, strides = [0] * lhs.ndim, list(lhs.shape), [1] * lhs.ndim
    for d, p, ws, rd, k in zip(lhs_spec[2:], position, spec.window_strides,
                               spec.rhs_dilation, window):
      start[d], limit[d], strides[d] = p * ws, p * ws + (k - 1) * rd + 1, rd
    patch = lax.slice(lhs, start, limit, strides)
    rows.append(lax.dot_general(patch, rhs, (contract, ((), ())), precision=precision,
                                preferred_element_type=layout.accumulation_dtype(spec)))
  y = jnp.stack(rows, axis=1).reshape(out_cl).astype(layout.out_dtype(spec))  # (N, P, O)
  return layout.out_from_channels_last(y, spec)


def _common(spec: ConvSpec) -> bool:
  return spec.batch_group_count == 1 and layout.is_float(spec)


def applicable_1x1(spec: ConvSpec, platform: str) -> bool:
  """Every kernel spatial size is 1; no batch groups; one float dtype."""
  del platform
  return _common(spec) and layout.window_count(spec) == 1


def applicable_im2col(spec: ConvSpec, platform: str) -> bool:
  """2 to 49 kernel taps, patches within 256 MiB, over one channel per group;
  no batch groups.

  One input channel per group (a depthwise convolution) makes each group's
  product a ``taps``-long dot: never faster than xla or ``depthwise``, so it is
  not worth compiling and timing.
  """
  del platform
  taps = layout.window_count(spec)
  if not _common(spec) or not 1 < taps <= IM2COL_MAX_TAPS:
    return False
  if layout.rhs_shape_channels_last(spec)[-2] == 1:  # in-channels per group
    return False
  out_cl = layout.out_shape_channels_last(spec)
  c = layout.lhs_shape_channels_last(spec)[-1]
  nbytes = (math.prod(out_cl[:-1]) * taps * c
            * jnp.dtype(spec.lhs_dtype).itemsize)
  return nbytes <= IM2COL_MAX_BYTES


def applicable_window_matmul(spec: ConvSpec, platform: str) -> bool:
  """At most 16 output positions, a window of over 49 taps; no groups."""
  del platform
  positions = math.prod(layout.out_shape_channels_last(spec)[1:-1])
  return (_common(spec) and spec.feature_group_count == 1
          and 1 <= positions <= WINDOW_MAX_OUTPUTS
          and layout.window_count(spec) > IM2COL_MAX_TAPS)


KERNELS = (
    ("matmul_1x1", conv_matmul_1x1, applicable_1x1),
    ("im2col", conv_im2col, applicable_im2col),
    ("window_matmul", conv_window_matmul, applicable_window_matmul),
)
