"""The ``"layer_norm"`` family's kernels in JAX: layer norm over the last axis.

Each kernel is ``fn(x, scale, bias, spec) -> y`` with ``y = (x - mean) *
rsqrt(var + eps) * scale + bias``, the mean and the biased variance of each
row (every axis but the last indexes the rows), ``scale`` and ``bias`` of
shape ``(C,)``, differentiable in all three operands:

- ``xla``: the computation written out (the row's mean, then the mean of its
  squared deviations), autodiff's backward. The reference.
- ``fused``: the same forward and the fused backward formula, a
  `jax.custom_vjp`: with ``xhat = (x - mean) * rstd`` and ``g = dy * scale``,
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` per row,
  ``dscale = sum(dy * xhat)`` and ``dbias = sum(dy)`` over the rows: two row
  reductions and one elementwise pass instead of autodiff's chain.

The ``native`` kernel (C++, `_native_kernel`) has the same contract.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.layer_norm._spec import LayerNormSpec
  >>> x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
  >>> y = fused(x, np.ones(8, np.float32), np.zeros(8, np.float32), LayerNormSpec.from_arrays(x))
  >>> bool(np.allclose(np.asarray(y).mean(-1), 0.0, atol=1e-6))
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tunedjax.ops.layer_norm._spec import LayerNormSpec

_FUSED_DTYPES = ("float32", "float64")


def xla(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: LayerNormSpec) -> jax.Array:
  """The reference: each row's two-pass statistics and the normalisation, as written."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * (lax.rsqrt(var + jnp.asarray(spec.epsilon, x.dtype)) * scale) + bias


@functools.cache
def _fused_fn(epsilon: float) -> Callable[..., jax.Array]:
  """The custom-VJP layer norm with the fused backward formula, for one epsilon."""

  def forward(x, scale, bias):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    rstd = lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
                     + jnp.asarray(epsilon, x.dtype))
    return centred * (rstd * scale) + bias, (x, mean, rstd, scale)

  @jax.custom_vjp
  def layer_norm(x, scale, bias):
    return forward(x, scale, bias)[0]

  def backward(residuals, dy):
    x, mean, rstd, scale = residuals
    dy = dy.astype(x.dtype)
    xhat = (x - mean) * rstd
    g = dy * scale
    dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True)
                 - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    return (dx, jnp.sum(dy * xhat, axis=rows).astype(scale.dtype),
            jnp.sum(dy, axis=rows).astype(scale.dtype))

  layer_norm.defvjp(forward, backward)
  return layer_norm


def fused(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: LayerNormSpec) -> jax.Array:
  """The reference's forward with the fused backward formula (`jax.custom_vjp`)."""
  return _fused_fn(float(spec.epsilon))(x, scale, bias)


def fused_applicable(spec: LayerNormSpec, platform: str) -> bool:
  """float32/float64 with at least one row and one feature."""
  del platform
  return spec.dtype in _FUSED_DTYPES and spec.rows >= 1 and spec.features >= 1


def always(spec: Any, platform: str) -> bool:
  del spec, platform
  return True


# (name, fn, applicable), the default first.
KERNELS = (
    ("xla", xla, always),
    ("fused", fused, fused_applicable),
)
