"""The ``"layer_norm"`` family's ``native`` kernel: layer norm in C++ (CPU).

``native(x, scale, bias, spec) -> y`` normalises each row of `x` (every axis
but the last, flattened) over its last axis, ``y = (x - mean) * rstd * scale
+ bias`` with ``rstd = 1 / sqrt(var + epsilon)`` (the biased variance), and
is differentiable in all three operands through a `jax.custom_vjp` whose
forward and backward are handlers of ``csrc/layer_norm.cc`` (built on first
use by `tunedjax._native`):

- forward: ``y`` and each row's mean and ``rstd`` (saved for the backward),
  the statistics in two passes over the row (the corrected two-pass
  algorithm, so a mean 1e3 times the spread costs the variance no digits);
- backward: ``dx`` row by row, and ``dscale = sum(dy * xhat)``, ``dbias =
  sum(dy)`` over the rows, accumulated in double.

Each handler does the whole op in one sweep over the rows (a row stays in
cache across its passes), where XLA:CPU re-reads ``x`` in several loops.
Rows run on XLA's intra-op thread pool in a fixed number of chunks that
depends only on the shape, the column sums' chunk partials added in chunk
order: the same bits from run to run, whatever the thread count.

Applicable on CPU only, to float32 and float64 inputs of rank >= 1 with at
least one row and one feature, and only where the library builds (a C++
compiler, ``TUNEDJAX_NATIVE`` not ``0``); `scale` and `bias` are cast to the
input's dtype.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from tunedjax.ops.layer_norm._spec import LayerNormSpec
  >>> def reference(x, scale, bias, spec):  # plain jnp: no compiler here
  ...   mean = x.mean(-1, keepdims=True)
  ...   var = ((x - mean) ** 2).mean(-1, keepdims=True)
  ...   return (x - mean) * jax.lax.rsqrt(var + spec.epsilon) * scale + bias
  >>> x = np.random.default_rng(0).normal(size=(4, 3, 8)).astype(np.float32)
  >>> spec = LayerNormSpec.from_arrays(x, epsilon=1e-5)
  >>> kernel = native if native_applicable(spec, "cpu") else reference
  >>> y = kernel(x, jnp.ones(8), jnp.zeros(8), spec)
  >>> y.shape, bool(np.allclose(y.mean(-1), 0.0, atol=1e-5))
  ((4, 3, 8), True)
"""

from __future__ import annotations

import functools
import pathlib
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax import _native
from tunedjax._errors import AutotuneError
from tunedjax.ops.layer_norm._spec import LayerNormSpec
from tunedjax.rewrite import _compat

SOURCE = _native.register_source(pathlib.Path(__file__).parent / "csrc" / "layer_norm.cc")
"""The C++ file (``csrc/layer_norm.cc``) the kernel's handlers live in."""
NATIVE_SOURCES = (SOURCE,)
"""Part of the kernel's source hash (`_registry.source_hash`): a C++ edit re-tunes."""

_SYMBOLS = {"float32": "F32", "float64": "F64"}


def _target(handler: str, dtype: Any) -> str:
  """The FFI target of `handler` (``"Forward"``, ``"Backward"``) for `dtype`."""
  target = _native.ffi_target(SOURCE, f"TjLayerNorm{handler}{_SYMBOLS[jnp.dtype(dtype).name]}")
  if target is None:  # native_applicable said yes, then the library went away (tests)
    raise AutotuneError(f"layer_norm: the native kernel is unavailable here (no library built "
                        f"from {SOURCE}.cc; see TUNEDJAX_NATIVE), so it cannot run.")
  return target


def forward(x2: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The forward handler on ``x2`` ``(R, C)``: ``(y, mean, rstd)``, the last two ``(R,)``."""
  rows, cols = x2.shape
  out = (jax.ShapeDtypeStruct((rows, cols), x2.dtype),
         jax.ShapeDtypeStruct((rows,), x2.dtype), jax.ShapeDtypeStruct((rows,), x2.dtype))
  return jax.ffi.ffi_call(_target("Forward", x2.dtype), out, vmap_method="sequential")(
      x2, scale, bias, epsilon=np.float64(epsilon))


def backward(x2: jax.Array, dy: jax.Array, scale: jax.Array, mean: jax.Array,
             rstd: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The backward handler: ``(dx, dscale, dbias)`` from the forward's saved statistics."""
  rows, cols = x2.shape
  out = (jax.ShapeDtypeStruct((rows, cols), x2.dtype),
         jax.ShapeDtypeStruct((cols,), x2.dtype), jax.ShapeDtypeStruct((cols,), x2.dtype))
  return jax.ffi.ffi_call(_target("Backward", x2.dtype), out, vmap_method="sequential")(
      x2, dy, scale, mean, rstd)


@functools.cache
def _layer_norm(epsilon: float) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
  """``f(x2, scale, bias) -> y`` on ``(R, C)`` rows: the custom-VJP pair of handlers."""

  @jax.custom_vjp
  def layer_norm(x2, scale, bias):
    return forward(x2, scale, bias, epsilon)[0]

  def layer_norm_fwd(x2, scale, bias):
    y, mean, rstd = forward(x2, scale, bias, epsilon)
    return y, (x2, scale, mean, rstd)

  def layer_norm_bwd(res, dy):
    x2, scale, mean, rstd = res
    return backward(x2, dy.astype(x2.dtype), scale, mean, rstd)

  layer_norm.defvjp(layer_norm_fwd, layer_norm_bwd)
  return layer_norm


def _rows(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
  """`x` as ``(R, C)`` rows through the handlers, and back to its shape."""
  cols = x.shape[-1]
  y2 = _layer_norm(epsilon)(x.reshape(-1, cols), scale.reshape(cols).astype(x.dtype),
                            bias.reshape(cols).astype(x.dtype))
  return y2.reshape(x.shape)


def native(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: LayerNormSpec) -> jax.Array:
  """Layer norm over the last axis in C++, forward and backward (CPU; see the module docstring).

  On Explicit mesh axes (jax 0.11+'s default) it runs on Auto axes, since
  FFI calls have no sharding rule (XLA gathers their operands): `y` gets
  `x`'s sharding back.
  """
  x = jnp.asarray(x)
  fn = functools.partial(_rows, epsilon=float(spec.epsilon))
  sharding = getattr(_compat.typeof(x), "sharding", None)
  if getattr(sharding, "mesh", None) is None:
    return fn(x, scale, bias)
  return _compat.on_auto_axes(fn, (x, scale, bias), types.SimpleNamespace(sharding=sharding))


def native_applicable(spec: LayerNormSpec, platform: str) -> bool:
  """CPU, float32/float64, rank >= 1, a row and a feature at least, and the library builds."""
  return (platform == "cpu" and spec.dtype in _SYMBOLS and len(spec.shape) >= 1
          and spec.rows >= 1 and spec.features >= 1 and _native.available(SOURCE))
