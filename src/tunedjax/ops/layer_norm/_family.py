"""The built-in ``"layer_norm"`` op family and its call site `layer_norm`.

Layer norm over the last axis, each row by its own mean and variance, as
Flax's ``LayerNorm`` computes it by default: a call-site family, because its
fused backward must be in place before `jax.grad` runs. `layer_norm(x,
scale, bias)` builds a `LayerNormSpec` and calls `autotune.dispatch`:
outside kernel selection (plain `jax.jit`) it runs the reference, ``xla``;
under `tunedjax.jit` with kernel selection on, the bucket's measured winner
among ``xla``, ``fused`` and, on CPU where a C++ compiler builds it,
``native`` (forward and backward in C++, `_native_kernel`), each checked
first on random operands against float64 (the tuner's accuracy rule).
`route_layer_norm` sends Flax's ``LayerNorm`` layers here.

A bucket's key is the input's shape (with ``kernel.bucket = "pow2"`` the
rows rounded up to a power of two, the features exact), its dtype and epsilon.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), jnp.float32)
  >>> y = layer_norm(x, jnp.ones(16), jnp.zeros(16))
  >>> float(jnp.abs(y.mean(-1)).max()) < 1e-5
  True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from tunedjax._errors import ShapeError
from tunedjax._tuning import random_array
from tunedjax import autotune
from tunedjax.autotune._bucket import last_axis_exact, others_presumed
from tunedjax.ops.layer_norm import _kernels as _ln_kernels
from tunedjax.ops.layer_norm import _native_kernel
from tunedjax.ops.layer_norm._spec import LayerNormSpec

NAME = "layer_norm"


def ln_key(spec: LayerNormSpec, bucket: str = "exact") -> dict[str, Any]:
  """What a layer norm's timing depends on: shape (bucketed), dtype, epsilon.

  Example:
    >>> ln_key(LayerNormSpec((3, 100, 64), "float32"), "pow2")["shape"]
    [4, 128, 64]
  """
  return {"shape": last_axis_exact(spec.shape, bucket), "dtype": spec.dtype,
          "epsilon": float(spec.epsilon)}


def describe_ln(key: Mapping[str, Any]) -> str:
  """A bucket's short name.

  Example:
    >>> describe_ln({"shape": [2, 1024, 256], "dtype": "float32", "epsilon": 1e-6})
    'layer_norm 2x1024x256 float32'
  """
  return f"{NAME} {'x'.join(map(str, key['shape']))} {key['dtype']}"


def ln_operands(spec: LayerNormSpec, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Random input (each row its own mean and spread, as a residual stream's), scale and
  bias; never zeros."""
  x = random_array(spec.shape, spec.dtype, rng)
  rows = spec.shape[:-1] + (1,)
  x = x * (0.5 + rng.random(rows)) + rng.normal(size=rows) * 2.0
  c = spec.features
  return (x.astype(spec.dtype), random_array((c,), spec.dtype, rng),
          random_array((c,), spec.dtype, rng))


def ln_features(key: Mapping[str, Any]) -> dict[str, float]:
  """Numbers that describe a layer-norm bucket, for predicting its kernels' times:
  the rows and features on a log2 scale, and the dtype's size.

  Example:
    >>> ln_features({"shape": [2, 1024, 256], "dtype": "float32"})
    {'rows': 11.0, 'features': 8.0, 'itemsize': 4.0}
  """
  shape = [max(int(d), 1) for d in key["shape"]]
  return {"rows": math.log2(math.prod(shape[:-1])), "features": math.log2(shape[-1]),
          "itemsize": 2.0 * math.log2(np.dtype(key["dtype"]).itemsize)}


# On a GPU XLA fuses a layer norm's row reductions and elementwise ops itself: xla
# comes first there until the GPU's own measurements say otherwise. CPU: measured.
PRESUMED = {"gpu": 1.5}


def ln_presumed(key: Mapping[str, Any], platform: str) -> dict[str, float]:
  """The family's rule for a platform with nothing measured near a bucket (`PRESUMED`).

  Example:
    >>> ln_presumed({"candidates": {"xla": "", "fused": ""}}, "gpu")
    {'fused': 1.5}
  """
  return others_presumed(key, PRESUMED.get(platform))


FAMILY = autotune.OpFamily(
    name=NAME, spec_type=LayerNormSpec, key=ln_key, operands=ln_operands, default="xla",
    describe=describe_ln, timed="forward+backward",  # the kernels differ in their backward
    features=ln_features, presumed=ln_presumed)


def register() -> None:
  """Registers the family and its kernels, in order (xla first)."""
  autotune.register_op_family(FAMILY, replace=True)
  native = (("native", _native_kernel.native, _native_kernel.native_applicable),)
  for name, fn, applicable in (*_ln_kernels.KERNELS, *native):  # C++: CPU with a compiler
    autotune.register_kernel(NAME, name, fn, applicable=applicable, replace=True)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
               epsilon: float = 1e-6) -> jax.Array:
  """Layer norm over the last axis, kernel-selected.

  ``(x - mean) * rsqrt(var + epsilon) * scale + bias`` with the mean and
  (biased) variance of each row over the last axis, as Flax's ``LayerNorm``
  computes it. Outside kernel selection it runs the reference; under
  `tunedjax.jit` with kernel selection on, its bucket's fastest checked kernel
  (forward and backward). `route_layer_norm` sends Flax's ``LayerNorm``
  layers here.

  Args:
    x: the input, features last (any rank >= 1).
    scale: ``(C,)``.
    bias: ``(C,)``.
    epsilon: added to each row's variance.

  Returns:
    The normalised array, `x`'s shape and dtype.

  Raises:
    ShapeError: `x` is a scalar, or `scale` or `bias` is not of shape ``(C,)``.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 32)), jnp.float32)
    >>> y = layer_norm(x, 2 * jnp.ones(32), jnp.zeros(32))
    >>> round(float(y.std(-1).mean()), 3)
    2.0
  """
  c = x.shape[-1] if x.ndim else None
  for name, v in (("scale", scale), ("bias", bias)):
    if x.ndim < 1 or tuple(v.shape) != (c,):
      raise ShapeError(f"layer_norm: {name} must have shape (C,) = ({c},) for x of shape "
                       f"{tuple(x.shape)} (rank >= 1, features last), got {tuple(v.shape)}.")
  spec = LayerNormSpec.from_arrays(x, epsilon=epsilon)
  return autotune.dispatch(NAME, spec, x, scale.astype(x.dtype), bias.astype(x.dtype))
