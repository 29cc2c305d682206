"""The built-in ``"batch_norm"`` op family and its call sites `batch_norm`, `batch_norm_stats`.

Batch norm on batch statistics (training mode), channels last: a call-site
family, because its fused backward must be in place before `jax.grad` runs
(a jaxpr seen after differentiation holds the backward's equations already).
`batch_norm(x, scale, bias)` (and `batch_norm_stats`, which also returns
the batch's mean and variance, for running averages) builds a
`BatchNormSpec` and calls `autotune.dispatch`: outside kernel selection (plain `jax.jit`) it runs the
reference, ``xla``; under `tunedjax.jit` with kernel selection on, the
bucket's measured winner among ``xla``, ``fused`` and, on CPU where a C++
compiler builds it, ``native`` (its sums in C++, `_native_kernel`)
(`_bn_kernels`), each checked first on random operands: no less accurate
than ``xla`` against float64 (the tuner's accuracy rule).

A bucket's key is the input's shape (with ``kernel.bucket = "pow2"`` the
rows rounded up to a power of two, the channels exact), its dtype and epsilon.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 4, 3)), jnp.float32)
  >>> y = batch_norm(x, jnp.ones(3), jnp.zeros(3))
  >>> float(jnp.abs(y.mean(axis=(0, 1, 2))).max()) < 1e-5
  True
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from tunedjax._errors import AutotuneError
from tunedjax._tuning import random_array
from tunedjax import autotune
from tunedjax.ops.batch_norm import _kernels as _bn_kernels
from tunedjax.ops.batch_norm import _native_kernel
from tunedjax.ops.batch_norm import _pattern as _bn_pattern
from tunedjax.ops.batch_norm._spec import BatchNormSpec
from tunedjax.autotune._bucket import last_axis_exact, others_presumed

NAME = "batch_norm"


def bn_key(spec: BatchNormSpec, bucket: str = "exact") -> dict[str, Any]:
  """What a batch norm's timing depends on: shape (bucketed), dtype, epsilon.

  Example:
    >>> bn_key(BatchNormSpec((3, 5, 5, 8), "float32"), "pow2")["shape"]
    [4, 8, 8, 8]
  """
  return {"shape": last_axis_exact(spec.shape, bucket), "dtype": spec.dtype,
          "epsilon": float(spec.epsilon)}


def describe_bn(key: Mapping[str, Any]) -> str:
  """A bucket's short name.

  Example:
    >>> describe_bn({"shape": [32, 32, 32, 64], "dtype": "float32", "epsilon": 1e-5})
    'batch_norm 32x32x32x64 float32'
  """
  return f"{NAME} {'x'.join(map(str, key['shape']))} {key['dtype']}"


def bn_operands(spec: BatchNormSpec, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Random input (mean and spread per channel), scale and bias; never zeros."""
  x = random_array(spec.shape, spec.dtype, rng)
  c = spec.channels
  offset = rng.normal(size=(c,)) * 2.0
  x = (x * (1.0 + rng.random(c)) + offset).astype(spec.dtype)
  return (x, random_array((c,), spec.dtype, rng), random_array((c,), spec.dtype, rng))


def bn_features(key: Mapping[str, Any]) -> dict[str, float]:
  """Numbers that describe a batch-norm bucket, for predicting its kernels'
  times: the rows (every axis but the channels) and channels on a log2
  scale, and the dtype's size.

  Example:
    >>> bn_features({"shape": [32, 16, 16, 64], "dtype": "float32"})
    {'rows': 13.0, 'channels': 6.0, 'itemsize': 4.0}
  """
  shape = [max(int(d), 1) for d in key["shape"]]
  return {"rows": math.log2(math.prod(shape[:-1])), "channels": math.log2(shape[-1]),
          "itemsize": 2.0 * math.log2(np.dtype(key["dtype"]).itemsize)}


# Each kernel's time over xla's as presumed on a platform that has measured
# nothing near a bucket. On a GPU XLA fuses batch norm's reductions and
# elementwise ops itself: xla comes first and ``fused`` is presumed slower, so it
# is neither compiled nor routed until the GPU's own measurements or priors say
# otherwise (no GPU measurement of it exists yet). CPU: no rule (measured there).
PRESUMED = {"gpu": 1.5}


def bn_presumed(key: Mapping[str, Any], platform: str) -> dict[str, float]:
  """The family's rule for a platform with nothing measured near a bucket (`PRESUMED`).

  Example:
    >>> bn_presumed({"candidates": {"xla": "", "fused": ""}}, "gpu")
    {'fused': 1.5}
  """
  return others_presumed(key, PRESUMED.get(platform))


FAMILY = autotune.OpFamily(
    name=NAME, spec_type=BatchNormSpec, key=bn_key, operands=bn_operands, default="xla",
    describe=describe_bn, timed="forward+backward",  # the kernels differ in their backward
    features=bn_features, priors=pathlib.Path(__file__).resolve().parent / "priors",
    presumed=bn_presumed, patterns=(_bn_pattern.find,))  # batch norm written out in primitives


def register() -> None:
  """Registers the family and its kernels, in order (xla first)."""
  autotune.register_op_family(FAMILY, replace=True)
  native = (("native", _native_kernel.native, _native_kernel.native_applicable),)
  for name, fn, applicable in (*_bn_kernels.KERNELS, *native):  # C++: CPU with a compiler
    autotune.register_kernel(NAME, name, fn, applicable=applicable, replace=True)


def batch_norm_stats(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
                     epsilon: float = 1e-5) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`batch_norm`, and the batch's per-channel mean and (biased) variance.

  The statistics are those the normalisation used, differentiable like the
  output; Flax's `BatchNorm` folds them into its running averages.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 4, 3)), jnp.float32)
    >>> y, mean, var = batch_norm_stats(x, jnp.ones(3), jnp.zeros(3))
    >>> bool(jnp.allclose(mean, x.mean((0, 1, 2)), atol=1e-6)), var.shape
    (True, (3,))
  """
  c = x.shape[-1] if x.ndim else None
  for name, v in (("scale", scale), ("bias", bias)):
    if x.ndim < 2 or tuple(v.shape) != (c,):
      raise AutotuneError(f"batch_norm: {name} must have shape (C,) = ({c},) for x of shape "
                          f"{tuple(x.shape)} (rank >= 2, channels last), got "
                          f"{tuple(v.shape)}.")
  spec = BatchNormSpec.from_arrays(x, epsilon=epsilon)
  return autotune.dispatch(NAME, spec, x, scale.astype(x.dtype), bias.astype(x.dtype))


def batch_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
               epsilon: float = 1e-5) -> jax.Array:
  """Batch norm on batch statistics over every axis but the last, kernel-selected.

  ``(x - mean) * rsqrt(var + epsilon) * scale + bias`` with the mean and
  (biased) variance of each channel over the batch and spatial axes, as
  Flax's `BatchNorm` computes in training. Outside kernel selection it runs
  the reference; under `tunedjax.jit` with kernel selection on, its bucket's
  fastest checked kernel (forward and backward). `route_batch_norm` sends
  Flax's `BatchNorm` layers here.

  Args:
    x: the input, channels last (``(N, H, W, C)``, or any rank >= 2).
    scale: ``(C,)``.
    bias: ``(C,)``.
    epsilon: added to the variance.

  Returns:
    The normalised array, `x`'s shape and dtype.

  Raises:
    AutotuneError: `scale` or `bias` is not of shape ``(C,)``.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 4, 3)), jnp.float32)
    >>> y = batch_norm(x, 2 * jnp.ones(3), jnp.zeros(3))
    >>> round(float(y.std()), 3)
    2.0
  """
  return batch_norm_stats(x, scale, bias, epsilon=epsilon)[0]
