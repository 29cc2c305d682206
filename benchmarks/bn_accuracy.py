"""Batch norm's kernels against float64, forward and backward, well- and ill-conditioned.

Every kernel of the batch-norm family, and three forms it no longer has (``fused_dot``:
each column sum as ``ones @ x``, at the default precision and at `Precision.HIGHEST`;
``fused`` with its former one-row shift), forward and backward (gradients of ``x``,
``scale`` and ``bias`` for a random cotangent on ``y``, ``mean``, ``var``) on float32
inputs, against the reference kernel in float64, by the tuner's accuracy rule
(`tunedjax.autotune._accuracy`: per output ``max |out - ref| / max(max |ref|, 1)``); the
error ratio is the largest of the six over ``xla``'s (floored at 4 float32 ulps); the
tuner accepts at most 3. Cases: centred data (32x16x16x64); large channel means (1e3 to
1e4); a long reduction (2**20 rows of 8 channels); near-constant channels.

Run: `.venv/bin/python benchmarks/run.py bn_accuracy [--quick] [--write]`.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunedjax import autotune
from tunedjax.autotune import _accuracy, _registry, _tuner
from tunedjax.ops.batch_norm import _kernels
from tunedjax.ops.batch_norm._spec import BatchNormSpec

def _one_pass(colsum: Callable[[jax.Array], jax.Array], one_row_shift: bool
              ) -> Callable[..., Any]:
  """A withdrawn form of the fused kernel: its sums `colsum`, its shift the first row or not."""

  def stats(x2):
    n = x2.shape[0]
    shift = lax.stop_gradient(x2[0] if one_row_shift else jnp.mean(x2[:64], axis=0))
    d = x2 - shift
    mean_d = colsum(d) / n
    return shift + mean_d, jnp.maximum(colsum(d * d) / n - mean_d * mean_d, 0)

  def grad_sums(x2, dy2, mean):
    return colsum(dy2), colsum(dy2 * (x2 - mean))

  @functools.cache
  def bn(epsilon):
    return _kernels.custom_vjp_batch_norm(stats, grad_sums, epsilon)

  return lambda x, scale, bias, spec: bn(float(spec.epsilon))(x, scale, bias)


def _ones_product(precision: Any) -> Callable[[jax.Array], jax.Array]:
  return lambda a: jnp.dot(jnp.ones((a.shape[0],), a.dtype), a, precision=precision)


WITHDRAWN = {
    "fused_dot (removed)": _one_pass(_ones_product(None), one_row_shift=True),
    "fused_dot, HIGHEST": _one_pass(_ones_product(lax.Precision.HIGHEST), one_row_shift=True),
    "fused, one-row shift (before)": _one_pass(lambda a: jnp.sum(a, axis=0), one_row_shift=True),
}
_WITHDRAWN_KERNELS = {n: types.SimpleNamespace(name=n, fn=f) for n, f in WITHDRAWN.items()}


def cases(quick: bool) -> dict[str, Callable[[np.random.Generator], np.ndarray]]:
  """The inputs; with `quick` all of one small shape (one compile per kernel)."""
  shape = (512, 16) if quick else (32, 16, 16, 64)
  long_shape = (512, 16) if quick else (1 << 20, 8)
  c = shape[-1]
  return {
      "centred": lambda rng: rng.normal(size=shape),
      "large channel means": lambda rng: (rng.normal(size=shape) * (0.1 + rng.random(c))
                                          + 1e3 * (1 + 9 * rng.random(c))),
      f"long reduction ({long_shape[0]} rows)": lambda rng: rng.normal(size=long_shape) + 3.0,
      "near-constant channels": lambda rng: 5.0 + 1e-3 * rng.normal(size=shape),
  }


_JITTED: dict[tuple[str, BatchNormSpec], Callable[..., Any]] = {}


def _compiled(kernel: Any, spec: BatchNormSpec) -> Callable[..., Any]:
  """The kernel's forward and backward, jitted once per spec."""
  key = (kernel.name, spec)
  if key not in _JITTED:
    _JITTED[key] = jax.jit(_tuner._timed_function(kernel, spec, "forward+backward"))
  return _JITTED[key]


def _errors(x: np.ndarray, rng: np.random.Generator) -> dict[str, tuple[float, float, float]]:
  """``{kernel: (forward error, backward error, error ratio)}`` on input `x`."""
  x = x.astype(np.float32)
  c = x.shape[-1]
  spec = BatchNormSpec.from_arrays(x)
  operands = [jnp.asarray(x), jnp.asarray(1 + rng.random(c), jnp.float32),
              jnp.asarray(rng.normal(size=c), jnp.float32)]
  cotangent = tuple(jnp.asarray(rng.normal(size=s), jnp.float32)
                    for s in (x.shape, (c,), (c,)))
  args = [cotangent, *operands]
  kernels = {k.name: k for k in _registry.applicable_kernels(spec, "cpu", op="batch_norm")}
  kernels.update({n: _WITHDRAWN_KERNELS[n] for n in WITHDRAWN})
  outputs = {n: _compiled(k, spec)(*args) for n, k in kernels.items()}
  ref = _accuracy.reference(_tuner._timed_function(kernels["xla"], spec, "forward+backward"),
                            args, outputs["xla"], platform="cpu")
  result = {}
  for name, out in outputs.items():
    errors = ref.errors(out)  # y, mean, var, then dx, dscale, dbias
    result[name] = (max(errors[:3]), max(errors[3:]), ref.ratio(out))
  return result


def measure(quick: bool = False) -> harness.Result:
  """Every case's rows: ``[case, kernel, forward error, backward error, error ratio]``."""
  autotune.op_family("batch_norm")  # registers the family's kernels
  rows = []
  for i, (case, draw) in enumerate(cases(quick).items()):
    rng = np.random.default_rng(i)
    rows += [[case, name, *e] for name, e in _errors(draw(rng), rng).items()]
  return harness.Result("bn_accuracy", params={"quick": quick}, figures={"rows": rows})


def render(result: harness.Result) -> str:
  lines = ["| case | kernel | forward error | backward error | error ratio (x `xla`'s) | "
           "accepted |", "|---|---|---:|---:|---:|---|"]
  for case, name, fwd, bwd, ratio in result.figures["rows"]:
    ok = "yes" if ratio <= _accuracy.ERROR_RATIO_LIMIT else "**no**"
    lines.append(f"| {case} | `{name}` | {fwd:.1e} | {bwd:.1e} | {ratio:.2f} | {ok} |")
  return "\n".join([
      "## Batch norm against float64 (`benchmarks/bn_accuracy.py`)", "",
      "Each batch-norm kernel's error against the reference kernel run in float64, forward "
      "(`y`, `mean`, `var`) and backward (the three gradients for a random cotangent), as "
      "the tuner's accuracy rule measures it; ratios over `xla`'s error, at most "
      f"{_accuracy.ERROR_RATIO_LIMIT:g} accepted. The last three rows of each case are no "
      "longer kernels: `fused_dot` took its sums as products with ones (removed), once more "
      "at `Precision.HIGHEST`, and `fused` before its shift became the mean of the first "
      "64 rows. " + result.machine, "",
      "Command: `.venv/bin/python benchmarks/run.py bn_accuracy --write`"
      + (" --quick" if result.params["quick"] else ""), "",
      *lines,
  ])
