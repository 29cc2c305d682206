"""The ``matmul_1x1_native`` conv kernel: pointwise convolutions in C++ (CPU).

A pointwise (1x1, stride 1, unpadded) convolution takes two forms in a train
step, and this kernel runs both as row-major matrix products on channels-last
data (``csrc/pointwise.cc``, an XLA FFI handler built on first use, see
`tunedjax._native`), rows being the ``N*H*W`` positions:

* the *matmul form*, every kernel spatial size 1, stride 1, no padding or
  dilation: the forward ``Y = X W`` and the input gradient ``dX = dY W^T``
  (its rhs is the same weights with the feature dimensions swapped).
* the *weight-gradient form*, the convolution autodiff emits for
  ``dW[i, o] = sum_r X[r, i] dY[r, o]``: its window covers the whole input
  (every output spatial size 1), no padding, dilation or groups; the lhs is
  the activations with their channels as the conv's batch dimension and the
  batch as its feature dimension, the rhs the output gradient. The C++
  handler reads both row by row as they lie in memory (NHWC), so XLA does not
  transpose the activations to ``(C, N*H*W)`` for a dot first.

float32 and float64 operands (one dtype, no other ``preferred_element_type``);
the sums run in that dtype, in a fixed order (bitwise reproducible).
Applicable on CPU only, and only where the native library builds
(`tunedjax._native.available`): elsewhere (another platform, no compiler,
``TUNEDJAX_NATIVE=0``) the tuner never considers it.

Alone it beats ``window_matmul`` on every 1x1 weight-gradient bucket of the
demo and MobileNet-style steps (0.4-0.8x its time) and is level with
``matmul_1x1`` on the forward and input gradient; in the whole tuned train
steps, measured on a quiet machine, it took 0.97x (demo) and 0.94x
(MobileNet) of the time without it, A/A 0.99 and 1.01 (BENCHMARKS.md,
"Native 1x1 convolutions").

Example:
  >>> import numpy as np
  >>> from jax import lax
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x = np.random.default_rng(0).normal(size=(2, 5, 5, 8)).astype(np.float32)
  >>> w = np.random.default_rng(1).normal(size=(1, 1, 8, 4)).astype(np.float32)
  >>> dn = ("NHWC", "HWIO", "NHWC")
  >>> spec = ConvSpec.from_arrays(x, w, dimension_numbers=dn)
  >>> ref = lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)
  >>> bool(not applicable(spec, "cpu")
  ...      or np.allclose(conv_matmul_1x1_native(x, w, spec), ref, atol=1e-5))
  True
"""

from __future__ import annotations

import pathlib
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from tunedjax import _native
from tunedjax.ops.conv import _layout as layout

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec

NAME = "matmul_1x1_native"
SOURCE = _native.register_source(pathlib.Path(__file__).parent / "csrc" / "pointwise.cc")
NATIVE_SOURCES = (SOURCE,)
"""Part of the kernel's source hash (`_registry.source_hash`): a C++ edit re-tunes."""
DTYPES = ("float32", "float64")
_SUFFIX = {"float32": "F32", "float64": "F64"}


def _target(kind: str, dtype: Any) -> str:
  symbol = f"TjPointwise{kind}{_SUFFIX[jnp.dtype(dtype).name]}"
  target = _native.ffi_target(SOURCE, symbol)
  if target is None:  # applicable() said yes, so the library was there
    raise RuntimeError(f"{NAME}: the native library {SOURCE}.cc is unavailable")
  return target


def _call(kind: str, a: Any, b: Any, shape: tuple[int, int]) -> Any:
  call = jax.ffi.ffi_call(_target(kind, a.dtype), jax.ShapeDtypeStruct(shape, a.dtype),
                          vmap_method="sequential")
  return call(a, b)


def _matmul_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  x = layout.lhs_to_channels_last(lhs, spec)            # (N, *S, I)
  w = layout.rhs_to_channels_last(rhs, spec)            # (1, ..., 1, I, O)
  i, o = w.shape[-2:]
  rows = math.prod(x.shape[:-1])
  y = _call("Matmul", x.reshape(rows, i), w.reshape(i, o), (rows, o))
  return layout.out_from_channels_last(y.reshape(layout.out_shape_channels_last(spec)), spec)


def _weight_grad_form(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  # The lhs as (feature, *S, batch) and the rhs as (in, *S, out): for the
  # weight gradient of an NHWC conv that is (N, H, W, C_in) and (N, H, W,
  # C_out), the layouts they already have, so the transposes are no-ops.
  ls, rs = spec.dimension_numbers[:2]
  x = layout.maybe_transpose(lhs, (ls[1], *ls[2:], ls[0]))
  g = layout.maybe_transpose(rhs, (rs[1], *rs[2:], rs[0]))
  i, o = x.shape[-1], g.shape[-1]
  rows = math.prod(x.shape[:-1])
  y = _call("Wgrad", x.reshape(rows, i), g.reshape(rows, o), (i, o))
  return layout.out_from_channels_last(y.reshape(layout.out_shape_channels_last(spec)), spec)


def _forward(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  with layout.kernel_scope(NAME):
    if is_weight_grad_form(spec):
      return _weight_grad_form(lhs, rhs, spec)
    return _matmul_form(lhs, rhs, spec)


_conv = layout.with_lax_vjp(_forward)


def conv_matmul_1x1_native(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """A pointwise convolution (or its weight gradient) as a native matrix product.

  Differentiable (its VJP is lax's), as every kernel must be.
  """
  return _conv(lhs, rhs, spec)


def _plain(spec: ConvSpec) -> bool:
  """One dtype of `DTYPES`; no groups, padding or dilation."""
  dtype = spec.lhs_dtype
  return (dtype in DTYPES and spec.rhs_dtype == dtype and spec.out_dtype == dtype
          and spec.preferred_element_type in (None, dtype)
          and spec.feature_group_count == 1 and spec.batch_group_count == 1
          and all(p == (0, 0) for p in spec.padding)
          and all(d == 1 for d in spec.lhs_dilation)
          and all(d == 1 for d in spec.rhs_dilation))


def is_matmul_form(spec: ConvSpec) -> bool:
  """A 1x1 kernel, stride 1, no padding, dilation or groups, one float dtype."""
  return (_plain(spec) and layout.window_count(spec) == 1
          and all(s == 1 for s in spec.window_strides))


def is_weight_grad_form(spec: ConvSpec) -> bool:
  """The window covers the whole lhs (every output spatial size 1); otherwise plain.

  That is the weight gradient of a 1x1, stride-1 convolution: the output is
  ``(C_in, 1, ..., 1, C_out)`` in channels-last terms.
  """
  if not _plain(spec):
    return False
  lhs_spatial = layout.lhs_shape_channels_last(spec)[1:-1]
  rhs_spatial = layout.rhs_shape_channels_last(spec)[:-2]
  out_spatial = layout.out_shape_channels_last(spec)[1:-1]
  return (tuple(lhs_spatial) == tuple(rhs_spatial)
          and all(s == 1 for s in out_spatial))


def applicable(spec: ConvSpec, platform: str) -> bool:
  """On CPU with the native library built: the matmul or the weight-gradient form."""
  if platform != "cpu" or not (is_matmul_form(spec) or is_weight_grad_form(spec)):
    return False
  return _native.available(SOURCE)


KERNELS = ((NAME, conv_matmul_1x1_native, applicable),)
