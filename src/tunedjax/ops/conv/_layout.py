"""Layout helpers shared by the conv kernels: to and from channels-last.

Kernels compute in one canonical layout, lhs ``(N, *spatial, C)``, rhs
``(*spatial, I, O)`` and out ``(N, *spatial, C)``, and transpose the
equation's operands into it; XLA folds these transposes into neighbours.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x = np.ones((2, 3, 5, 7), np.float32)                  # NCHW
  >>> spec = ConvSpec.from_arrays(x, np.ones((4, 3, 1, 1), np.float32))
  >>> lhs_to_channels_last(x, spec).shape
  (2, 5, 7, 3)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec


def kernel_scope(name: str) -> Any:
  """A `jax.named_scope` naming conv kernel `name` in the compiled program's op names.

  A kernel put in place of a convolution keeps the convolution's source line
  (the model's), so its instructions are told apart by this scope
  (``.../tj_conv_depthwise/...`` in each instruction's ``op_name``): profiles
  attribute time to the kernel (`benchmarks/vs_pytorch.py`).
  """
  return jax.named_scope(f"tj_conv_{name}")


def with_lax_vjp(forward: Callable[[Any, Any, ConvSpec], Any]) -> Callable[..., Any]:
  """`forward(lhs, rhs, spec)` made differentiable, its VJP lax's for the same equation.

  For kernels JAX cannot differentiate (an FFI call has no derivative): the
  kernels replace equations of an already differentiated program, so their
  own derivative only matters when a user differentiates *around* a tuned
  function (`jax.grad(tj.jit(f))`), where the reference's is exact.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def conv(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
    return forward(lhs, rhs, spec)

  def conv_fwd(lhs: Any, rhs: Any, spec: ConvSpec) -> tuple[Any, tuple[Any, Any]]:
    return forward(lhs, rhs, spec), (lhs, rhs)

  def conv_bwd(spec: ConvSpec, residuals: tuple[Any, Any], cot: Any) -> Any:
    lhs, rhs = residuals
    params = spec.params()
    _, vjp = jax.vjp(lambda l, r: lax.conv_general_dilated_p.bind(l, r, **params), lhs, rhs)
    return vjp(cot)

  conv.defvjp(conv_fwd, conv_bwd)
  return conv


def maybe_transpose(x: Any, perm: tuple[int, ...]) -> Any:
  """`jnp.transpose(x, perm)`, or `x` itself when `perm` is the identity."""
  if perm == tuple(range(len(perm))):
    return x
  return jnp.transpose(x, perm)


def lhs_to_channels_last(lhs: Any, spec: ConvSpec) -> Any:
  """Transposes the equation's lhs to ``(N, *spatial, C)``."""
  s = spec.dimension_numbers[0]
  return maybe_transpose(lhs, (s[0], *s[2:], s[1]))


def rhs_to_channels_last(rhs: Any, spec: ConvSpec) -> Any:
  """Transposes the equation's rhs to ``(*spatial, I, O)``."""
  s = spec.dimension_numbers[1]
  return maybe_transpose(rhs, (*s[2:], s[1], s[0]))


def out_from_channels_last(y: Any, spec: ConvSpec) -> Any:
  """Transposes a ``(N, *spatial, C)`` result to the equation's out layout."""
  s = spec.dimension_numbers[2]
  nsp = len(s) - 2
  perm = [0] * (nsp + 2)
  perm[s[0]] = 0
  perm[s[1]] = nsp + 1
  for i, d in enumerate(s[2:]):
    perm[d] = 1 + i
  return maybe_transpose(y, tuple(perm))


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


def lhs_to_channels_first(lhs: Any, spec: ConvSpec) -> Any:
  """Transposes the equation's lhs to ``(N, C, *spatial)``."""
  return maybe_transpose(lhs, spec.dimension_numbers[0])


def rhs_to_channels_first(rhs: Any, spec: ConvSpec) -> Any:
  """Transposes the equation's rhs to ``(O, I, *spatial)``."""
  return maybe_transpose(rhs, spec.dimension_numbers[1])


def out_from_channels_first(y: Any, spec: ConvSpec) -> Any:
  """Transposes a ``(N, C, *spatial)`` result to the equation's out layout."""
  s = spec.dimension_numbers[2]
  perm = [0] * len(s)
  for i, d in enumerate(s):
    perm[d] = i
  return maybe_transpose(y, tuple(perm))


def window_count(spec: ConvSpec) -> int:
  """The number of kernel window positions (3x3 -> 9)."""
  s = spec.dimension_numbers[1]
  return math.prod(spec.rhs_shape[d] for d in s[2:])


def is_float(spec: ConvSpec) -> bool:
  """True when both operands share one floating dtype."""
  return (spec.lhs_dtype == spec.rhs_dtype
          and jnp.issubdtype(jnp.dtype(spec.lhs_dtype), jnp.floating))


def pad_spatial(x: Any, spec: ConvSpec, first_spatial: int) -> Any:
  """Applies the spec's padding and lhs dilation to the spatial dims of `x`.

  Args:
    x: an lhs in a canonical layout.
    spec: the convolution.
    first_spatial: the axis of the first spatial dim (1 channels-last, 2
      channels-first).

  Returns:
    `x` padded with zeros (negative padding crops), interior padding
    ``lhs_dilation - 1``.
  """
  config = [(0, 0, 0)] * x.ndim
  for i, ((lo, hi), dil) in enumerate(zip(spec.padding, spec.lhs_dilation)):
    config[first_spatial + i] = (lo, hi, dil - 1)
  if all(c == (0, 0, 0) for c in config):
    return x
  return lax.pad(x, jnp.zeros((), x.dtype), config)


def window_slice(x: Any, offset: tuple[int, ...], out_spatial: tuple[int, ...],
                 spec: ConvSpec) -> Any:
  """The lhs values kernel tap `offset` meets, channels-last ``(N, *out, C)``.

  Args:
    x: a padded (`pad_spatial`) channels-last lhs.
    offset: the kernel tap, one index per spatial dim.
    out_spatial: the output's spatial shape.
    spec: the convolution (strides and rhs dilation).

  Returns:
    The strided slice of `x` that tap multiplies.
  """
  start = [0] * x.ndim
  limit = list(x.shape)
  strides = [1] * x.ndim
  for i, (k, rd, ws, o) in enumerate(
      zip(offset, spec.rhs_dilation, spec.window_strides, out_spatial)):
    start[1 + i] = k * rd
    limit[1 + i] = k * rd + (o - 1) * ws + 1
    strides[1 + i] = ws
  return lax.slice(x, start, limit, strides)


def accumulation_dtype(spec: ConvSpec) -> Any:
  """The dtype to compute in: preferred_element_type, else at least float32."""
  if spec.preferred_element_type is not None:
    return jnp.dtype(spec.preferred_element_type)
  return jnp.promote_types(jnp.dtype(spec.lhs_dtype), jnp.float32)
