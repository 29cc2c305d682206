"""Attention written by hand, found in the jaxpr: the ``"attention"`` family's pattern.

`attention_matches(jaxpr)` anchors on each `dot_general` and recognises,
walking back from it:

- ``out = dot_general(p, v)``: probabilities against values (either operand
  order, any batch/contracting layout an einsum or ``@`` gives: one or two
  batch axes, one contracted token axis, one free axis each);
- ``p = softmax(s)`` over the contracted token axis: `jax.nn.softmax` (its
  primitive ops, or its ``custom_jvp_call``), or written out as
  ``exp(s - max(s)) / sum(exp(s - max(s)))``; casts around it are allowed;
- masks, last applied first: ``where(mask, s, fill)`` / ``select_n`` with a
  constant ``fill <= -1e4`` (or ``-inf``), the mask as an operand;
- biases: ``s + bias`` (an additive mask, ``(1 - m) * -1e9``, is a bias);
- a scale: multiplications or divisions by a constant scalar;
- ``s = dot_general(q, k)``, contracting the head dimension, with the same
  batch axes as the second product.

A mask or bias that no input of the program reaches is evaluated once at
trace time: if it is causal by construction (``jnp.tril`` of ones, an
``iota`` comparison ``i >= j``, Flax's ``make_causal_mask``; an additive
one that is 0 on and below the diagonal and ``<= -1e4`` above it), the site
is causal (`AttentionSpec.causal`) and the causal kernels apply. A mask that
is an input of the program, or built from one, is a general mask.

Anything else is a near miss and no match: softmax over another axis, a
mask fill that is not large and negative, a scale that is not a constant, a
bias added after a mask, a value head size other than the key's, operands of
different dtypes. The engine's planner leaves a match alone too when a
value inside it is read elsewhere (the scores returned, say).

The operands are brought to the family's layout (``[batch, tokens, heads,
head_dim]``; the first batch axis is the batch, the second the heads, or
one head) and the result back to the program's. `attention_sites` is the
family's pattern (`OpFamily.patterns`): each match is an
`autotune.PatternSite`, decided by kernel selection like any site, its
forward (and in a differentiated program its backward) replaced by the
chosen kernel.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def attn(q, k, v):
  ...   s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
  ...   s = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), s, -1e9)
  ...   return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
  >>> q = jnp.ones((2, 8, 4, 16))
  >>> [m.spec.causal for m in attention_matches(jax.make_jaxpr(attn)(q, q, q).jaxpr)]
  [True]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunedjax.ops.attention import _causal
from tunedjax.ops.attention._axes import to_layout as _to_layout
from tunedjax.ops.attention._spec import AttentionSpec
from tunedjax.ops.attention._view import FlatEqn, FlatView
from tunedjax.rewrite import _compat

NAME = "attention"
LARGE_NEGATIVE = _causal.LARGE_NEGATIVE  # a mask's fill at most this: exp underflows to 0
_DTYPES = ("float16", "bfloat16", "float32", "float64")
_CASTS = ("convert_element_type", "copy", "copy_p")
_SHAPERS = ("broadcast_in_dim", "reshape")
# Family layout of the logits: batch, heads, query tokens, key tokens.
B0, B1, Q, K, D, E = ("b", 0), ("b", 1), "q", "k", "d", "e"


@dataclasses.dataclass(frozen=True, eq=False)
class _Const:
  """A bias or mask whose value is known at trace time, used as a constant operand."""

  value: np.ndarray
  aval: Any


class _Miss(Exception):
  """Not an attention (a near miss): the match attempt ends."""


def _need(cond: Any, why: str) -> None:
  if not cond:
    raise _Miss(why)


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionMatch:
  """One attention site found in a jaxpr.

  Attributes:
    eqns: indices of the top-level equations it replaces.
    inputs: the values it reads: query, key, value, the biases, the masks,
      then whatever else its equations read (constants' variables).
    output: the variable it defines (the second product's result).
    spec: the family spec (`AttentionSpec`; ``causal`` when a mask was causal).
    operands: ``operands(invals) -> (q, k, v[, bias][, mask])`` in the
      family's layout, from the values of `inputs`.
    result: ``result(out) -> value``: the family's output in the program's layout.
    why: how it was recognised (for logs).
  """

  eqns: tuple[int, ...]
  inputs: tuple[Any, ...]
  output: Any
  spec: AttentionSpec
  operands: Callable[[Sequence[Any]], tuple[Any, ...]]
  result: Callable[[Any], Any]
  why: str = ""

  def call(self, kernel: Callable[..., Any], *invals: Any) -> list[Any]:
    """``kernel(*operands)`` on the values of `inputs`, its result in the program's layout."""
    return [self.result(kernel(*self.operands(invals)))]


# -- walking back through the graph -------------------------------------------------------


class _Walk:
  """One match attempt from a second `dot_general`: what it collects."""

  def __init__(self, view: FlatView):
    self.view = view
    self.region: list[FlatEqn] = []
    self.scale = 1.0
    self.biases: list[tuple[Any, dict[int, Any]]] = []  # (var, {axis: label})
    self.masks: list[tuple[Any, dict[int, Any], bool]] = []  # (var, labels, negate)

  def take(self, e: FlatEqn) -> FlatEqn:
    self.region.append(e)
    return e

  def strip(self, v: Any, names: Sequence[str] = _CASTS) -> Any:
    """`v` with the casts that made it taken into the region."""
    while True:
      e = self.view.producer(v)
      if e is None or e.name not in names:
        return v
      self.take(e)
      v = e.ins[0]

  def scalar(self, v: Any) -> float | None:
    """The constant scalar `v` is (through broadcasts of a scalar), or None."""
    e = self.view.producer(v)
    while e is not None and e.name in ("broadcast_in_dim", "reshape", *_CASTS):
      v = e.ins[0]
      e = self.view.producer(v)
    c = self.view.constant(v)
    if c is None or c.size == 0:
      return None
    flat = np.asarray(c, np.float64).reshape(-1)
    return float(flat[0]) if np.all(flat == flat[0]) else None


def _reduced(walk: _Walk, v: Any, prim: str, x: Any, axis: int) -> bool:
  """Whether `v` (combined elementwise with `x`) is ``prim(x, axes=(axis,))`` brought back
  to `x`'s axes, each axis where it was (through broadcasts, keepdims reshapes,
  transposes, stop_gradient, casts, a max with -inf), constant along `axis`."""
  view, n = walk.view, x.aval.ndim
  shape = x.aval.shape
  if v.aval.ndim != n:
    return False
  where = [i if v.aval.shape[i] == shape[i] else None for i in range(n)]  # x's axis of each
  while True:
    e = view.producer(v)
    if e is None:
      return False
    u = e.ins[0]
    if e.name in ("stop_gradient", *_CASTS):
      pass
    elif e.name == "max" and prim == "reduce_max":
      consts = [walk.scalar(w) for w in e.ins]
      if -np.inf not in consts:
        return False
      u = e.ins[1] if consts[0] == -np.inf else e.ins[0]
    elif e.name == "broadcast_in_dim":
      dims, out = e.params["broadcast_dimensions"], e.params["shape"]
      where = [where[d] if u.aval.shape[j] == out[d] else None for j, d in enumerate(dims)]
    elif e.name == "transpose":
      perm, new = e.params["permutation"], [None] * u.aval.ndim
      for i, a in enumerate(perm):
        new[a] = where[i]
      where = new
    elif e.name == "reshape":
      big_out = [i for i, d in enumerate(v.aval.shape) if d != 1]
      big_in = [j for j, d in enumerate(u.aval.shape) if d != 1]
      if [v.aval.shape[i] for i in big_out] != [u.aval.shape[j] for j in big_in]:
        return False  # not a reshape that only adds or drops axes of size 1
      new = [None] * u.aval.ndim
      for i, j in zip(big_out, big_in):
        new[j] = where[i]
      where = new
    elif e.name == prim and len(e.params["axes"]) == 1:
      a = e.params["axes"][0]
      full = where[:a] + ["K"] + where[a:]
      walk.take(e)
      r2x = _axes_to(view, walk.strip(u), x)  # a sum in float32 of bfloat16 terms, say
      return (r2x is not None and len(full) == n
              and all(r2x[j] == axis if w == "K" else (w == r2x[j] or (
                  w is None and shape[r2x[j]] == 1)) for j, w in enumerate(full)))
    else:
      return False
    walk.take(e)
    v = u


def _axes_to(view: FlatView, r: Any, x: Any) -> list[int] | None:
  """For each axis of `r`, the axis of `x` it is, where `x` is `r` or a transpose of it
  (through casts); None otherwise."""
  if r is x:
    return list(range(x.aval.ndim))
  e = view.producer(x)
  while e is not None and e.name in _CASTS:
    e = view.producer(e.ins[0])
  if e is None or e.name != "transpose" or e.ins[0] is not r:
    return None
  r2x = [0] * x.aval.ndim
  for i, a in enumerate(e.params["permutation"]):
    r2x[a] = i
  return r2x


def _softmax(walk: _Walk, p: Any, axis: int) -> Any:
  """The logits `p` is the softmax of over `axis` (the region grows); raises `_Miss`."""
  view = walk.view
  e = view.producer(p)
  _need(e is not None and e.name == "div", "the probabilities are not a division")
  walk.take(e)
  ex, denom = e.ins
  exp = view.producer(ex)
  _need(exp is not None and exp.name == "exp", "no exp over the logits")
  walk.take(exp)
  _need(_reduced(walk, denom, "reduce_sum", ex, axis), f"no sum of exp over axis {axis}")
  sub = view.producer(walk.strip(exp.ins[0]))  # mixed precision: exp runs in float32
  _need(sub is not None and sub.name == "sub", "the exp is not of logits minus their max")
  walk.take(sub)
  s = sub.ins[0]
  _need(_reduced(walk, sub.ins[1], "reduce_max", s, axis), f"no max over axis {axis}")
  return s


def _scaled_or_masked(walk: _Walk, s: Any, labels: dict[int, Any]) -> tuple[FlatEqn, dict]:
  """Walks from the softmax's logits back to the first product, collecting masks,
  biases and the scale; returns that `dot_general` and its output's axis labels."""
  view, seen_bias, scaled = walk.view, False, False
  while True:
    e = view.producer(s)
    _need(e is not None, "the logits are not computed from a product")
    if e.name in _CASTS:
      s = walk.take(e).ins[0]
    elif e.name == "transpose":
      perm = e.params["permutation"]
      labels = {perm[a]: lab for a, lab in labels.items()}
      s = walk.take(e).ins[0]
    elif e.name == "broadcast_in_dim" and _expands(e):
      dims = e.params["broadcast_dimensions"]
      labels = {j: labels[d] for j, d in enumerate(dims)}
      s = walk.take(e).ins[0]
    elif e.name == "select_n" and len(e.ins) == 3:
      _need(not seen_bias and not scaled, "a mask applied before a bias or the scale")
      fills = [walk.scalar(u) for u in e.ins[1:]]
      keep_on_true = fills[0] is not None and fills[0] <= LARGE_NEGATIVE
      _need(keep_on_true or (fills[1] is not None and fills[1] <= LARGE_NEGATIVE),
            "the mask's fill is not a constant <= -1e4")
      walk.masks.append((e.ins[0], labels, not keep_on_true))
      s = walk.take(e).ins[2 if keep_on_true else 1]
    elif e.name in ("add", "add_any"):
      _need(not scaled, "a bias added before the scale")
      i = 0 if _reaches_product(view, e.ins[0]) else 1
      walk.biases.append((e.ins[1 - i], labels))
      seen_bias = True
      s = walk.take(e).ins[i]
    elif e.name in ("mul", "div"):
      c = walk.scalar(e.ins[1])
      i = 0
      if c is None and e.name == "mul":
        c, i = walk.scalar(e.ins[0]), 1
      _need(c is not None and np.isfinite(c) and c != 0, f"a {e.name} by a non-constant")
      walk.scale *= (1.0 / c) if e.name == "div" else c
      scaled = True
      s = walk.take(e).ins[i]
    elif e.name == "dot_general":
      return walk.take(e), labels
    else:
      raise _Miss(f"the logits come from {e.name}")


def _expands(e: FlatEqn) -> bool:
  """Whether a `broadcast_in_dim` only adds axes of size 1 (``x[None]``)."""
  dims, shape = e.params["broadcast_dimensions"], e.params["shape"]
  return (all(shape[d] == e.ins[0].aval.shape[j] for j, d in enumerate(dims))
          and all(shape[a] == 1 for a in range(len(shape)) if a not in dims))


def _squeezed(walk: _Walk, p: Any, labels: dict[int, Any]) -> tuple[Any, dict[int, Any]]:
  """`p` and its labels before the casts and squeezes that made it (the region grows)."""
  while True:
    e = walk.view.producer(p)
    if e is not None and e.name in _CASTS:
      p = walk.take(e).ins[0]
    elif e is not None and e.name == "squeeze":
      gone = set(e.params["dimensions"])
      kept = [a for a in range(e.ins[0].aval.ndim) if a not in gone]
      labels = {a: labels[j] for j, a in enumerate(kept)}
      labels.update({a: ("1", a) for a in gone})  # size 1: absent from the family's layout
      p = walk.take(e).ins[0]
    else:
      return p, labels


def _unexpanded(walk: _Walk, x: Any, labels: dict[int, Any]) -> tuple[Any, dict[int, Any]]:
  """`x` before a reshape that only added axes of size 1 (a grouped-query layout's group
  of one): in a differentiated program the backward then gives the cotangent of the
  operand itself. The reshape joins the region (a match whose reshaped operand is
  read by something else than the attention and its backward is left alone)."""
  e = walk.view.producer(x)
  if e is None or e.name != "reshape" or x in walk.view.outvars:
    return x, labels
  u = e.ins[0]
  big_x = [i for i, d in enumerate(x.aval.shape) if d != 1]
  big_u = [j for j, d in enumerate(u.aval.shape) if d != 1]
  if [x.aval.shape[i] for i in big_x] != [u.aval.shape[j] for j in big_u]:
    return x, labels
  new = {j: ("1", f"{id(u)}.{j}") for j in range(u.aval.ndim)}
  new.update({j: labels[i] for i, j in zip(big_x, big_u)})
  if set(new.values()) & {Q, K, D, E} != set(labels.values()) & {Q, K, D, E}:
    return x, labels  # a token or head axis of size 1 would be lost
  walk.take(e)
  return u, new


def _reaches_product(view: FlatView, v: Any, depth: int = 12) -> bool:
  """Whether `v` is a `dot_general` through casts, transposes, scales, biases and masks."""
  for _ in range(depth):
    e = view.producer(v)
    if e is None:
      return False
    if e.name == "dot_general":
      return True
    if e.name not in (*_CASTS, "transpose", "mul", "div", "add", "add_any", "select_n",
                      "broadcast_in_dim"):
      return False
    v = e.ins[2] if e.name == "select_n" else e.ins[0]
  return False


def _free_labels(x: Any, taken: dict[int, Any], name: Any) -> dict[int, Any]:
  """`taken` plus labels for `x`'s other (free) axes: `name` for the one of size > 1
  (the last one if all are 1), ``("1", axis)`` for the others, all of size 1 (a
  grouped-query layout's group axis of one)."""
  free = [a for a in range(x.aval.ndim) if a not in taken]
  _need(free, "an operand without a free axis")
  big = [a for a in free if x.aval.shape[a] != 1]
  _need(len(big) <= 1, f"an operand with {len(big)} free axes larger than 1")
  main = big[0] if big else free[-1]
  return taken | {a: name if a == main else ("1", a) for a in free}


def _product_labels(d1: FlatEqn, out: dict[int, Any]) -> tuple[dict[int, Any], dict[int, Any]]:
  """Axis labels of the first product's two operands from its output's (`out`)."""
  (lc, rc), (lb, rb) = d1.params["dimension_numbers"]
  nb = len(lb)
  _need(len(lc) == 1 and all(isinstance(out[i], tuple) for i in range(nb)),
        "the first product is not one contraction over the second's batch axes")
  sides, tokens, at = [], [], nb
  for x, c, b in ((d1.ins[0], lc, lb), (d1.ins[1], rc, rb)):
    labels = {b[i]: out[i] for i in range(nb)} | {c[0]: D}
    free = [a for a in range(x.aval.ndim) if a not in labels]
    labels.update({a: out[at + j] for j, a in enumerate(free)})  # in the output's order
    at += len(free)
    sides.append(labels)
    tokens.append([labels[a] for a in free if labels[a] in (Q, K)])
  _need(sorted(map(str, tokens[0] + tokens[1])) == [K, Q] and all(len(t) == 1 for t in tokens),
        "the first product's free axes are not the query and key tokens")
  return sides[0], sides[1]


def _source(walk: _Walk, v: Any, labels: dict[int, Any]) -> tuple[Any, dict[int, Any]]:
  """A bias or mask before its broadcast to the logits' shape, and its axis labels."""
  view = walk.view
  e = view.producer(v)
  while e is not None and e.name in (*_CASTS, "broadcast_in_dim"):
    if e.name == "broadcast_in_dim":
      if not e.ins[0] in view.top and not isinstance(e.ins[0], _compat.Literal):
        break
      dims = e.params["broadcast_dimensions"]
      labels = {j: labels[d] for j, d in enumerate(dims)}
    elif e.ins[0].aval.dtype != v.aval.dtype:
      break
    v = e.ins[0]
    e = view.producer(v)
  if v in view.top:
    return v, labels
  const = view.constant(v)  # made inside a call (jnp.where's bool of a float mask): baked in
  _need(const is not None, "a bias or mask made inside a call from its inputs")
  return _Const(const, v.aval), labels


def _match_at(view: FlatView, d2: FlatEqn, p_side: int) -> AttentionMatch:
  """The attention whose second product is `d2`, probabilities its operand `p_side`."""
  walk = _Walk(view)
  walk.take(d2)
  (lc, rc), (lb, rb) = d2.params["dimension_numbers"]
  p, v = d2.ins[p_side], d2.ins[1 - p_side]
  (pc, vc), (pb, vb) = ((lc, rc), (lb, rb)) if p_side == 0 else ((rc, lc), (rb, lb))
  nb = len(pb)
  _need(len(pc) == 1 and nb <= 2, "the second product is not probabilities against values")
  p_labels = _free_labels(p, {pb[i]: ("b", i) for i in range(nb)} | {pc[0]: K}, Q)
  v_labels = _free_labels(v, {vb[i]: ("b", i) for i in range(nb)} | {vc[0]: K}, E)
  p0, s_labels = _squeezed(walk, p, p_labels)
  s = _softmax(walk, p0, next(a for a, lab in s_labels.items() if lab == K))
  d1, out_labels = _scaled_or_masked(walk, s, s_labels)
  l0, l1 = _product_labels(d1, out_labels)
  (q, q_labels), (k, k_labels) = ((d1.ins[0], l0), (d1.ins[1], l1)) if Q in l0.values() \
      else ((d1.ins[1], l1), (d1.ins[0], l0))
  (q, q_labels), (k, k_labels), (v, v_labels) = (
      _unexpanded(walk, x, lab) for x, lab in ((q, q_labels), (k, k_labels), (v, v_labels)))
  # The second product's output axes: batch axes, then each operand's free axes in order.
  p_free = [p_labels[a] for a in range(p.aval.ndim) if a not in pb and a != pc[0]]
  v_free = [v_labels[a] for a in range(v.aval.ndim) if a not in vb and a != vc[0]]
  out_labels = [("b", i) for i in range(nb)] + (p_free + v_free if p_side == 0
                                                else v_free + p_free)
  return _assemble(walk, (q, k, v), (q_labels, k_labels, v_labels), d2, out_labels, nb)


def _causal_masks(walk: _Walk, q_len: int, kv_len: int) -> tuple[bool, list[tuple]]:
  """Whether a mask of the site makes it causal, and its masks as operands
  ``(source, labels, negate)``: a mask that is, or is an AND of, the causal mask and
  others (`_causal.split_causal`) leaves the others; a negated one (``where(m, fill,
  s)``) is causal when its negation is."""
  causal, masks = False, []
  for x, lab, neg in walk.masks:
    rest = None if neg else _causal.split_causal(walk.view, x, lab, q=Q, k=K, q_len=q_len,
                                                 kv_len=kv_len)
    if rest is not None:
      causal = True
      masks.extend((*_source(walk, u, u_lab), False) for u, u_lab in rest)
      continue
    source, labels = _source(walk, x, lab)
    const = source.value if isinstance(source, _Const) else walk.view.constant(source)
    if neg and const is not None and _causal.is_causal_constant(
        "mask", np.logical_not(_to_layout(np.asarray(const), labels, [B0, B1, Q, K])),
        q_len, kv_len):
      causal = True
      continue
    masks.append((source, labels, neg))
  return causal, masks


def _assemble(walk: _Walk, qkv: tuple[Any, Any, Any], labels: tuple[dict, dict, dict],
              d2: FlatEqn, out_labels: list[Any], nb: int) -> AttentionMatch:
  """The match of a recognised attention: spec, operands, result, inputs, equations."""
  view = walk.view
  q, k, v = qkv
  dtypes = {np.dtype(x.aval.dtype).name for x in qkv}
  _need(len(dtypes) == 1 and next(iter(dtypes)) in _DTYPES, f"query, key, value dtypes {dtypes}")
  orders = ([B0, Q, B1, D], [B0, K, B1, D], [B0, K, B1, E])
  shapes = [_to_layout(np.empty(x.aval.shape, np.bool_), lab, o).shape
            for x, lab, o in zip(qkv, labels, orders)]
  _need(shapes[1] == shapes[2], f"value shape {shapes[2]} differs from key's {shapes[1]}")
  b, t, n, h = shapes[0]
  s_len = shapes[1][1]
  extra_order = [B0, B1, Q, K]
  biases = [_source(walk, x, lab) for x, lab in walk.biases]
  causal, masks = _causal_masks(walk, t, s_len)
  for item in list(biases):  # an additive causal mask: 0 below the diagonal, -1e4 above
    const = item[0].value if isinstance(item[0], _Const) else view.constant(item[0])
    if const is not None and _causal.is_causal_constant(
        "bias", _to_layout(np.asarray(const), item[1], extra_order), t, s_len):
      biases.remove(item)
      causal = True
  region = {e.owner for e in walk.region}
  data = [q, k, v] + [x for x, *_ in (*biases, *masks) if not isinstance(x, _Const)]
  for x in data:
    e = view.producer(x)
    _need(x in view.top and (e is None or e.owner not in region),
          "an operand is a literal or made inside the attention")
  _need(d2.outs[0] in view.top, "the result is inside a call")

  def shape_of(items: Sequence[tuple[Any, ...]]) -> tuple[int, ...] | None:
    if not items:
      return None
    return tuple(np.broadcast_shapes(*[
        _to_layout(np.empty(x.aval.shape, np.bool_), lab, extra_order).shape
        for x, lab, *_ in items]))

  spec = AttentionSpec(
      batch=b, q_len=t, kv_len=s_len, heads=n, kv_heads=n, head_dim=h,
      dtype=next(iter(dtypes)), causal=causal, scale=float(walk.scale),
      bias_shape=shape_of(biases), mask_shape=shape_of(masks),
      bias_dtype=np.result_type(*[x.aval.dtype for x, _ in biases]).name if biases else None)
  return _finish(walk, spec, data, labels, orders, (biases, masks), d2, out_labels, nb,
                 region)


def _finish(walk: _Walk, spec: AttentionSpec, data: list[Any], labels: tuple[dict, ...],
            orders: tuple[list, ...], extras: tuple[list, list], d2: FlatEqn,
            out_labels: list[Any], nb: int, region: set[int]) -> AttentionMatch:
  """The `AttentionMatch`: how operands reach the family's layout and the result comes back."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  biases, masks = extras
  out = d2.outs[0]
  cast = _cast_after(walk.view, out, spec.dtype)
  if cast is not None:  # mixed precision: a float32-accumulated product cast to the compute dtype
    region = region | {cast[0]}
    out = cast[1]
  fam_out = [B0, Q, B1, E]

  def operands(invals: Sequence[Any]) -> tuple[Any, ...]:
    invals = [invals[i] for i in slots]  # one value per operand (inputs are unique)
    ops = [_to_layout(x, lab, o) for x, lab, o in zip(invals[:3], labels, orders)]
    rest = iter(invals[3:])
    value = lambda x: jnp.asarray(x.value) if isinstance(x, _Const) else next(rest)  # noqa: E731
    if biases:
      parts = [_to_layout(value(x), lab, [B0, B1, Q, K]) for x, lab in biases]
      ops.append(functools.reduce(jnp.add, parts))
    if masks:
      parts = [value(x) for x, _, _ in masks]
      parts = [_to_layout(jnp.logical_not(m) if neg else m.astype(bool), lab, [B0, B1, Q, K])
               for m, (_, lab, neg) in zip(parts, masks)]
      ops.append(functools.reduce(jnp.logical_and, parts))
    return tuple(ops)

  def result(y: Any) -> Any:
    y = _to_layout(y, dict(enumerate(fam_out)), out_labels)  # absent batch axes dropped
    return y.astype(out.aval.dtype) if y.dtype != out.aval.dtype else y

  inputs = list(dict.fromkeys(data))  # q = k = v = x: x once (its cotangent is one sum)
  slots = [inputs.index(x) for x in data]
  defined = {v for i in region for v in walk.view.jaxpr.eqns[i].outvars}
  for i in sorted(region):
    for x in walk.view.jaxpr.eqns[i].invars:
      if not isinstance(x, _compat.Literal) and x not in defined and x not in inputs:
        inputs.append(x)
  why = (f"{'causal' if spec.causal else spec.mask_kind}, scale {spec.scale:.4g}, "
         f"{nb} batch axes")
  return AttentionMatch(eqns=tuple(sorted(region)), inputs=tuple(inputs), output=out,
                        spec=spec, operands=operands, result=result, why=why)


def _cast_after(view: FlatView, out: Any, dtype: str) -> tuple[int, Any] | None:
  """The cast of the second product's result to the operands' `dtype`, when it is
  that result's only reader (autocast writes ``convert(dot(p, v, preferred=f32))``,
  and the backward then reads the cast's cotangent): ``(its equation, its value)``."""
  jaxpr = view.jaxpr
  if np.dtype(out.aval.dtype).name == dtype or any(v is out for v in jaxpr.outvars):
    return None
  readers = [(i, e) for i, e in enumerate(jaxpr.eqns)
             if any(v is out for v in e.invars if not isinstance(v, _compat.Literal))]
  if len(readers) != 1:
    return None
  i, e = readers[0]
  if (e.primitive.name != "convert_element_type"
      or np.dtype(e.outvars[0].aval.dtype).name != dtype):
    return None
  return i, e.outvars[0]


def attention_matches(jaxpr: Any) -> list[AttentionMatch]:
  """Every attention found in `jaxpr` (an open jaxpr), in the order of their results."""
  view = FlatView(jaxpr)
  found: list[AttentionMatch] = []
  for e in view.eqns:
    if e.name != "dot_general":
      continue
    for p_side in (0, 1):
      try:
        found.append(_match_at(view, e, p_side))
        break
      except _Miss:
        continue
  return found


def attention_sites(ctx: Any, jaxpr: Any) -> list[Any]:
  """The ``"attention"`` family's pattern (`OpFamily.patterns`): each attention of
  `attention_matches` as an `autotune.PatternSite`."""
  del ctx
  if not any(e.primitive.name == "dot_general" or _compat.is_higher_order(e.primitive.name)
             for e in jaxpr.eqns):
    return []
  from tunedjax.autotune import PatternSite  # pylint: disable=import-outside-toplevel
  return [PatternSite(NAME, spec=m.spec, eqns=m.eqns, inputs=m.inputs, outputs=(m.output,),
                      call=m.call, spelling=f"softmax(q k) v, {m.why}")
          for m in attention_matches(jaxpr)]
