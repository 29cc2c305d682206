"""The ``"batch_norm"`` family's ``native`` kernel: batch norm's sums in C++ (CPU).

``native(x, scale, bias, spec) -> (y, mean, var)`` has the family's contract
(see `_kernels`): channels last, the statistics over every axis but the
last, all three outputs differentiable in all three operands through a
`jax.custom_vjp` with the ``fused`` kernel's backward formula. Its
reductions, which XLA:CPU compiles into slow loops, are handlers of
``csrc/batch_norm.cc`` (built on first use by `tunedjax._native`):

- forward: the mean and variance in one pass over ``x`` (the shifted sums of
  ``x - x[0]`` and its square, accumulated in double, so neither a large
  mean nor millions of rows cost the variance its digits);
- backward: ``sum(dy)`` and ``sum(dy * (x - mean))`` in one pass (double).

The elementwise passes, ``y = (x - mean) * scale * inv + bias`` and ``dx``,
stay in XLA, which fuses them with their neighbours (the ReLU after each
batch norm, its gradient, a convolution's padded copy). Handlers that also
normalised and formed ``dx`` in C++ were up to 3x faster timed alone but no
faster in the whole train steps, where their outputs must be materialised
(BENCHMARKS.md, "Native batch norm").

Each sum runs over a fixed number of row chunks on XLA's intra-op thread
pool, the partial sums added in chunk order: the same bits from run to run,
whatever the thread count. Applicable on CPU only, to float32 and float64
inputs of rank >= 2 with at least one row, and only where the library builds
(a C++ compiler, ``TUNEDJAX_NATIVE`` not ``0``). Not to float16 or bfloat16,
as for ``fused``: the Flax route sends float32 only, and a float32 copy of
the input for the sums would cost the pass the kernel saves.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.batch_norm._kernels import xla
  >>> from tunedjax.ops.batch_norm._spec import BatchNormSpec
  >>> x = np.random.default_rng(0).normal(size=(4, 3, 3, 2)).astype(np.float32)
  >>> spec = BatchNormSpec.from_arrays(x)
  >>> kernel = native if native_applicable(spec, "cpu") else xla  # xla: no compiler here
  >>> y, mean, var = kernel(x, np.ones(2, np.float32), np.zeros(2, np.float32), spec)
  >>> np.allclose(y.reshape(-1, 2).mean(0), 0.0, atol=1e-5), np.allclose(mean, x.mean((0, 1, 2)))
  (True, True)
"""

from __future__ import annotations

import pathlib
import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tunedjax import _native
from tunedjax._errors import AutotuneError
from tunedjax.ops.batch_norm import _kernels
from tunedjax.ops.batch_norm._spec import BatchNormSpec
from tunedjax.rewrite import _compat

SOURCE = _native.register_source(pathlib.Path(__file__).parent / "csrc" / "batch_norm.cc")
"""The C++ file (``csrc/batch_norm.cc``) the kernel's handlers live in."""
NATIVE_SOURCES = (SOURCE,)
"""Part of the kernel's source hash (`_registry.source_hash`): a C++ edit re-tunes."""

_SYMBOLS = {"float32": "F32", "float64": "F64"}

Outputs = tuple[jax.Array, jax.Array, jax.Array]


def _call(handler: str, dtype: Any, channels: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """The FFI call of `handler` (``"Stats"``, ``"GradSums"``): two ``(channels,)`` results."""
  target = _native.ffi_target(SOURCE, f"TjBatchNorm{handler}{_SYMBOLS[jnp.dtype(dtype).name]}")
  if target is None:  # native_applicable said yes, then the library went away (tests)
    raise AutotuneError(f"batch_norm: the native kernel is unavailable here (no library built "
                        f"from {SOURCE}.cc; see TUNEDJAX_NATIVE), so it cannot run.")
  vec = jax.ShapeDtypeStruct((channels,), dtype)
  return jax.ffi.ffi_call(target, (vec, vec), vmap_method="sequential")


@functools.cache
def _native_fn(epsilon: float) -> Callable[..., Outputs]:
  """The custom-VJP batch norm whose sums are native calls, its elementwise passes XLA's."""

  def stats(x2):
    return _call("Stats", x2.dtype, x2.shape[-1])(x2)

  def grad_sums(x2, dy2, mean):
    return _call("GradSums", x2.dtype, x2.shape[-1])(x2, dy2, mean)

  return _kernels.custom_vjp_batch_norm(stats, grad_sums, epsilon)


def native(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: BatchNormSpec) -> Outputs:
  """Batch norm with its sums in C++, the rest in XLA (CPU; see the module docstring).

  On Explicit mesh axes (jax 0.11+'s default) it runs on Auto axes, since
  FFI calls have no sharding rule (XLA gathers their operands): `y` gets
  `x`'s sharding back and the statistics are replicated, as the reference's
  are.
  """
  fn = _native_fn(float(spec.epsilon))
  sharding = getattr(_compat.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None:
    return fn(x, scale, bias)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out = types.SimpleNamespace(sharding=(sharding, replicated, replicated))
  return _compat.on_auto_axes(fn, (x, scale, bias), out)


def native_applicable(spec: BatchNormSpec, platform: str) -> bool:
  """CPU, float32/float64, rank >= 2, at least one row, and the native library builds here."""
  return (platform == "cpu" and spec.dtype in _SYMBOLS and len(spec.shape) >= 2
          and spec.rows >= 1 and spec.channels >= 1 and _native.available(SOURCE))
