"""Causal masks recognised: one rule for every way a site reaches the ``"attention"`` family.

A mask (True, or non-zero, where a query may attend a key) is *causal* when
it is exactly JAX's causal mask, top-left aligned: query ``i`` attends keys
``j <= i``, the same along every other axis. The rule looks at how the mask
was computed, not at its type:

- a mask whose value is known while the program is traced (no input of the
  program reaches it: ``jnp.tril(jnp.ones((T, S)))``, bool or float,
  ``iota >= iota``, Flax's ``make_causal_mask``, each broadcast to
  ``[B, H, T, S]`` or not) is evaluated once and compared with the causal mask;
- a boolean AND of masks (``&``, ``jnp.logical_and``, Flax's
  ``combine_masks``), seen through broadcasts, casts to and from bool and
  ``!= 0``, is split into its conjuncts: when one of them is causal, the
  attention is causal and the others (a padding mask, say) remain its mask,
  which `tunedjax.attention` takes beside ``is_causal``. A conjunct that is
  constant and all True is dropped.

`split_causal` applies the rule to a value of a `FlatView`: the attention
pattern's view of a jaxpr (`_pattern.py`), or, for the call sites
(`tunedjax.attention`, the Flax swap and its route), the view of how a traced
mask was computed (`split_mask`, through `rewrite._compat.traced_computation`).

Anything else stays a general mask, as it was: a ``tril`` with an offset
``k != 0``, a mask aligned bottom-right (``k = S - T``), a mask that depends
on the data (or on the program's inputs: a mask passed in as an argument),
a product of float masks (``causal * padding``), a mask combined with OR, or
one computed where the trace cannot see it (outside a ``scan`` or ``remat``
body that receives it). A mask passed as a concrete array (eager code, or a
NumPy constant) is recognised when the whole of it is causal; a concrete
combination stays general.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> found = []
  >>> def f(valid):  # valid: [batch, kv_len], a padding mask
  ...   mask = jnp.tril(jnp.ones((4, 4), bool)) & valid[:, None, None, :]
  ...   causal, rest = split_mask(mask, 4, 4)
  ...   found.append((causal, rest.shape))
  ...   return valid
  >>> _ = jax.make_jaxpr(f)(np.ones((2, 4), bool))
  >>> found
  [(True, (2, 1, 1, 4))]
  >>> split_mask(np.tril(np.ones((4, 4))), 4, 4)
  (True, None)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax.ops.attention._view import MAX_CONSTANT, FlatView
from tunedjax.rewrite import _compat

LARGE_NEGATIVE = -1e4  # an additive mask at most this: exp underflows to 0
_COPIES = ("copy", "copy_p")


def is_causal_constant(kind: str, x: Any, q_len: int, kv_len: int) -> bool:
  """Whether a constant mask (``kind="mask"``: True or non-zero attends) or additive
  bias (``kind="bias"``: 0 attends, ``<= -1e4`` does not), its last two axes the query
  and key tokens, is exactly the causal mask (top-left aligned, as JAX's) along
  every other axis.

  Example:
    >>> is_causal_constant("mask", np.tril(np.ones((1, 3, 3))), 3, 3)
    True
    >>> is_causal_constant("mask", np.tril(np.ones((3, 3)), k=1), 3, 3)
    False
  """
  if x is None or np.ndim(x) < 2 or tuple(np.shape(x)[-2:]) != (q_len, kv_len):
    return False
  keep = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None]
  x = np.asarray(x)
  if kind == "mask":
    return bool(np.all(x.astype(bool) == keep))
  x = x.astype(np.float64)
  return bool(np.all(np.where(keep, x == 0, x <= LARGE_NEGATIVE)))


@dataclasses.dataclass(frozen=True, eq=False)
class Conjunct:
  """One mask of a boolean AND, as `conjuncts` finds it.

  Attributes:
    value: the value its truth is taken from (through casts, ``!= 0`` and
      broadcasts: the smallest one).
    labels: ``{axis of value: label}``; a label the caller did not give (a
      size-1 axis a broadcast added) is a ``("1", ...)`` tuple.
    top: the smallest value on the way that is a top-level variable of the
      view (what a caller can use as a mask operand), or None.
    top_labels: `top`'s labels.
  """

  value: Any
  labels: dict[int, Any]
  top: Any | None
  top_labels: dict[int, Any] | None


def _top(view: FlatView, v: Any) -> bool:
  return not isinstance(v, _compat.Literal) and v in view.top


def _dummies(x: Any, labels: dict[int, Any]) -> dict[int, Any]:
  """`labels` with a ``("1", ...)`` label for each of `x`'s axes without one."""
  return {a: labels.get(a, ("1", f"{id(x)}.{a}")) for a in range(len(x.aval.shape))}


def _through(view: FlatView, e: Any, v: Any, labels: dict[int, Any]
             ) -> tuple[Any, dict[int, Any]] | None:
  """The operand of `e` (which defines `v`) whose truth is `v`'s, with its labels;
  None when `e` is not a broadcast, a copy, a cast to or from bool or ``x != 0``."""
  u = e.ins[0] if e.ins else None
  out_shape = tuple(v.aval.shape)
  if e.name in _COPIES:
    return u, labels
  if e.name == "convert_element_type":
    if np.dtype(u.aval.dtype) == np.bool_ or np.dtype(v.aval.dtype) == np.bool_:
      return u, labels
    return None
  if e.name == "ne" and len(e.ins) == 2:
    for x, zero in (e.ins, e.ins[::-1]):
      c = view.constant(zero)
      if tuple(x.aval.shape) == out_shape and c is not None and c.size and not np.any(c):
        return x, labels
    return None
  if e.name == "broadcast_in_dim":
    dims = e.params["broadcast_dimensions"]
    return u, _dummies(u, {j: labels[d] for j, d in enumerate(dims)
                           if u.aval.shape[j] == out_shape[d]})
  if e.name == "squeeze":
    gone = set(e.params["dimensions"])
    kept = [a for a in range(len(u.aval.shape)) if a not in gone]
    return u, _dummies(u, {a: labels[j] for j, a in enumerate(kept)})
  if e.name == "reshape" and e.params.get("dimensions") is None:
    big_v = [i for i, d in enumerate(out_shape) if d != 1]
    big_u = [j for j, d in enumerate(u.aval.shape) if d != 1]
    if [out_shape[i] for i in big_v] != [u.aval.shape[j] for j in big_u]:
      return None  # not a reshape that only adds or drops axes of size 1
    return u, _dummies(u, {j: labels[i] for i, j in zip(big_v, big_u)})
  return None


def conjuncts(view: FlatView, v: Any, labels: Mapping[int, Any]) -> list[Conjunct]:
  """The masks whose AND the mask `v` is (one, `v` itself, when it is no AND).

  Follows `v` back through copies, casts to or from bool, ``!= 0`` and
  broadcasts (none of which changes which entries are true), splitting it at
  each boolean ``and`` (whose operands may be scalars or have axes of size 1).
  """
  found: list[Conjunct] = []
  start = _dummies(v, dict(labels) if len(labels) == len(v.aval.shape) else {})
  stack = [(v, start, (v, start) if _top(view, v) else None)]
  while stack:
    v, lab, top = stack.pop()
    e = view.producer(v)
    if (e is not None and e.name == "and" and np.dtype(v.aval.dtype) == np.bool_
        and all(len(u.aval.shape) in (0, len(v.aval.shape)) for u in e.ins)):
      for u in reversed(e.ins):  # operands of v's rank may have axes of size 1 (broadcast)
        u_lab = _dummies(u, {a: lab[a] for a, d in enumerate(u.aval.shape)
                             if d == v.aval.shape[a]})
        stack.append((u, u_lab, (u, u_lab) if _top(view, u) else None))
      continue
    step = None if e is None else _through(view, e, v, lab)
    if step is not None:
      u, u_lab = step
      stack.append((u, u_lab, (u, u_lab) if _top(view, u) else top))
      continue
    found.append(Conjunct(v, lab, *(top if top is not None else (None, None))))
  return found


def _tokens_last(x: np.ndarray, labels: Mapping[int, Any], q: Any, k: Any
                 ) -> np.ndarray | None:
  """`x` with its query (`q`) and key (`k`) axes last, or None if it lacks one."""
  axis = {lab: a for a, lab in labels.items()}
  if q not in axis or k not in axis:
    return None
  return np.moveaxis(x, (axis[q], axis[k]), (-2, -1))


def split_causal(view: FlatView, v: Any, labels: Mapping[int, Any], *, q: Any, k: Any,
                 q_len: int, kv_len: int) -> list[tuple[Any, dict[int, Any]]] | None:
  """Splits the mask `v` into the causal mask and what else it masks.

  Args:
    view: the view `v` is a value of.
    v: a mask (True or non-zero: attend).
    labels: ``{axis of v: label}``, for every axis of `v`.
    q: the label of the query token axis.
    k: the label of the key token axis.
    q_len: the query tokens.
    kv_len: the key tokens.

  Returns:
    None when no conjunct of `v` is exactly causal, or one that is not
    would have to be used alone but is not a top-level value of the view
    (then `v` stays a general mask). Else the other conjuncts, each as
    ``(top-level value, its labels)``: the attention is causal, masked by
    them too (none: causal alone).
  """
  rest: list[tuple[Any, dict[int, Any]]] = []
  causal = False
  for c in conjuncts(view, v, labels):
    value = view.constant(c.value)
    if value is not None:
      moved = _tokens_last(value, c.labels, q, k)
      if moved is not None and is_causal_constant("mask", moved, q_len, kv_len):
        causal = True
        continue
      if np.all(value):  # masks nothing
        continue
    if c.top is None:
      return None
    rest.append((c.top, c.top_labels))
  return rest if causal else None


def _to_rank(x: Any, labels: Mapping[int, Any], ndim: int) -> Any:
  """`x` reshaped to `ndim` axes, each where its label (an axis number) says, size 1
  elsewhere (its ``("1", ...)`` axes are of size 1)."""
  shape = [1] * ndim
  for a, lab in labels.items():
    if isinstance(lab, int):
      shape[lab] = x.shape[a]
  return jnp.reshape(x, shape)


def split_mask(mask: Any, q_len: int, kv_len: int) -> tuple[bool, Any]:
  """A call site's mask split into causality and what else it masks.

  For `tunedjax.attention` and the Flax swap: a mask (True or non-zero:
  attend) whose last two axes are the query and key tokens, an array or a
  value being traced. A traced mask is judged by how its trace computed it
  (`split_causal`); a concrete one by its value.

  Args:
    mask: the mask, or None.
    q_len: the query tokens.
    kv_len: the key tokens.

  Returns:
    ``(causal, mask)``: ``(False, mask)`` unchanged when no part of it is
    the causal mask; else True and the boolean mask of the rest, of `mask`'s
    rank (axes of size 1 where the rest does not vary), or None when the
    causal mask is all it masks.
  """
  ndim = np.ndim(mask) if mask is not None else 0
  if ndim < 2:
    return False, mask
  if not isinstance(mask, jax.core.Tracer):
    if math.prod(np.shape(mask)) > MAX_CONSTANT:
      return False, mask
    return (True, None) if is_causal_constant("mask", mask, q_len, kv_len) else (False, mask)
  found = _compat.traced_computation(mask)
  if found is None:
    return False, mask
  jaxpr, consts, tracers = found
  rest = split_causal(FlatView(jaxpr, consts), jaxpr.outvars[0],
                      {a: a for a in range(ndim)}, q=ndim - 2, k=ndim - 1,
                      q_len=q_len, kv_len=kv_len)
  if rest is None or any(v not in tracers for v, _ in rest):
    return False, mask
  parts = [_to_rank(tracers[v], lab, ndim).astype(bool) for v, lab in rest]
  return True, functools.reduce(jnp.logical_and, parts) if parts else None
