"""The ``direct_native`` conv kernel: dense small-window convolutions in C++ (CPU).

Two handlers of ``csrc/direct_conv.cc``, built on first use by
`tunedjax._native`, cover the dense (``feature_group_count ==
batch_group_count == 1``) 1-D and 2-D convolutions of a train step, with any
dimension numbers, padding (negative too), strides, lhs and rhs dilation:

* the *window form*, a kernel window of 2 to 49 taps (each side at most 7):
  the forward conv and its input gradient (a conv of the output gradient
  with the reversed kernel, with ``lhs_dilation`` after a strided forward).
  A register-blocked direct convolution over channels-last data: a tile of
  output pixels x output channels kept in registers, broadcast-FMA over
  (tap, input channel);
* the *weight-gradient form*, 2 to 49 output positions (each side at most 7)
  and a window with a side over 7: the weight gradient of a dense conv as JAX emits it
  (the input's batch and channel dimensions swapped, the output gradient as
  the "kernel", the kernel's taps as the output positions). Per tap, an
  in-channel x out-channel tile accumulated over the batch's positions in
  registers, the images' partials added in double in a fixed order.

Both are exact in the operands' dtype (float32 or float64): no fast math,
vectorised over output channels only; a fixed work split, so the results are
the same bits from run to run. Other dtypes (bfloat16, float16) and a
``preferred_element_type`` other than the operands' dtype are not applicable.
Applicable on CPU only, and only where the native library builds (a C++
compiler, ``TUNEDJAX_NATIVE`` not ``0``). 1x1 kernels (and their weight
gradients, one output position) are left to the pointwise kernels.

Example:
  >>> import numpy as np
  >>> from jax import lax
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x = np.random.default_rng(0).normal(size=(2, 8, 8, 4)).astype(np.float32)
  >>> w = np.random.default_rng(1).normal(size=(3, 3, 4, 5)).astype(np.float32)
  >>> kw = dict(window_strides=(2, 2), padding="SAME",
  ...           dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> spec = ConvSpec.from_arrays(x, w, **kw)
  >>> ref = lax.conv_general_dilated(x, w, **kw)
  >>> not applicable(spec, "cpu") or bool(np.allclose(conv_direct_native(x, w, spec), ref,
  ...                                                   atol=1e-4))
  True
"""

from __future__ import annotations

import pathlib
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax import _native
from tunedjax._errors import AutotuneError
from tunedjax.ops.conv import _layout as layout

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec

SOURCE = _native.register_source(pathlib.Path(__file__).parent / "csrc" / "direct_conv.cc")
"""The C++ file (``csrc/direct_conv.cc``) the kernel's handlers live in."""
NATIVE_SOURCES = (SOURCE,)
"""Part of the kernel's source hash (`_registry.source_hash`): a C++ edit re-tunes."""

MAX_SIDE = 7
"""The largest window side (window form) or output side (weight-gradient form)."""

_SYMBOLS = {"float32": "F32", "float64": "F64"}


def _target(handler: str, dtype: str) -> str:
  """The registered FFI target of `handler` (``"Conv"`` or ``"Wgrad"``) for `dtype`."""
  target = _native.ffi_target(SOURCE, f"TjDirect{handler}{_SYMBOLS[dtype]}")
  if target is None:  # applicable said yes, then the library went away (tests)
    raise AutotuneError(f"direct_native: the native kernel is unavailable here (no library "
                        f"built from {SOURCE}.cc; see TUNEDJAX_NATIVE), so it cannot run.")
  return target


def _attrs(spec: ConvSpec) -> dict[str, np.int64]:
  """The geometry attributes, height first; a 1-D conv is a 2-D one of height 1."""
  one = ((1,), ((0, 0),), (1,), (1,)) if spec.num_spatial == 1 else ((), (), (), ())
  (sh, sw) = one[0] + tuple(spec.window_strides)
  (ph, _), (pw, _) = one[1] + tuple(spec.padding)
  (lh, lw) = one[2] + tuple(spec.lhs_dilation)
  (rh, rw) = one[3] + tuple(spec.rhs_dilation)
  return {"stride_h": np.int64(sh), "stride_w": np.int64(sw), "pad_h": np.int64(ph),
          "pad_w": np.int64(pw), "lhs_dil_h": np.int64(lh), "lhs_dil_w": np.int64(lw),
          "rhs_dil_h": np.int64(rh), "rhs_dil_w": np.int64(rw)}


def _as_2d(x: Any, spec: ConvSpec) -> Any:
  """A channels-last 1-D operand ``(A, W, B)`` as ``(A, 1, W, B)``; 2-D as it is."""
  return x[:, None] if spec.num_spatial == 1 else x


def _window_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  x = _as_2d(layout.lhs_to_channels_last(lhs, spec), spec)  # (N, H, W, CI)
  w = layout.rhs_to_channels_last(rhs, spec)  # (KH, KW, CI, CO)
  w = w[None] if spec.num_spatial == 1 else w
  out_cl = layout.out_shape_channels_last(spec)
  shape = (out_cl[0], 1, *out_cl[1:]) if spec.num_spatial == 1 else out_cl
  call = jax.ffi.ffi_call(_target("Conv", spec.lhs_dtype),
                          jax.ShapeDtypeStruct(shape, jnp.dtype(spec.out_dtype)),
                          vmap_method="sequential")
  y = call(x, w, **_attrs(spec)).reshape(out_cl)
  return layout.out_from_channels_last(y, spec)


def _weight_grad_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  ls, rs, os_ = spec.dimension_numbers
  # lhs as (feature, *spatial, batch) and rhs as (in, *spatial, out): for the
  # weight gradient of an NHWC conv, the layouts they already have (x as N, H,
  # W, CI and the output gradient as N, OH, OW, CO).
  x = _as_2d(layout.maybe_transpose(lhs, (ls[1], *ls[2:], ls[0])), spec)
  g = _as_2d(layout.maybe_transpose(rhs, (rs[1], *rs[2:], rs[0])), spec)
  shape = spec.out_shape
  canonical = (*(shape[d] for d in os_[2:]), shape[os_[0]], shape[os_[1]])  # (*P, B, F)
  call = jax.ffi.ffi_call(_target("Wgrad", spec.lhs_dtype),
                          jax.ShapeDtypeStruct(((1,) if spec.num_spatial == 1 else ())
                                               + canonical, jnp.dtype(spec.out_dtype)),
                          vmap_method="sequential")
  y = call(x, g, **_attrs(spec)).reshape(canonical)
  nsp = spec.num_spatial
  perm = [0] * (nsp + 2)  # out axis os_[k] <- canonical axis
  perm[os_[0]], perm[os_[1]] = nsp, nsp + 1
  for i, d in enumerate(os_[2:]):
    perm[d] = i
  return layout.maybe_transpose(y, tuple(perm))


def _forward(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  with layout.kernel_scope("direct_native"):
    if is_window_form(spec):
      return _window_form(lhs, rhs, spec)
    return _weight_grad_form(lhs, rhs, spec)


_conv = layout.with_lax_vjp(_forward)


def conv_direct_native(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A dense small-window conv (or a dense weight gradient) by the native CPU handlers.

  Args:
    lhs: the equation's input (in the weight-gradient form, the layer's input).
    rhs: the equation's kernel (in the weight-gradient form, the output gradient).
    spec: the convolution; must be `applicable` on "cpu".

  Returns:
    The equation's output, in its dtype and layout. Differentiating it
    differentiates the XLA convolution (in a train step the backward
    convolutions are equations of their own, tuned separately).
  """
  return _conv(lhs, rhs, spec)


def _sides_within(sides: tuple[int, ...]) -> bool:
  return 2 <= math.prod(sides) and all(1 <= s <= MAX_SIDE for s in sides)


def is_window_form(spec: ConvSpec) -> bool:
  """A window of 2 to 49 taps, each side at most 7."""
  return _sides_within(layout.rhs_shape_channels_last(spec)[:-2])


def is_weight_grad_form(spec: ConvSpec) -> bool:
  """A window side over 7; 2 to 49 output positions, each side at most 7."""
  return (max(layout.rhs_shape_channels_last(spec)[:-2]) > MAX_SIDE
          and _sides_within(layout.out_shape_channels_last(spec)[1:-1]))


def _dense_2d(spec: ConvSpec) -> bool:
  pet = spec.preferred_element_type
  return (spec.num_spatial in (1, 2) and spec.feature_group_count == 1
          and spec.batch_group_count == 1
          and spec.lhs_dtype == spec.rhs_dtype == spec.out_dtype
          and spec.lhs_dtype in _SYMBOLS and pet in (None, spec.lhs_dtype))


def applicable(spec: ConvSpec, platform: str) -> bool:
  """On CPU with the native library built: a dense 1-D/2-D conv of either form, float32/64."""
  if platform != "cpu" or not _dense_2d(spec):
    return False
  if not (is_window_form(spec) or is_weight_grad_form(spec)):
    return False
  return _native.available(SOURCE)


KERNELS = (("direct_native", conv_direct_native, applicable),)
