"""The ``"batch_norm"`` family's ``native`` kernel: batch norm as two C++ XLA FFI calls (CPU).

``native(x, scale, bias, spec) -> (y, mean, var)`` has the family's contract
(see `_bn_kernels`): channels last, the statistics over every axis but the
last, all three outputs differentiable in all three operands through a
`jax.custom_vjp` whose backward is the ``fused`` kernel's formula. Both
directions are handlers of ``tunedjax/csrc/batch_norm.cc``, built on first
use by `tunedjax._native`:

- forward: the shifted sums of ``x - x[0]`` and of its square in one pass
  (accumulated in double, so neither a large mean nor millions of rows cost
  the variance its digits), then ``y = (x - mean) * scale * inv + bias`` in a
  second pass;
- backward: ``sum(dy)`` and ``sum(dy * (x - mean))`` in one pass (double),
  then ``dx`` with the statistics' cotangents in a second; ``dscale`` and
  ``dbias`` are the two sums.

Each pass runs over a fixed number of row chunks on XLA's intra-op thread
pool, the partial sums added in chunk order: the results are the same bits
from run to run, whatever the thread count. XLA sees each direction as one
opaque call, so it cannot fuse a consumer (the ReLU after each batch norm)
into it; the tuner measures whether the kernel still wins.

Applicable on CPU only, to float32 and float64 inputs of rank >= 2 with at
least one row, and only where the native library builds (a C++ compiler,
``TUNEDJAX_NATIVE`` not ``0``). float16 and bfloat16 are not applicable, as
for ``fused``: the Flax route sends float32 only.

Example:
  >>> import numpy as np
  >>> from tunedjax.autotune._bn_kernels import xla
  >>> from tunedjax.autotune._bn_spec import BatchNormSpec
  >>> x = np.random.default_rng(0).normal(size=(4, 3, 3, 2)).astype(np.float32)
  >>> spec = BatchNormSpec.from_arrays(x)
  >>> if native_applicable(spec, "cpu"):
  ...   y, mean, var = native(x, np.ones(2, np.float32), np.zeros(2, np.float32), spec)
  ... else:  # no C++ compiler here
  ...   y, mean, var = xla(x, np.ones(2, np.float32), np.zeros(2, np.float32), spec)
  >>> np.allclose(y.reshape(-1, 2).mean(0), 0.0, atol=1e-5), np.allclose(mean, x.mean((0, 1, 2)))
  (True, True)
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunedjax import _native
from tunedjax._errors import AutotuneError
from tunedjax.autotune._bn_spec import BatchNormSpec
from tunedjax.rewrite import _compat

SOURCE = "batch_norm"
"""The C++ file (``tunedjax/csrc/batch_norm.cc``) the kernel's handlers live in."""

_SYMBOLS = {"float32": "F32", "float64": "F64"}

Outputs = tuple[jax.Array, jax.Array, jax.Array]


def _target(direction: str, dtype: str) -> str:
  """The registered FFI target of `direction` (``"Fwd"`` or ``"Bwd"``) for `dtype`."""
  target = _native.ffi_target(SOURCE, f"TjBatchNorm{direction}{_SYMBOLS[dtype]}")
  if target is None:  # native_applicable said yes, then the library went away (tests)
    raise AutotuneError(f"batch_norm: the native kernel is unavailable here (no library built "
                        f"from {SOURCE}.cc; see TUNEDJAX_NATIVE), so it cannot run.")
  return target


@functools.cache
def _native_fn(epsilon: float) -> Callable[..., Outputs]:
  """The custom-VJP batch norm whose forward and backward are the native handlers."""
  eps = np.float64(epsilon)

  def forward(x, scale, bias):
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    vec = jax.ShapeDtypeStruct((c,), x.dtype)
    call = jax.ffi.ffi_call(_target("Fwd", x.dtype.name),
                            (jax.ShapeDtypeStruct(x2.shape, x.dtype), vec, vec),
                            vmap_method="sequential")
    y, mean, var = call(x2, scale.astype(x.dtype), bias.astype(x.dtype), epsilon=eps)
    return (y.reshape(x.shape), mean, var), (x2, mean, var, scale)

  @jax.custom_vjp
  def bn(x, scale, bias):
    return forward(x, scale, bias)[0]

  def backward(residuals, cotangents):
    x2, mean, var, scale = residuals
    dy, dmean, dvar = cotangents
    c = x2.shape[-1]
    vec = jax.ShapeDtypeStruct((c,), x2.dtype)
    call = jax.ffi.ffi_call(_target("Bwd", x2.dtype.name),
                            (jax.ShapeDtypeStruct(x2.shape, x2.dtype), vec, vec),
                            vmap_method="sequential")
    dx, dscale, dbias = call(x2, dy.reshape(x2.shape).astype(x2.dtype), mean, var,
                             scale.astype(x2.dtype), dmean.astype(x2.dtype),
                             dvar.astype(x2.dtype), epsilon=eps)
    return dx.reshape(dy.shape), dscale.astype(scale.dtype), dbias.astype(scale.dtype)

  bn.defvjp(forward, backward)
  return bn


@functools.cache
def _native_stats_fn(epsilon: float) -> Callable[..., Outputs]:
  """The custom-VJP batch norm whose sums are native calls, its elementwise passes XLA's."""

  def forward(x, scale, bias):
    c = x.shape[-1]
    vec = jax.ShapeDtypeStruct((c,), x.dtype)
    mean, var = jax.ffi.ffi_call(_target("Stats", x.dtype.name), (vec, vec),
                                 vmap_method="sequential")(x.reshape(-1, c))
    inv = lax.rsqrt(var + jnp.asarray(epsilon, x.dtype))
    y = (x - mean) * (scale * inv) + bias
    return (y, mean, var), (x, mean, inv, scale)

  @jax.custom_vjp
  def bn(x, scale, bias):
    return forward(x, scale, bias)[0]

  def backward(residuals, cotangents):
    x, mean, inv, scale = residuals
    dy, dmean, dvar = cotangents
    c = x.shape[-1]
    n = x.size // c
    vec = jax.ShapeDtypeStruct((c,), x.dtype)
    sdy, sdyc = jax.ffi.ffi_call(_target("GradSums", x.dtype.name), (vec, vec),
                                 vmap_method="sequential")(
                                     x.reshape(-1, c), dy.astype(x.dtype).reshape(-1, c), mean)
    sdyxhat = sdyc * inv
    k = scale * inv
    # `_bn_kernels._fused_fn`'s dx, the statistics' cotangents included.
    dx = k * dy - (k * sdy - dmean) / n - (x - mean) * ((k * inv * sdyxhat - 2 * dvar) / n)
    return dx, sdyxhat.astype(scale.dtype), sdy.astype(scale.dtype)

  bn.defvjp(forward, backward)
  return bn


def _on_auto_axes(fn: Callable[..., Outputs], x: jax.Array, scale: jax.Array,
                  bias: jax.Array) -> Outputs:
  """`fn(x, scale, bias)`, on Auto axes where `x` is on Explicit ones (FFI calls have no
  sharding rule): `y` gets `x`'s sharding back, the statistics replicated, as the
  reference's are."""
  sharding = getattr(_compat.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None:
    return fn(x, scale, bias)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out = types.SimpleNamespace(sharding=(sharding, replicated, replicated))
  return _compat.on_auto_axes(fn, (x, scale, bias), out)


def native_stats(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: BatchNormSpec
                 ) -> Outputs:
  """The sums native (statistics; sum(dy), sum(dy * (x - mean))), the rest as ``fused``."""
  return _on_auto_axes(_native_stats_fn(float(spec.epsilon)), x, scale, bias)


def native(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: BatchNormSpec) -> Outputs:
  """Batch norm in two native passes each way (CPU; see the module docstring).

  On Explicit mesh axes (jax 0.11+'s default) the FFI calls, which have no
  sharding rule, run on Auto axes (XLA gathers the operands) and `y` gets
  `x`'s sharding back, the statistics replicated, as the reference's are.
  """
  return _on_auto_axes(_native_fn(float(spec.epsilon)), x, scale, bias)


def native_applicable(spec: BatchNormSpec, platform: str) -> bool:
  """CPU, float32/float64, rank >= 2, at least one row, and the native library builds here."""
  return (platform == "cpu" and spec.dtype in _SYMBOLS and len(spec.shape) >= 2
          and spec.rows >= 1 and spec.channels >= 1 and _native.available(SOURCE))
