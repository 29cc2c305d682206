"""The ``depthwise`` conv kernel: shift-and-add for one kernel per channel.

A depthwise layer takes two forms in a train step, and this kernel handles
both, with any dimension numbers, padding (negative too), strides, lhs and rhs
dilation and one floating dtype:

* the *channel form*, ``feature_group_count == C_in`` with one input channel
  per group and ``C_out == C_in``: the forward conv, and also the input
  gradient (which carries ``lhs_dilation`` when the forward was strided).
  Output = sum over kernel taps of a strided slice of the padded input times
  that tap's per-channel weights; up to 81 taps.
* the *weight-gradient form*, ``batch_group_count == G > 1`` with lhs batch
  ``G`` and ``G`` output features (lhs batch and out features are the
  channels): XLA:CPU computes this as a dense ``G x G`` convolution, ``G``
  times the needed work. Output position ``p`` = sum over batch and space of
  the input shifted by ``p`` times the output gradient; up to 81 output
  positions (the kernel's taps).

Sums accumulate in float32 (or preferred_element_type) and are cast to the
equation's output dtype.

Example:
  >>> import numpy as np
  >>> from jax import lax
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x = np.random.default_rng(0).normal(size=(2, 8, 8, 4)).astype(np.float32)
  >>> w = np.random.default_rng(1).normal(size=(3, 3, 1, 4)).astype(np.float32)
  >>> kw = dict(window_strides=(2, 2), padding="SAME", feature_group_count=4,
  ...           dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> spec = ConvSpec.from_arrays(x, w, **kw)
  >>> ref = lax.conv_general_dilated(x, w, **kw)
  >>> bool(np.allclose(conv_depthwise(x, w, spec), ref, atol=1e-5))
  True
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from tunedjax.ops.conv import _layout as layout

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec

MAX_TAPS = 81


def _channel_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  acc = layout.accumulation_dtype(spec)
  x = layout.lhs_to_channels_last(lhs, spec).astype(acc)
  x = layout.pad_spatial(x, spec, 1)
  w = layout.rhs_to_channels_last(rhs, spec).astype(acc)  # (*K, 1, C)
  w = w.reshape(*w.shape[:-2], w.shape[-1])
  out_spatial = layout.out_shape_channels_last(spec)[1:-1]
  y = None
  for tap in itertools.product(*(range(k) for k in w.shape[:-1])):
    term = layout.window_slice(x, tap, out_spatial, spec) * w[tap]
    y = term if y is None else y + term
  return layout.out_from_channels_last(y.astype(layout.out_dtype(spec)), spec)


def _weight_grad_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  acc = layout.accumulation_dtype(spec)
  nsp = spec.num_spatial
  # Both operands as (I, *spatial, G): for the weight gradient of an NHWC
  # depthwise conv that is the layout they already have (I = batch, G = C).
  ls, rs = spec.dimension_numbers[:2]
  x = layout.maybe_transpose(lhs, (ls[1], *ls[2:], ls[0])).astype(acc)
  x = layout.pad_spatial(x, spec, 1)
  g = layout.maybe_transpose(rhs, (rs[1], *rs[2:], rs[0])).astype(acc)
  ks = g.shape[1:-1]
  out_cl = layout.out_shape_channels_last(spec)  # (1, *P, G)
  # One scan step per output position: an unrolled loop of reductions that
  # share an input fuses badly on XLA:CPU (measured 4x slower).
  starts = np.array(
      [[pi * ws for pi, ws in zip(p, spec.window_strides)]
       for p in itertools.product(*(range(n) for n in out_cl[1:-1]))],
      np.int32)
  sizes = [(k - 1) * rd + 1 for k, rd in zip(ks, spec.rhs_dilation)]
  dilated = any(rd > 1 for rd in spec.rhs_dilation)

  def step(carry, start):
    zero = jnp.zeros((), start.dtype)
    window = lax.dynamic_slice(
        x, (zero, *(start[i] for i in range(nsp)), zero),
        (x.shape[0], *sizes, x.shape[-1]))
    if dilated:
      window = lax.slice(window, (0,) * x.ndim, window.shape,
                         (1, *spec.rhs_dilation, 1))
    return carry, jnp.sum(window * g, axis=tuple(range(nsp + 1)))

  _, y = lax.scan(step, None, jnp.asarray(starts))
  y = y.reshape(out_cl)
  return layout.out_from_channels_last(y.astype(layout.out_dtype(spec)), spec)


def conv_depthwise(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A depthwise conv (or its weight gradient) by shift-and-add."""
  with layout.kernel_scope("depthwise"):
    if spec.batch_group_count > 1:
      return _weight_grad_form(lhs, rhs, spec)
    return _channel_form(lhs, rhs, spec)


def is_channel_form(spec: ConvSpec) -> bool:
  """feature_group_count == C_in > 1, one input channel per group, C_out == C_in."""
  c_in = layout.lhs_shape_channels_last(spec)[-1]
  *_, i, o = layout.rhs_shape_channels_last(spec)
  return (spec.batch_group_count == 1 and spec.feature_group_count == c_in > 1
          and i == 1 and o == c_in)


def is_weight_grad_form(spec: ConvSpec) -> bool:
  """batch_group_count == G > 1 == lhs batch == out features; no feature groups."""
  g = spec.batch_group_count
  n = layout.lhs_shape_channels_last(spec)[0]
  o = layout.rhs_shape_channels_last(spec)[-1]
  return spec.feature_group_count == 1 and g > 1 and n == g and o == g


def applicable(spec: ConvSpec, platform: str) -> bool:
  """The channel form (<= 81 taps) or the weight-gradient form (<= 81 outputs)."""
  del platform
  if not layout.is_float(spec):
    return False
  if is_channel_form(spec):
    return layout.window_count(spec) <= MAX_TAPS
  if is_weight_grad_form(spec):
    out_spatial = layout.out_shape_channels_last(spec)[1:-1]
    return math.prod(out_spatial) <= MAX_TAPS
  return False


KERNELS = (("depthwise", conv_depthwise, applicable),)
