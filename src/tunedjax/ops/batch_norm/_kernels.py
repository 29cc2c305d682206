"""The ``"batch_norm"`` family's kernels: batch norm on batch statistics, channels last.

Each kernel is ``fn(x, scale, bias, spec) -> (y, mean, var)`` with ``y = (x -
mean) * rsqrt(var + eps) * scale + bias``, the statistics (``mean`` and the
biased variance ``var``, each ``(C,)``) over every axis but the last, and all
three outputs differentiable in all three operands (Flax's `BatchNorm` keeps
the statistics for its running averages):

- ``xla``: the computation as JAX's autodiff sees it when written out (two
  passes for the statistics: the mean, then the mean of squared deviations;
  the backward is whatever autodiff makes of the chain). The reference.
- ``fused``: one pass for the statistics (the sums of ``x - shift`` and of its
  square, ``shift`` being the mean of the first rows, so that a large mean
  does not cancel the variance away) and the fused backward formula, a
  `jax.custom_vjp`:
  ``dx = scale * inv / n * (n * dy - sum(dy) - xhat * sum(dy * xhat))``,
  ``dscale = sum(dy * xhat)``, ``dbias = sum(dy)``: two reductions and one
  elementwise pass instead of autodiff's chain; the statistics' cotangents
  add ``dmean / n + 2 * dvar * (x - mean) / n`` to ``dx`` inside that pass.
- ``native``: the same statistics and backward formula with the sums (the
  statistics; ``sum(dy)`` and ``sum(dy * xhat)``) as C++ XLA FFI calls, one
  pass each, accumulated in double (`_native_kernel`, ``csrc/batch_norm.cc``),
  and the elementwise passes left to XLA to fuse; CPU only, where the
  library builds.

No sum is written as a product with ones: a ``fused_dot`` kernel did so
(``ones @ x2d``), and XLA:CPU's matrix library adds the rows in order, so a
column of 2**20 rows lost three to four digits against float64 (XLA's own
reduction: none), and `Precision.HIGHEST` does not change that order on CPU
(BENCHMARKS.md, "Batch norm against float64"). It was removed.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.batch_norm._spec import BatchNormSpec
  >>> x = np.random.default_rng(0).normal(size=(4, 3, 3, 2)).astype(np.float32)
  >>> spec = BatchNormSpec.from_arrays(x)
  >>> y, mean, var = fused(x, np.ones(2, np.float32), np.zeros(2, np.float32), spec)
  >>> np.allclose(y.reshape(-1, 2).mean(0), 0.0, atol=1e-5), np.allclose(mean, x.mean((0, 1, 2)))
  (True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tunedjax.ops.batch_norm._spec import BatchNormSpec

_FUSED_DTYPES = ("float32", "float64")


Outputs = tuple[jax.Array, jax.Array, jax.Array]


def xla(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: BatchNormSpec) -> Outputs:
  """The reference: the statistics and the normalisation as written, autodiff's backward."""
  axes = tuple(range(x.ndim - 1))
  mean, var = jnp.mean(x, axes), jnp.var(x, axes)
  y = (x - mean) * lax.rsqrt(var + jnp.asarray(spec.epsilon, x.dtype)) * scale + bias
  return y, mean, var


# The shift the one-pass statistics subtract: the mean of (at most) this many first rows.
SHIFT_ROWS = 64


def _stats(x2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(mean, biased variance) of each column, in one pass over shifted data.

  The shift is the mean of the first `SHIFT_ROWS` rows: close enough to the
  column's mean that the variance ``sum(d * d) / n - mean(d) ** 2`` of the
  shifted data ``d`` cancels no digits worth having (one row, as before, lay
  a few standard deviations off: its variance was up to 6x less accurate
  than the two-pass reference's, against float64).
  """
  n = x2.shape[0]
  shift = lax.stop_gradient(jnp.mean(x2[:min(n, SHIFT_ROWS)], axis=0))
  d = x2 - shift
  s1, s2 = jnp.sum(d, axis=0), jnp.sum(d * d, axis=0)
  mean_d = s1 / n
  var = jnp.maximum(s2 / n - mean_d * mean_d, 0)
  return shift + mean_d, var


def custom_vjp_batch_norm(stats: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
                          grad_sums: Callable[..., tuple[jax.Array, jax.Array]],
                          epsilon: float) -> Callable[..., Outputs]:
  """The fused batch norm (forward, and the fused backward formula) over the sums it is given.

  Args:
    stats: ``x2 -> (mean, biased variance)`` of each column of the rows x channels input.
    grad_sums: ``(x2, dy2, mean) -> (sum(dy), sum(dy * (x - mean)))`` per column.
    epsilon: added to the variance.

  Returns:
    ``bn(x, scale, bias) -> (y, mean, var)``, a `jax.custom_vjp` whose backward is
    ``dx = k * (dy - sum(dy) / n - xhat * sum(dy * xhat) / n)`` (``k = scale * inv``)
    plus the statistics' cotangents, in one elementwise pass; ``fused`` and the
    native kernel differ only in how they take the sums.
  """

  def forward(x, scale, bias):
    c = x.shape[-1]
    mean, var = stats(x.reshape(-1, c))
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
    dy = dy.astype(x.dtype)
    sdy, sdyc = grad_sums(x.reshape(-1, c), dy.reshape(-1, c), mean)
    sdyxhat = sdyc * inv  # sum(dy * xhat)
    k = scale * inv
    # dx = k * (dy - sdy / n - xhat * sdyxhat / n) + dmean / n + 2 * dvar * centred / n,
    # with the per-channel terms gathered first: one elementwise pass over x.
    dx = k * dy - (k * sdy - dmean) / n - (x - mean) * ((k * inv * sdyxhat - 2 * dvar) / n)
    return dx, sdyxhat.astype(scale.dtype), sdy.astype(scale.dtype)

  bn.defvjp(forward, backward)
  return bn


@functools.cache
def _fused_fn(epsilon: float) -> Callable[..., Outputs]:
  """The custom-VJP batch norm whose sums are reductions."""

  def grad_sums(x2, dy2, mean):
    return jnp.sum(dy2, axis=0), jnp.sum(dy2 * (x2 - mean), axis=0)

  return custom_vjp_batch_norm(_stats, grad_sums, epsilon)


def fused(x: jax.Array, scale: jax.Array, bias: jax.Array, spec: BatchNormSpec) -> Outputs:
  """One-pass statistics, the fused backward formula; sums as reductions."""
  return _fused_fn(float(spec.epsilon))(x, scale, bias)


def fused_applicable(spec: BatchNormSpec, platform: str) -> bool:
  """float32/float64, at least one row and two dimensions (rows x channels)."""
  del platform
  return spec.dtype in _FUSED_DTYPES and len(spec.shape) >= 2 and spec.rows >= 1


def always(spec: Any, platform: str) -> bool:
  del spec, platform
  return True


# (name, fn, applicable), the default first.
KERNELS = (
    ("xla", xla, always),
    ("fused", fused, fused_applicable),
)
