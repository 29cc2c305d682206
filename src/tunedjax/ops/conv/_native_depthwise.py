"""The ``depthwise_native`` conv kernel: the depthwise forms as C++ XLA FFI calls (CPU).

The same two forms the ``depthwise`` kernel handles, by the handlers of
``csrc/depthwise.cc`` (built on first use, see `tunedjax._native`):

* the *channel form* (forward, and input gradient with its ``lhs_dilation``):
  ``TjDepthwiseConv``, register-blocked over output columns and channels,
  with the valid taps of each output column planned once per call, so
  padding (negative too), strides and dilations cost no per-element branch.
* the *weight-gradient form* (``batch_group_count``):
  ``TjDepthwiseWgrad``, one pass over the input and the output gradient,
  each image's sum in the compute dtype and the images' sums in double.

Operands are transposed to channels-last (`_conv_layout`; XLA folds the
transposes into neighbours) and 1-D convolutions run as 2-D ones of unit
height. The handlers compute in float32 or float64, the operands' dtype
(`_conv_layout.accumulation_dtype` must be that dtype: preferred_element_type
None or the operands' own). float16 and bfloat16 operands are left to the
other kernels: cast to float32 around the call they measured 4.5x slower than
``depthwise`` on the demo's forward and input gradient (the casts are copies
that XLA cannot fuse into an FFI call; ``depthwise`` fuses them into its taps;
BENCHMARKS.md, "Native depthwise convolutions"). The
kernel is applicable on CPU only, and only where the native library is
built (`tunedjax._native.available`): with ``TUNEDJAX_NATIVE=0`` or without
a C++ compiler the tuner never considers it. Results are bitwise
reproducible (work is split by shape, never by thread count). Gradients
(when the kernel is differentiated, e.g. ``jax.grad`` of a function
rewritten by `tunedjax.jit`) differentiate the XLA convolution; in a train
step the backward convolutions are equations of their own, tuned
separately.

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
  >>> not applicable(spec, "cpu") or bool(
  ...     np.allclose(conv_depthwise_native(x, w, spec), ref, atol=1e-5))
  True
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax import _native
from tunedjax.ops.conv import _layout as layout
from tunedjax.ops.conv._depthwise import is_channel_form, is_weight_grad_form

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec

SOURCE = _native.register_source(pathlib.Path(__file__).parent / "csrc" / "depthwise.cc")
"""The native source (``csrc/depthwise.cc``) the kernel's handlers come from."""
NATIVE_SOURCES = (SOURCE,)
"""Part of the kernel's source hash (`_registry.source_hash`): a C++ edit re-tunes."""

_SUFFIX = {"float32": "F32", "float64": "F64"}


def _target(kind: str, dtype: Any) -> str:
  """The registered FFI target of handler ``TjDepthwise<kind><F32|F64>``."""
  symbol = f"TjDepthwise{kind}{_SUFFIX[np.dtype(dtype).name]}"
  target = _native.ffi_target(SOURCE, symbol)
  if target is None:
    raise RuntimeError(
        f"depthwise_native: the native library {SOURCE}.cc is unavailable "
        f"(${_native.ENV_VAR} or no C++ compiler), so {symbol} cannot run; the "
        "kernel is not applicable here and should not have been chosen.")
  return target


def _geometry(spec: ConvSpec, *, window_strides=None, rhs_dilation=None) -> dict[str, Any]:
  """The handlers' int64 attributes; a 1-D convolution as a unit-height 2-D one."""
  strides = spec.window_strides if window_strides is None else window_strides
  rhs_dil = spec.rhs_dilation if rhs_dilation is None else rhs_dilation
  pads = tuple(lo for lo, _ in spec.padding)
  lhs_dil = spec.lhs_dilation
  if spec.num_spatial == 1:
    strides, lhs_dil, rhs_dil = ((1, *t) for t in (strides, lhs_dil, rhs_dil))
    pads = (0, *pads)
  names = ("stride", "pad", "lhs_dil", "rhs_dil")
  attrs = {}
  for name, (h, w) in zip(names, (strides, pads, lhs_dil, rhs_dil)):
    attrs[f"{name}_h"] = np.int64(h)
    attrs[f"{name}_w"] = np.int64(w)
  return attrs


def _as_2d(x: Any, nsp: int, axis: int) -> Any:
  """Inserts a unit height at `axis` for a 1-D convolution's operand."""
  return x if nsp == 2 else jnp.expand_dims(x, axis)


def _channel_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  acc = layout.accumulation_dtype(spec)
  nsp = spec.num_spatial
  x = _as_2d(layout.lhs_to_channels_last(lhs, spec).astype(acc), nsp, 1)  # (N, H, W, C)
  w = layout.rhs_to_channels_last(rhs, spec).astype(acc)  # (*K, 1, C)
  w = _as_2d(w.reshape(*w.shape[:-2], w.shape[-1]), nsp, 0)  # (KH, KW, C)
  out_cl = layout.out_shape_channels_last(spec)
  shape = out_cl if nsp == 2 else (out_cl[0], 1, *out_cl[1:])
  y = jax.ffi.ffi_call(_target("Conv", acc), jax.ShapeDtypeStruct(shape, acc),
                       vmap_method="sequential")(x, w, **_geometry(spec))
  y = y.reshape(out_cl).astype(layout.out_dtype(spec))
  return layout.out_from_channels_last(y, spec)


def _weight_grad_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  acc = layout.accumulation_dtype(spec)
  nsp = spec.num_spatial
  # Both operands as (I, *spatial, G): for the weight gradient of an NHWC
  # depthwise conv that is the layout they already have (I = batch, G = C).
  ls, rs = spec.dimension_numbers[:2]
  x = layout.maybe_transpose(lhs, (ls[1], *ls[2:], ls[0])).astype(acc)
  g = layout.maybe_transpose(rhs, (rs[1], *rs[2:], rs[0])).astype(acc)
  x, g = _as_2d(x, nsp, 1), _as_2d(g, nsp, 1)
  out_cl = layout.out_shape_channels_last(spec)  # (1, *P, G)
  shape = (*out_cl[1:-1], out_cl[-1]) if nsp == 2 else (1, *out_cl[1:])
  y = jax.ffi.ffi_call(_target("Wgrad", acc), jax.ShapeDtypeStruct(shape, acc),
                       vmap_method="sequential")(x, g, **_geometry(spec))
  y = y.reshape(out_cl).astype(layout.out_dtype(spec))
  return layout.out_from_channels_last(y, spec)


def _forward(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  with layout.kernel_scope("depthwise_native"):
    if spec.batch_group_count > 1:
      return _weight_grad_form(lhs, rhs, spec)
    return _channel_form(lhs, rhs, spec)


_conv = layout.with_lax_vjp(_forward)


def conv_depthwise_native(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A depthwise conv (or its weight gradient) by the native CPU handlers.

  Args:
    lhs: the equation's input.
    rhs: the equation's kernel (the output gradient, in the weight-gradient form).
    spec: the convolution; must be `applicable` on "cpu".

  Returns:
    The equation's output, in its dtype and layout.
  """
  return _conv(lhs, rhs, spec)


def supports(spec: ConvSpec) -> bool:
  """Either depthwise form, 1-D or 2-D, float32 or float64 computed in that dtype."""
  if spec.num_spatial not in (1, 2) or not layout.is_float(spec):
    return False
  if spec.lhs_dtype not in _SUFFIX or layout.accumulation_dtype(spec).name != spec.lhs_dtype:
    return False
  return is_channel_form(spec) or is_weight_grad_form(spec)


def applicable(spec: ConvSpec, platform: str) -> bool:
  """On "cpu" only, where the native library is available, for `supports`'s convolutions."""
  return platform == "cpu" and supports(spec) and _native.available(SOURCE)


KERNELS = (("depthwise_native", conv_depthwise_native, applicable),)
