"""A pass that removes what other passes leave behind: redundant casts and transposes.

Passes compose: autocast casts an operand that a layout region already
transposed, a layout region ends where the next one begins. Each pass is
simple because this one runs after them all and folds, exactly:

- a cast to the dtype (and weak type) a value already has: removed;
- a cast of a cast, ``convert(convert(x, b), c)``, when the first cast is
  exact (``b`` holds every value of ``x``'s dtype, e.g. bfloat16 -> float32):
  one cast ``convert(x, c)``, or ``x`` itself when ``c`` is ``x``'s dtype. A
  rounding cast (float32 -> bfloat16 -> float32) is kept: it is what the
  program means;
- a transpose of a transpose: one transpose with the composed permutation,
  or none when it is the identity; an identity transpose: removed.

Nothing here changes a value, so the result is bitwise the input's.
Constant folding, CSE and fusion are XLA's job and are not repeated here.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import rewrite
  >>> from tunedjax.rewrite._cleanup import cleanup_pass
  >>> f = lambda x: jnp.transpose(jnp.transpose(x.astype(jnp.float32))).astype(jnp.bfloat16)
  >>> x = jnp.ones((2, 3), jnp.bfloat16)
  >>> cleaned = jax.make_jaxpr(rewrite.transform(f, cleanup_pass()))(x)
  >>> cleaned.jaxpr.outvars == cleaned.jaxpr.invars  # x itself: nothing left to do
  True
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from tunedjax.rewrite import _compat
from tunedjax.rewrite._engine import Context
from tunedjax.rewrite._engine import Pass

CONVERT = "convert_element_type"
TRANSPOSE = "transpose"


def exact_cast(src: Any, dst: Any) -> bool:
  """Whether casting floating dtype `src` to floating dtype `dst` loses nothing.

  Example:
    >>> exact_cast(jnp.bfloat16, jnp.float32), exact_cast(jnp.float32, jnp.bfloat16)
    (True, False)
  """
  src, dst = np.dtype(src), np.dtype(dst)
  if src == dst:
    return True
  if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
    return False
  a, b = jnp.finfo(src), jnp.finfo(dst)
  return (int(a.nmant) <= int(b.nmant) and int(a.maxexp) <= int(b.maxexp)
          and int(a.minexp) >= int(b.minexp))


class _Producers:
  """Which cast or transpose produced a value, within one trace.

  Keyed by ``id`` with the value itself kept alive, so ids stay unique.
  """

  def __init__(self):
    self._by_id: dict[int, tuple[Any, str, Any, Any]] = {}

  def record(self, out: Any, kind: str, source: Any, how: Any) -> None:
    self._by_id[id(out)] = (out, kind, source, how)

  def get(self, value: Any, kind: str) -> tuple[Any, Any] | None:
    hit = self._by_id.get(id(value))
    if hit is None or hit[0] is not value or hit[1] != kind:
      return None
    return hit[2], hit[3]


def _aval(x: Any) -> Any:
  return _compat.typeof(x)


def cleanup_pass() -> Pass:
  """A fresh cleanup `Pass` (its bookkeeping lives for one use).

  Counts ``"casts to the same dtype removed"``, ``"cast pairs folded"``,
  ``"transposes removed"`` and ``"transpose pairs folded"``.
  """
  producers = _Producers()

  def convert_rule(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
    (x,) = invals
    new_dtype, weak = np.dtype(eqn.params["new_dtype"]), bool(eqn.params.get("weak_type", False))
    have = _aval(x)
    if have.dtype == new_dtype and bool(getattr(have, "weak_type", False)) == weak:
      ctx.count("casts to the same dtype removed")
      return [x]
    earlier = producers.get(x, CONVERT)
    if earlier is not None:
      source, _ = earlier
      src_aval = _aval(source)
      if exact_cast(src_aval.dtype, have.dtype):
        ctx.count("cast pairs folded")
        if src_aval.dtype == new_dtype and bool(getattr(src_aval, "weak_type", False)) == weak:
          return [source]
        x = source
    (out,) = ctx.bind(eqn, [x])
    producers.record(out, CONVERT, x, None)
    return [out]

  def transpose_rule(ctx: Context, eqn: Any, invals: list[Any]) -> list[Any]:
    (x,) = invals
    perm = tuple(eqn.params["permutation"])
    earlier = producers.get(x, TRANSPOSE)
    if earlier is not None:
      source, first = earlier
      perm = tuple(first[i] for i in perm)
      x = source
      ctx.count("transpose pairs folded")
    if perm == tuple(range(len(perm))):
      ctx.count("transposes removed")
      return [x]
    (out,) = ctx.bind(eqn, [x], permutation=perm)
    producers.record(out, TRANSPOSE, x, perm)
    return [out]

  return Pass("cleanup", {CONVERT: convert_rule, TRANSPOSE: transpose_rule})
