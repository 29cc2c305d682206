"""A flat view of a jaxpr for the attention pattern: calls seen through, constants known.

`jnp.where`, `jnp.tril` and `jax.nn.softmax` (a ``custom_jvp_call`` where
``jax_softmax_custom_jvp`` is on) put their equations inside nested calls.
`FlatView` lists the equations of a jaxpr with the bodies of its plain calls
and ``custom_jvp_call``s in their place, each flat equation remembering the
top-level equation it belongs to (its ``owner``): a pattern recognises the
inner equations but replaces the owner whole. A call's outputs are the
top-level variables, so values the pattern reads are variables of the jaxpr
it was given. `FlatView.constant` evaluates a value that no input of the
jaxpr reaches (an ``iota`` comparison, ``jnp.tril`` of ones), once.

Example:
  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(lambda x: jnp.where(jnp.tril(jnp.ones((3, 3), bool)), x, 0.))(
  ...     jnp.ones((3, 3)))
  >>> view = FlatView(closed.jaxpr)
  >>> [e.name for e in view.eqns][-1]
  'select_n'
  >>> view.constant(view.eqns[-1].ins[0]).astype(int).tolist()
  [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from tunedjax.rewrite import _compat

MAX_CONSTANT = 1 << 24  # elements: a larger constant is not evaluated at trace time


@dataclasses.dataclass(frozen=True, eq=False)
class FlatEqn:
  """One equation of the flat view.

  Attributes:
    eqn: the original equation (in the jaxpr or in a call's body).
    ins: its operands, as flat variables (top-level where they cross a call).
    outs: its results, as flat variables.
    owner: the index of the top-level equation it belongs to.
  """

  eqn: Any
  ins: tuple[Any, ...]
  outs: tuple[Any, ...]
  owner: int

  @property
  def name(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self) -> Any:
    return self.eqn.params


def _body(eqn: Any) -> Any:
  """The closed body of a call the view sees through, or None."""
  if eqn.primitive.name == "custom_jvp_call":
    return eqn.params.get("call_jaxpr")
  if _compat.is_plain_call(eqn):
    return _compat.call_body(eqn)
  return None


class FlatView:
  """The flat equations of `jaxpr`, who defines and who reads each value.

  `consts` gives the values of constants of `jaxpr` known to be constant
  (`constant` returns them); other inputs and constants are not constant.
  """

  def __init__(self, jaxpr: Any, consts: Mapping[Any, Any] | None = None):
    self.jaxpr = jaxpr
    self.eqns: list[FlatEqn] = []
    self.top = set(jaxpr.invars) | set(jaxpr.constvars)
    self.inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    self._consts: dict[Any, np.ndarray] = {}  # body consts and evaluated constants
    self._not_constant: set[Any] = set()
    for v, c in (consts or {}).items():
      if not isinstance(c, jax.core.Tracer):
        self._consts[v] = np.asarray(c)
    for i, eqn in enumerate(jaxpr.eqns):
      self.top.update(v for v in eqn.outvars if not isinstance(v, _compat.DropVar))
      self._add(eqn, list(eqn.invars), list(eqn.outvars), i, depth=0)
    self.defs = {v: e for e in self.eqns for v in e.outs}
    self.readers: dict[Any, list[FlatEqn]] = {}
    for e in self.eqns:
      for v in e.ins:
        if not isinstance(v, _compat.Literal):
          self.readers.setdefault(v, []).append(e)
    self.outvars = set(v for v in jaxpr.outvars if not isinstance(v, _compat.Literal))

  def _add(self, eqn: Any, ins: list[Any], outs: list[Any], owner: int, depth: int) -> None:
    body = _body(eqn) if depth < 8 else None
    if body is None or len(body.jaxpr.invars) != len(ins):
      self.eqns.append(FlatEqn(eqn, tuple(ins), tuple(outs), owner))
      return
    sub: dict[Any, Any] = dict(zip(body.jaxpr.invars, ins))
    for v, c in zip(body.jaxpr.constvars, body.consts):
      sub[v] = v
      if not isinstance(c, jax.core.Tracer):
        self._consts[v] = c
    # The body's results are the call's (top-level) variables.
    out_of = {}
    for inner, outer in zip(body.jaxpr.outvars, outs):
      if isinstance(inner, _compat.Literal) or inner in sub:
        return self.eqns.append(FlatEqn(eqn, tuple(ins), tuple(outs), owner))  # passthrough
      out_of.setdefault(inner, outer)
    for inner_eqn in body.jaxpr.eqns:
      e_ins = [v if isinstance(v, _compat.Literal) else sub.get(v, v) for v in inner_eqn.invars]
      e_outs = []
      for v in inner_eqn.outvars:
        new = out_of.get(v, v)
        sub[v] = new
        e_outs.append(new)
      self._add(inner_eqn, e_ins, e_outs, owner, depth + 1)
    return None

  def producer(self, v: Any) -> FlatEqn | None:
    """The flat equation defining `v` (None: an input, a const or a literal)."""
    return None if isinstance(v, _compat.Literal) else self.defs.get(v)

  def constant(self, v: Any) -> np.ndarray | None:
    """`v`'s value if no input of the jaxpr reaches it (and it is small enough), else None."""
    if isinstance(v, _compat.Literal):
      return np.asarray(v.val)
    if v in self._consts:
      return self._consts[v]
    if v in self._not_constant:
      return None
    value = self._evaluate(v)
    if value is None:
      self._not_constant.add(v)
    return value

  def _evaluate(self, v: Any) -> np.ndarray | None:
    e = self.producer(v)
    if (e is None or _compat.has_jaxpr_params(dict(e.params)) or e.name.startswith("random")
        or math.prod(getattr(v.aval, "shape", ())) > MAX_CONSTANT):
      return None
    vals = []
    for x in e.ins:
      c = self.constant(x)
      if c is None:
        return None
      vals.append(c)
    outs = _in_numpy(e, vals)
    if outs is None:
      try:
        with jax.ensure_compile_time_eval():
          outs = e.eqn.primitive.bind(*vals, **e.params)
      except Exception:  # pylint: disable=broad-except  # not evaluable here: not a constant
        return None
      outs = outs if e.eqn.primitive.multiple_results else [outs]
    for o, x in zip(e.outs, outs):
      self._consts[o] = np.asarray(x)
    return self._consts.get(v)


# -- constants in NumPy: masks are iotas, comparisons and selections -----------------------
# Evaluated by `primitive.bind`, each primitive is compiled for the default device the first
# time it meets a shape (about 0.1 s each, more on a GPU); these are exact in NumPy.


def _iota(*, dtype: Any, shape: tuple[int, ...], dimension: int, **_: Any) -> np.ndarray:
  along = [1] * len(shape)
  along[dimension] = shape[dimension]
  return np.broadcast_to(np.arange(shape[dimension], dtype=dtype).reshape(along), shape)


def _broadcast(x: np.ndarray, *, shape: tuple[int, ...],
               broadcast_dimensions: tuple[int, ...], **_: Any) -> np.ndarray:
  expanded = [1] * len(shape)
  for j, d in enumerate(broadcast_dimensions):
    expanded[d] = x.shape[j]
  return np.broadcast_to(x.reshape(expanded), shape)


def _elementwise(fn: Any) -> Any:
  return lambda *xs, **_: fn(*xs)


_EXACT = {  # exact whatever the dtype: moves, selections, comparisons, casts
    "iota": _iota, "broadcast_in_dim": _broadcast,
    "reshape": lambda x, *, new_sizes, dimensions=None, **_: (
        x.reshape(new_sizes) if dimensions is None else None),
    "squeeze": lambda x, *, dimensions, **_: np.squeeze(x, tuple(dimensions)),
    "copy": lambda x, **_: x, "copy_p": lambda x, **_: x,
    "convert_element_type": lambda x, **_: x,  # the cast is the result's dtype
    "select_n": lambda p, *cases, **_: (
        np.where(p, cases[1], cases[0]) if len(cases) == 2 and p.dtype == np.bool_ else
        np.choose(np.asarray(p, np.int32), cases)),
    "eq": _elementwise(np.equal), "ne": _elementwise(np.not_equal),
    "ge": _elementwise(np.greater_equal), "gt": _elementwise(np.greater),
    "le": _elementwise(np.less_equal), "lt": _elementwise(np.less),
}
_INTEGER = {  # exact on bool and integer operands (wrapping as XLA's)
    "add": _elementwise(np.add), "sub": _elementwise(np.subtract),
    "mul": _elementwise(np.multiply), "neg": _elementwise(np.negative),
    "and": _elementwise(np.bitwise_and), "or": _elementwise(np.bitwise_or),
    "not": _elementwise(np.invert), "xor": _elementwise(np.bitwise_xor),
}


def _in_numpy(e: FlatEqn, vals: list[np.ndarray]) -> list[np.ndarray] | None:
  """`e`'s results computed in NumPy, or None where that is not known to be exact."""
  avals = [x.aval for x in (*e.ins, *e.outs)]
  if len(e.outs) != 1 or any(np.dtype(a.dtype).kind not in "biuf" for a in avals):
    return None
  fn = _EXACT.get(e.name)
  if fn is None and all(np.dtype(a.dtype).kind in "biu" for a in avals):
    fn = _INTEGER.get(e.name)
  if fn is None or (e.name == "convert_element_type" and np.dtype(avals[0].dtype).kind == "f"
                    and np.dtype(avals[-1].dtype).kind in "iu"):  # float to int: as XLA's?
    return None
  try:
    with np.errstate(all="ignore"):  # integers wrap, as XLA's do
      out = fn(*[np.asarray(c, x.aval.dtype) for c, x in zip(vals, e.ins)], **e.params)
  except (TypeError, ValueError):  # params of another JAX release: bind instead
    return None
  aval = e.outs[0].aval
  if out is None or np.shape(out) != tuple(aval.shape):
    return None
  return [np.asarray(out, aval.dtype)]
