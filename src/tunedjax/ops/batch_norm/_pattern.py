"""Batch norm written out in primitives, found as a ``"batch_norm"`` site (`find`).

Training-mode batch norm over every axis but one channel axis (channels
last or first, any rank), in the usual spellings:

- the statistics: two passes (the mean, then the mean of squared
  deviations), ``jnp.var``, or ``E[x^2] - E[x]^2`` (squares as ``x * x``,
  ``x ** 2`` or ``jnp.square``; means as ``jnp.mean`` or a sum divided by or
  multiplied with the count), upcast for low-precision inputs or not;
- the normalisation: ``(x - mean) * rsqrt(var + eps)`` or
  ``(x - mean) / sqrt(var + eps)``, epsilon a literal of the jaxpr;
- the affine part: ``* scale + bias``, either one, or none (the kernel then
  gets ones and zeros, and no cotangent flows to them).

The batch's mean and variance may be read elsewhere (a running-average
update) where the kernel's own statistics can stand in for them (a
per-channel vector of the input's dtype, the biased variance). Inference
with running statistics (mean and variance given, not computed from the
input) is not a site, nor is a mean over other axes or of another tensor.

The channel axis is moved last for the kernel (`BatchNormSpec` is channels
last) and back after it.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def bn(x, s, b):
  ...   m = x.mean((0, 1, 2)); v = ((x - m) ** 2).mean((0, 1, 2))
  ...   return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b
  >>> jaxpr = jax.make_jaxpr(bn)(jnp.ones((2, 3, 3, 4)), jnp.ones(4), jnp.ones(4)).jaxpr
  >>> [(s.spelling, s.spec.shape, s.spec.epsilon) for s in find(None, jaxpr)]
  [('two-pass rsqrt affine', (2, 3, 3, 4), 1e-05)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import jax.extend.core as jex_core
import numpy as np

from tunedjax import autotune
from tunedjax.ops.batch_norm._spec import BatchNormSpec

NAME = "batch_norm"
_CALLS = ("jit", "pjit")
_SHAPE_ONLY = ("broadcast_in_dim", "reshape", "convert_element_type")


def _lit(v: Any) -> float | None:
  if isinstance(v, jex_core.Literal) and np.ndim(v.val) == 0:
    return float(v.val)
  return None


class _Graph:
  """One jaxpr's dataflow, and the building blocks of a batch norm in it."""

  def __init__(self, jaxpr: Any):
    self.jaxpr = jaxpr
    self.defs: dict[Any, int] = {}
    self.readers: dict[Any, list[int]] = {}
    for i, e in enumerate(jaxpr.eqns):
      for v in e.outvars:
        self.defs[v] = i
      for v in e.invars:
        if not isinstance(v, jex_core.Literal):
          self.readers.setdefault(v, []).append(i)

  def eqn(self, v: Any, *names: str) -> tuple[int, Any] | None:
    """The equation defining `v`, if it is one of `names`."""
    i = self.defs.get(v) if not isinstance(v, jex_core.Literal) else None
    if i is None or self.jaxpr.eqns[i].primitive.name not in names:
      return None
    return i, self.jaxpr.eqns[i]

  def strip(self, v: Any, used: list[int], names: Sequence[str] = _SHAPE_ONLY) -> Any:
    """`v` before any chain of `names` equations (recorded in `used`)."""
    while (hit := self.eqn(v, *names)) is not None:
      used.append(hit[0])
      v = hit[1].invars[0]
    return v

  def channel_vector(self, v: Any, used: list[int], channel: int, shape: tuple[int, ...]
                     ) -> Any | None:
    """The per-channel vector `v` broadcasts along axis `channel` of `shape`, or None."""
    chain: list[Any] = []
    base = v
    while (hit := self.eqn(base, *_SHAPE_ONLY)) is not None:
      chain.append(hit)
      base = hit[1].invars[0]
    if isinstance(base, jex_core.Literal):
      return None
    dims = [d for d, n in enumerate(base.aval.shape) if n != 1]
    if len(dims) != 1 or base.aval.shape[dims[0]] != shape[channel]:
      return None
    pos = dims[0]
    for _, e in reversed(chain):
      out_shape = e.outvars[0].aval.shape
      if e.primitive.name == "broadcast_in_dim":
        pos = e.params["broadcast_dimensions"][pos]
      elif e.primitive.name == "reshape":
        dims = [d for d, n in enumerate(out_shape) if n != 1]
        if len(dims) != 1:
          return None
        pos = dims[0]
    final = v.aval.shape
    if (len(final) != len(shape) or pos != channel
        or any(n not in (1, shape[d]) for d, n in enumerate(final))):
      return None
    used.extend(i for i, _ in chain)
    return base

  def mean(self, v: Any, used: list[int]) -> tuple[Any, tuple[int, ...]] | None:
    """``(x, axes)`` if `v` is the mean of `x` over `axes` (sum over count)."""
    mine: list[int] = []
    v = self.strip(v, mine, ("convert_element_type",))
    hit = self.eqn(v, "div", "mul")
    if hit is None:
      return None
    i, e = hit
    a, n = e.invars
    if e.primitive.name == "mul" and _lit(a) is not None:
      a, n = n, a
    factor = _lit(n)
    if factor is None:
      return None
    mine.append(i)
    total = self.eqn(self.strip(a, mine), "reduce_sum")
    if total is None:
      return None
    mine.append(total[0])
    axes = tuple(total[1].params["axes"])
    x = self.strip(total[1].invars[0], mine, ("convert_element_type",))
    count = math.prod(x.aval.shape[d] for d in axes)
    want = count if e.primitive.name == "div" else 1.0 / count
    if not math.isclose(factor, want, rel_tol=1e-6):
      return None
    used.extend(mine)
    return x, axes

  def square(self, v: Any, used: list[int]) -> Any | None:
    """`a` if `v` is ``a * a``, ``a ** 2`` or ``square(a)``."""
    mine: list[int] = []
    v = self.strip(v, mine, ("convert_element_type",))
    hit = self.eqn(v, "mul", "integer_pow", "square")
    if hit is None:
      return None
    i, e = hit
    if e.primitive.name == "mul" and e.invars[0] is not e.invars[1]:
      twin = self.twin(e.invars[0], e.invars[1])
      if twin is None:
        return None
      mine.append(twin)
    if e.primitive.name == "integer_pow" and e.params["y"] != 2:
      return None
    used.extend([*mine, i])
    return e.invars[0]

  def twin(self, a: Any, b: Any) -> int | None:
    """The equation defining `b` if it computes what `a`'s does (``(x - m) * (x - m)``
    written with two subtractions), else None."""
    ea, eb = self.eqn(a, "sub"), self.eqn(b, "sub")
    if ea is None or eb is None:
      return None
    same = lambda u, v: u is v or (self.eqn(u, *_SHAPE_ONLY) is not None
                                   and self.eqn(v, *_SHAPE_ONLY) is not None
                                   and self.strip(u, []) is self.strip(v, []))
    if all(same(u, v) for u, v in zip(ea[1].invars, eb[1].invars)):
      return eb[0]
    return None

  def centered(self, v: Any, used: list[int], channel_of: Any) -> tuple[Any, Any] | None:
    """``(x, axes)`` if `v` is ``x - mean(x, axes)`` (the mean broadcast along a channel)."""
    hit = self.eqn(v, "sub")
    if hit is None:
      return None
    i, e = hit
    x, m = e.invars
    if isinstance(x, jex_core.Literal):
      return None
    mine = [i]
    found = self.mean(self.strip(m, mine, ("broadcast_in_dim", "reshape")), mine)
    if found is None or found[0] is not x:
      return None
    channel = channel_of(x, found[1])
    if channel is None or self.channel_vector(m, [], channel, x.aval.shape) is None:
      return None
    used.extend(mine)
    return x, found[1]


def _channel(x: Any, axes: Sequence[int]) -> int | None:
  """The one axis of `x` not in `axes`, if the statistics are over all the others."""
  rest = [d for d in range(len(x.aval.shape)) if d not in axes]
  if len(rest) != 1 or len(set(axes)) != len(axes) or x.aval.shape[rest[0]] < 2:
    return None
  return rest[0]


def _variance(g: _Graph, v: Any, used: list[int]) -> tuple[Any, tuple[int, ...], str] | None:
  """``(x, axes, spelling)`` if `v` is the biased variance of `x` over `axes`."""
  mine: list[int] = []
  v = g.strip(v, mine, ("convert_element_type", "broadcast_in_dim", "reshape"))
  call = g.eqn(v, *_CALLS)
  if call is not None and call[1].params.get("name") == "_var" and v is call[1].outvars[0]:
    e = call[1]
    sums = [s for s in e.params["jaxpr"].jaxpr.eqns if s.primitive.name == "reduce_sum"]
    if (len(e.invars) == 2 and _lit(e.invars[1]) == 0.0 and sums
        and len({tuple(s.params["axes"]) for s in sums}) == 1):
      used.extend([*mine, call[0]])
      return e.invars[0], tuple(sums[0].params["axes"]), "jnp.var"
    return None
  sub = g.eqn(v, "sub")
  if sub is not None:  # E[x^2] - E[x]^2
    a, b = sub[1].invars
    m2, m1 = [*mine, sub[0]], []
    ex2 = g.mean(a, m2)
    sq = g.square(b, m1)
    ex = g.mean(sq, m1) if sq is not None else None
    if ex2 is not None and ex is not None:
      x2 = g.square(ex2[0], m2)
      if x2 is not None and x2 is ex[0] and ex2[1] == ex[1]:
        used.extend([*m2, *m1])
        return ex[0], ex[1], "E[x^2]-E[x]^2"
    return None
  found = g.mean(v, mine)  # two passes: the mean of squared deviations
  if found is None:
    return None
  d = g.square(found[0], mine)
  centered = g.centered(d, mine, _channel) if d is not None else None
  if centered is None or centered[1] != found[1]:
    return None
  used.extend(mine)
  return centered[0], centered[1], "two-pass"


def _affine(g: _Graph, y: Any, used: list[int], channel: int, shape: tuple[int, ...],
            op: str) -> tuple[Any, Any]:
  """``(new y, vector)`` if a reader of `y` is ``y op vector``; else ``(y, None)``."""
  if y in g.jaxpr.outvars:
    return y, None
  for r in g.readers.get(y, []):
    e = g.jaxpr.eqns[r]
    if e.primitive.name != op or e.outvars[0].aval.shape != shape:
      continue
    other = e.invars[1] if e.invars[0] is y else e.invars[0]
    mine = [r]
    base = g.channel_vector(other, mine, channel, shape)
    if base is not None and base is not y:
      used.extend(mine)
      return e.outvars[0], base
  return y, None


def _normalised(g: _Graph, i: int) -> tuple[Any, list[int], tuple[Any, ...], str, float] | None:
  """From a ``rsqrt``/``sqrt`` equation: ``(normalised value, equations, (x, axes),
  spelling, epsilon)``, or None."""
  e = g.jaxpr.eqns[i]
  used = [i]
  add = g.eqn(g.strip(e.invars[0], used, ("broadcast_in_dim", "reshape")), "add")
  if add is None:
    return None
  a, b = add[1].invars
  eps, v = (_lit(b), a) if _lit(b) is not None else (_lit(a), b)
  if eps is None or eps < 0:
    return None
  if np.dtype(e.outvars[0].aval.dtype).itemsize <= 4:  # 1e-5, not its float32 rounding
    eps = float(str(np.float32(eps)))
  used.append(add[0])
  var = _variance(g, v, used)
  if var is None:
    return None
  x, axes, spelling = var
  channel = _channel(x, axes)
  if channel is None:
    return None
  for r in g.readers.get(e.outvars[0], []):
    out = _scaled_by(g, r, e.outvars[0], x, axes, channel,
                     "mul" if e.primitive.name == "rsqrt" else "div")
    if out is not None:
      y, mine = out
      how = "rsqrt" if e.primitive.name == "rsqrt" else "sqrt-div"
      return y, [*used, *mine], (x, axes), f"{spelling} {how}", eps
  return None


def _scaled_by(g: _Graph, r: int, inv: Any, x: Any, axes: Any, channel: int,
               op: str) -> tuple[Any, list[int]] | None:
  """``(x - mean) op inv`` reached from `inv`'s reader `r` (through its broadcast)."""
  e = g.jaxpr.eqns[r]
  if e.primitive.name in ("broadcast_in_dim", "reshape"):
    for r2 in g.readers.get(e.outvars[0], []):
      found = _scaled_by(g, r2, inv, x, axes, channel, op)
      if found is not None:
        return found[0], [r, *found[1]]
    return None
  if e.primitive.name != op or e.outvars[0].aval.shape != x.aval.shape:
    return None
  d, w = e.invars
  if op == "mul" and g.strip(w, []) is not inv:
    d, w = w, d
  if g.strip(w, []) is not inv or g.channel_vector(w, [], channel, x.aval.shape) is None:
    return None
  mine: list[int] = []
  centered = g.centered(d, mine, _channel)
  if centered is None or centered[0] is not x or centered[1] != axes:
    return None
  return e.outvars[0], [*mine, r]


def _stat_output(g: _Graph, used: set[int], x: Any, axes: Any, kind: str) -> Any | None:
  """A per-channel mean (or variance) among `used` that the kernel can supply."""
  for i in sorted(used):
    for v in g.jaxpr.eqns[i].outvars:
      if v.aval.shape != (x.aval.shape[_channel(x, axes)],) or v.aval.dtype != x.aval.dtype:
        continue
      found = g.mean(v, []) if kind == "mean" else _variance(g, v, [])
      if found is not None and found[0] is x and tuple(found[1]) == tuple(axes):
        return v
  return None


def _read_outside(g: _Graph, used: set[int]) -> set[Any]:
  defined = {v for i in used for v in g.jaxpr.eqns[i].outvars}
  out = {v for v in defined for r in g.readers.get(v, []) if r not in used}
  return out | {v for v in g.jaxpr.outvars if v in defined}


def _site(g: _Graph, i: int) -> autotune.PatternSite | None:
  found = _normalised(g, i)
  if found is None:
    return None
  y, used, (x, axes), spelling, eps = found
  channel = _channel(x, axes)
  shape = x.aval.shape
  y, scale = _affine(g, y, used, channel, shape, "mul")
  y, bias = _affine(g, y, used, channel, shape, "add")
  spelling += " affine" if scale is not None and bias is not None else (
      " scale" if scale is not None else " bias" if bias is not None else "")
  eqns = set(used)
  outputs, stats = [y], []
  outside = _read_outside(g, eqns) - {y}
  for kind in ("mean", "var"):
    v = _stat_output(g, eqns, x, axes, kind)
    if v is not None and v in outside:
      outputs.append(v)
      stats.append(1 if kind == "mean" else 2)
  inputs = tuple(v for v in (x, scale, bias) if v is not None)
  perm = [d for d in range(len(shape)) if d != channel] + [channel]
  spec = BatchNormSpec(tuple(shape[d] for d in perm), np.dtype(x.aval.dtype).name, eps)
  call = _caller(perm, channel, scale is not None, bias is not None, stats, y.aval.dtype)
  return autotune.PatternSite(NAME, spec, tuple(sorted(eqns)), inputs, tuple(outputs), call,
                              spelling)


def _caller(perm: list[int], channel: int, has_scale: bool, has_bias: bool,
            stats: list[int], y_dtype: Any) -> Any:
  """How to call a batch-norm kernel (channels last) on the site's inputs."""
  inverse = list(np.argsort(perm))

  def call(kernel: Any, x: Any, *vectors: Any) -> tuple[Any, ...]:
    c = x.shape[channel]
    given = list(vectors)
    scale = given.pop(0).astype(x.dtype) if has_scale else jnp.ones((c,), x.dtype)
    bias = given.pop(0).astype(x.dtype) if has_bias else jnp.zeros((c,), x.dtype)
    xt = x if perm == sorted(perm) else jnp.transpose(x, perm)
    outs = kernel(xt, scale, bias)
    y = outs[0] if perm == sorted(perm) else jnp.transpose(outs[0], inverse)
    return (y.astype(y_dtype), *(outs[k] for k in stats))

  return call


def find(ctx: Any, jaxpr: Any) -> list[autotune.PatternSite]:
  """The batch norms written out in `jaxpr` (the family's pattern).

  Args:
    ctx: the rewrite engine's context (unused).
    jaxpr: an open jaxpr.

  Returns:
    One `autotune.PatternSite` per batch norm found, each anchored at its
    ``rsqrt`` or ``sqrt``.
  """
  del ctx
  names = [e.primitive.name for e in jaxpr.eqns]
  if "rsqrt" not in names and "sqrt" not in names:
    return []
  g = _Graph(jaxpr)
  sites = []
  for i, name in enumerate(names):
    if name in ("rsqrt", "sqrt"):
      site = _site(g, i)
      if site is not None:
        sites.append(site)
  return sites
