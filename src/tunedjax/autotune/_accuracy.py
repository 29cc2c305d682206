"""The accuracy rule: no candidate kernel may be less accurate than the default.

Every op family is judged by the same rule. For a bucket with candidates to
check, the tuner computes a *reference* of the same call (the output, and
for a ``"forward+backward"`` family the gradients for the same cotangent) at
a higher precision than the bucket's, once: in float64 where the platform
has it (CPU and GPU; under `jax.enable_x64`, scoped to the call, so nothing
outside it changes), else in float32 with every product at
`Precision.HIGHEST`. The function run is the family's `OpFamily.precise`,
or by default its default kernel's, on the floating operands upcast.

Each output leaf's *error* is ``max |out - ref| / max(max |ref|, 1)``: the
largest difference in units of the leaf's largest magnitude, or absolute
where that is below 1 (the tuner draws operands of order 1, so a leaf near
zero, such as the mean of centred data, is judged on the scale of the data
it came from). A candidate's *error ratio* is, over the leaves, the largest
of its error over the default's error on the same leaf, the default's error
floored at `FLOOR_ULPS` units in the last place of the leaf's dtype (a
default that happens to be exact does not make one rounding a failure). A
candidate is accepted when its error ratio is at most `ERROR_RATIO_LIMIT`.

Most candidates agree with the default to within a few units in the last
place, and then no reference is needed: by the triangle inequality a
candidate's error is at most the default's plus its distance from the
default, so a distance of at most ``(ERROR_RATIO_LIMIT - 1)`` floors proves
the error ratio within the limit, whatever the reference would have been
(`agreement_bound`, with `AGREEMENT_SLACK` for the default's outputs
standing in for the reference's scale). The tuner computes the reference
only where some candidate is further from the default than that: in the
demo's first run, 2 of 42 buckets.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> x = np.random.default_rng(0).normal(size=(4096, 8)).astype(np.float32) + 100
  >>> total = lambda x: jnp.sum(x, 0)
  >>> ref = reference(total, [x], total(x), platform="cpu")
  >>> ref.dtype, ref.ratio(total(x)) <= 1.0  # the default's own ratio
  ('float64', True)
  >>> in_bfloat16 = jnp.sum(jnp.asarray(x, jnp.bfloat16), 0).astype(jnp.float32)
  >>> ref.ratio(in_bfloat16) > ERROR_RATIO_LIMIT
  True
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax import _tuning

logger = logging.getLogger("tunedjax.autotune")

ERROR_RATIO_LIMIT = 3.0
"""The most a candidate's error against the reference may be, in multiples of the default's."""

FLOOR_ULPS = 4.0
"""Errors below this many units in the last place (of the leaf's dtype) count as this many."""

AGREEMENT_SLACK = 0.05
"""The share of `agreement_bound`'s margin kept for the scale it reads from the default's
outputs instead of the reference's."""

# The widest machine epsilon `agreement_bound` proves anything for (bfloat16's): the
# default's scale standing in for the reference's needs its floor under 2**-5.
_AGREEMENT_EPS = 2.0**-7

# Platforms whose backends run float64 (TPUs do not).
_FLOAT64_PLATFORMS = ("cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class Reference:
  """A bucket's high-precision reference and the default kernel's error against it.

  Attributes:
    leaves: the reference's output leaves (float64 NumPy arrays).
    dtype: what it was computed in: ``"float64"``, or ``"float32"`` with
      every product at `Precision.HIGHEST`.
    default_errors: the default kernel's error on each leaf (`leaf_error`).
    scales: ``max |leaf|`` of each reference leaf (computed once, not per
      candidate); empty: computed by each `leaf_error`.
  """

  leaves: tuple[np.ndarray, ...]
  dtype: str
  default_errors: tuple[float, ...]
  scales: tuple[float | None, ...] = ()

  def ratio(self, out: Any) -> float:
    """The error ratio of outputs `out` (inf on a structure or shape mismatch, or NaN).

    Over the leaves, the largest of ``error(out) / max(default's error, floor)``.
    """
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) != len(self.leaves):
      return math.inf
    ratios = [leaf_error(o, r, s) / max(d, floor(o))
              for o, r, d, s in zip(leaves, self.leaves, self.default_errors, self._scales())]
    return max(ratios, default=0.0)

  def errors(self, out: Any) -> list[float]:
    """`leaf_error` of each leaf of `out` (for reports and tests)."""
    return [leaf_error(o, r, s) for o, r, s in
            zip(jax.tree_util.tree_leaves(out), self.leaves, self._scales())]

  def _scales(self) -> tuple[float | None, ...]:
    return self.scales or (None,) * len(self.leaves)


def floor(leaf: Any) -> float:
  """`FLOOR_ULPS` units in the last place of `leaf`'s dtype, as an error.

  Example:
    >>> floor(np.zeros(2, np.float32)) == 4 * float(np.finfo(np.float32).eps)
    True
  """
  dtype = np.dtype(getattr(leaf, "dtype", np.float64))
  if not jnp.issubdtype(dtype, jnp.inexact):
    return FLOOR_ULPS * float(np.finfo(np.float32).eps)
  return FLOOR_ULPS * float(jnp.finfo(dtype).eps)


def leaf_error(out: Any, ref: np.ndarray, scale: float | None = None) -> float:
  """``max |out - ref| / max(max |ref|, 1)`` in float64 (inf for a shape mismatch or NaN).

  Args:
    out: a candidate's output leaf.
    ref: the reference leaf (float64).
    scale: ``max |ref|`` where the caller knows it (`Reference` keeps it).

  Example:
    >>> leaf_error(np.array([1.0, 2.5]), np.array([1.0, 2.0]))
    0.25
    >>> leaf_error(np.array([1e-3]), np.array([2e-3]))  # below 1: absolute
    0.001
  """
  out = np.asarray(out)
  if out.shape != ref.shape:
    return math.inf
  if not ref.size:
    return 0.0
  err = _tuning.max_abs_difference(out, ref, np.float64)
  if not math.isfinite(err):
    return math.inf
  if scale is None:
    scale = _tuning.max_abs_difference(ref, None, np.float64)
  return err / max(scale, 1.0)


def agreement_bound(out: Any, default_out: Any,
                    scales: Sequence[float] | None = None) -> float:
  """An upper bound on `out`'s error ratio read from its distance to the default's outputs.

  For each leaf, with ``d`` the distance ``max |out - default| / max(max |default|, 1)``
  and ``f`` the floor (`floor`): the error ratio is at most ``1 + d / ((1 - s) f)``
  (``s`` = `AGREEMENT_SLACK`), because the candidate's error is at most the
  default's plus its distance from the default, the default's error counts
  as at least ``f``, and the default's largest magnitude differs from the
  reference's by less than the slack allows for. So a bound at most
  `ERROR_RATIO_LIMIT` accepts the candidate without a reference.

  Args:
    out: the candidate's outputs.
    default_out: the default kernel's outputs, same structure.
    scales: ``max |leaf|`` of each default leaf, where the caller keeps them.

  Returns:
    The largest bound over the leaves; inf where the structures or shapes
    differ, a value is not finite, or a leaf's dtype is coarser than
    bfloat16 (float8: no bound is proved there).

  Example:
    >>> d = np.linspace(-2, 2, 101, dtype=np.float32)
    >>> agreement_bound(d, d)
    1.0
    >>> agreement_bound(d + 2 * np.finfo(np.float32).eps, d) <= ERROR_RATIO_LIMIT
    True
    >>> agreement_bound(d.astype(np.float16).astype(np.float32), d) > ERROR_RATIO_LIMIT
    True
  """
  outs, defaults = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(default_out)
  if len(outs) != len(defaults):
    return math.inf
  scales = scales or [None] * len(defaults)
  worst = 1.0 if outs else 0.0
  for o, d, scale in zip(outs, defaults, scales):
    dtype = np.dtype(getattr(o, "dtype", np.float64))
    if jnp.issubdtype(dtype, jnp.inexact) and float(jnp.finfo(dtype).eps) > _AGREEMENT_EPS:
      return math.inf
    distance = leaf_error(o, np.asarray(d), scale)
    if not math.isfinite(distance):
      return math.inf
    worst = max(worst, 1.0 + distance / ((1.0 - AGREEMENT_SLACK) * floor(o)))
  return worst


def has_float64(platform: str) -> bool:
  """Whether `platform`'s backend computes in float64 (CPU and GPU do, TPUs do not).

  Example:
    >>> has_float64("cpu"), has_float64("tpu")
    (True, False)
  """
  return platform in _FLOAT64_PLATFORMS


def _upcast(args: Sequence[Any], dtype: Any) -> list[Any]:
  """The floating arrays in `args` (pytrees) as `dtype` arrays on their devices; the
  others as they are."""

  def one(a: Any) -> Any:
    if not jnp.issubdtype(a.dtype, jnp.floating):
      return a
    devices = getattr(a, "devices", None)
    device = next(iter(devices())) if callable(devices) else None
    return jax.device_put(np.asarray(a, dtype=dtype), device)

  return [jax.tree_util.tree_map(one, a) for a in args]


def _run(function: Callable[..., Any], args: Sequence[Any], dtype: str) -> list[np.ndarray]:
  """`function` on `args` upcast to `dtype`, its products at HIGHEST; the output leaves."""
  with jax.default_matmul_precision("highest"):
    if dtype == "float64":
      with jax.enable_x64(True):
        out = jax.jit(function)(*_upcast(args, np.float64))
        return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(out)]
    out = jax.jit(function)(*_upcast(args, np.float32))
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(out)]


def reference(function: Callable[..., Any], args: Sequence[Any], default_out: Any, *,
              platform: str, label: str = "") -> Reference | None:
  """The high-precision reference of one call, and the default's error against it.

  Args:
    function: what the tuner checks (``f(*args)``; for ``"forward+backward"``
      families, the output and the gradients), built on the family's
      `OpFamily.precise` or its default kernel.
    args: the tuner's arguments for it (floating ones are upcast).
    default_out: the default kernel's result on `args`.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    label: the bucket's name, for the log line.

  Returns:
    The `Reference`, or None when there is no higher precision to compare
    with (the default's outputs are float64 already) or computing it failed
    (logged: candidates are then held to the family's tolerance alone).
  """
  outs = jax.tree_util.tree_leaves(default_out)
  wide = has_float64(platform)
  if wide and all(np.dtype(o.dtype) == np.float64 for o in outs):
    return None
  tries = ("float64", "float32") if wide else ("float32",)
  problem: BaseException | None = None
  for dtype in tries:
    try:
      leaves = _run(function, args, dtype)
    except Exception as e:  # pylint: disable=broad-except  # a family without float64
      problem = e
      continue
    if len(leaves) != len(outs) or any(l.shape != o.shape for l, o in zip(leaves, outs)):
      problem = ValueError(f"its outputs {[l.shape for l in leaves]} do not match the "
                           f"default's {[o.shape for o in outs]}")
      continue
    scales = tuple(_tuning.max_abs_difference(r, None, np.float64) for r in leaves)
    return Reference(tuple(leaves), dtype,
                     tuple(leaf_error(o, r, s) for o, r, s in zip(outs, leaves, scales)), scales)
  logger.warning("autotune %s: no high-precision reference (%s: %s); candidates are "
                 "checked against the default's tolerance alone.", label,
                 type(problem).__name__, str(problem).splitlines()[0][:200] if str(problem)
                 else "")
  return None


def none_passed(default: str, error_ratios: Mapping[str, float],
                rejected: Collection[str]) -> str:
  """The reason the default stays when no other candidate passed the checks.

  Example:
    >>> none_passed("xla", {"bf16": 250.0, "ok": 1.2}, {"bf16"})  # doctest: +ELLIPSIS
    "no other candidate passed the checks (error ratio ...: bf16 250x; at most 3x allowed)"
  """
  less_accurate = [f"{n} {r:.3g}x" for n, r in error_ratios.items()
                   if n in rejected and r > ERROR_RATIO_LIMIT]
  if not less_accurate:
    return "no other candidate passed the checks"
  return (f"no other candidate passed the checks (error ratio against the high-precision "
          f"reference, over {default}'s: {', '.join(less_accurate)}; at most "
          f"{ERROR_RATIO_LIMIT:g}x allowed)")
