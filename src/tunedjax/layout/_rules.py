"""The layout pass's rules: convolutions re-laid, axes remapped, layouts passed through.

The three op classes of PaddlePaddle's layout autotune, as rewrite rules:

* **layout-sensitive** (`conv_general_dilated`): the activation operand is
  brought into the target layout (a transpose only where it arrives in
  another one: the edge of a region), the kernel into the target kernel
  layout, and the result is produced in the target layout by choosing the
  convolution's dimension numbers; pooling (`reduce_window*`) and its
  gradients (`select_and_scatter_add`, `select_and_gather_add`, `pad`) run in
  whatever layout their input is in, with their per-axis params permuted;
* **axis-dependent** (reductions, arg-max/min, cumulative ops,
  `broadcast_in_dim`, `transpose`, `concatenate`, `slice`, `dynamic_slice`,
  `dynamic_update_slice`, `squeeze`, `reshape` that only adds or drops
  size-1 axes, `rev`, `split`): the axes are remapped; anything else
  (a `reshape` that flattens channels with space, `dot_general`, gathers)
  gets its inputs transposed back to the original layout by the engine;
* **layout-agnostic** (elementwise ops, `convert_element_type`, `select_n`,
  `integer_pow`, ...): the layout passes through; operands that disagree are
  brought to the common layout, broadcasts and scalars are remapped.

Plain `jit` calls are inlined (the engine's `inline_calls` hook), and
`custom_jvp_call` (``jax.nn.relu``, ``gelu``) and `remat2`
(``jax.checkpoint``) are rebuilt by the engine on the re-laid operands with
their bodies (and derivative rule) conjugated (its `boundary` hook, given
`_Boundary`), so a region in the target layout extends across them. `scan`,
`while`, `cond` and `custom_vjp_call` bodies are rewritten on their own:
their operands go back to the original layout at the boundary.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import rewrite
  >>> from tunedjax.layout._value import LayoutState
  >>> st = LayoutState("NHWC")
  >>> f = lambda x, w: jax.nn.relu(jax.lax.conv(x, w, (1, 1), "SAME"))
  >>> closed = jax.make_jaxpr(f)(jnp.ones((1, 2, 4, 4)), jnp.ones((3, 2, 1, 1)))
  >>> _ = rewrite.rewrite_jaxpr(closed, make_pass(st))
  >>> st.counts["convolutions re-laid"]
  1
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex_core
from jax import lax

from tunedjax import rewrite
from tunedjax.layout._value import Bcast
from tunedjax.layout._value import Laid
from tunedjax.layout._value import LayoutState
from tunedjax.layout._value import Perm
from tunedjax.layout._value import identity
from tunedjax.layout._value import inverse
from tunedjax.layout._value import perm_of
from tunedjax.layout._value import rank_of
from tunedjax.layout._value import wrap

CONV = "conv_general_dilated"

ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan",
    "atan2", "atanh", "cbrt", "ceil", "clamp", "conj", "convert_element_type",
    "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma", "igammac",
    "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not",
    "or", "population_count", "pow", "real", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "sub",
    "tan", "tanh", "xor", "complex", "clz", "bitcast_convert_type",
})
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
    "reduce_or", "reduce_xor", "argmax", "argmin",
})
_CASTS = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
WINDOWED = frozenset({
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "select_and_gather_add",
})
_WINDOW_PARAMS = ("window_dimensions", "window_strides", "padding", "base_dilation",
                  "window_dilation")
_SHARDING_PARAMS = ("sharding", "out_sharding")


def _sharded(eqn: Any) -> bool:
  """Whether the equation pins an explicit sharding (left alone by the pass)."""
  return any(eqn.params.get(k) is not None for k in _SHARDING_PARAMS)


def _common_perm(values: Sequence[Any], rank: int) -> Perm | None:
  """The layout most of the re-laid `values` of `rank` are in (None: all plain)."""
  perms = collections.Counter(v.perm for v in values
                              if isinstance(v, Laid) and len(v.perm) == rank)
  return perms.most_common(1)[0][0] if perms else None


def _permuted(seq: Sequence[Any], perm: Perm) -> tuple[Any, ...]:
  """A per-logical-axis sequence reordered to per-physical-axis."""
  return tuple(seq[a] for a in perm)


def _act_order(spec: Sequence[int], target: str) -> Perm:
  """Physical axis order of an activation with roles (batch, feature, *spatial)."""
  if target == "NHWC":
    return (spec[0], *spec[2:], spec[1])
  return tuple(spec)


def _kernel_order(spec: Sequence[int], target: str) -> Perm:
  """Physical axis order of a kernel with roles (out, in, *spatial)."""
  if target == "NHWC":
    return (*spec[2:], spec[1], spec[0])
  return tuple(spec)


def _acceptable_act(perm: Perm, spec: Sequence[int], target: str) -> bool:
  """Whether an operand already held in `perm` may be used as is: the target
  order, or the target order with batch and feature roles swapped (how the
  weight-gradient convolution reads activations)."""
  want = _act_order(spec, target)
  swapped = _act_order((spec[1], spec[0], *spec[2:]), target)
  return perm in (want, swapped)


class _Rules:
  """The rule table for one trace, bound to its `LayoutState`."""

  def __init__(self, state: LayoutState):
    self.st = state

  # -- helpers -------------------------------------------------------------

  def _physical(self, value: Any) -> tuple[Any, Perm]:
    """`value` as (physical array, perm); Bcast values are bound plain."""
    if isinstance(value, Laid):
      return value.array, value.perm
    if isinstance(value, Bcast):
      value = self.st.logical(value)
    return value, identity(rank_of(value))

  # -- layout-sensitive ----------------------------------------------------

  def conv(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    if _sharded(eqn):
      return ctx.default(eqn, invals)
    st = self.st
    lhs, rhs = invals
    dn = eqn.params["dimension_numbers"]
    target = st.target
    if (perm_of(lhs) is None and perm_of(rhs) is None
        and _acceptable_act(identity(len(dn.lhs_spec)), dn.lhs_spec, target)):
      # Already in the target layout and fed from outside any re-laid region
      # (an NHWC model, the backward convolutions of one included): as written.
      return ctx.default(eqn, invals)
    lhs_perm = perm_of(lhs)
    if lhs_perm is None or not _acceptable_act(lhs_perm, dn.lhs_spec, target):
      reuse = [(p, a) for p, a in st.converted(lhs)
               if _acceptable_act(p, dn.lhs_spec, target)] if lhs_perm is None else []
      if reuse:
        lhs_perm, lhs_arr = reuse[0]
      else:
        lhs_perm = _act_order(dn.lhs_spec, target)
        lhs_arr = st.to_perm(lhs, lhs_perm)
    else:
      lhs_arr = lhs.array
    # A weight-gradient convolution reads activations with batch and feature
    # roles swapped; its result is a kernel gradient, produced in the kernel's
    # own layout (where the optimizer update and the output want it).
    weight_grad = lhs_perm != _act_order(dn.lhs_spec, target)  # the swapped form
    rhs_perm = perm_of(rhs)
    if rhs_perm is None:
      rhs_perm = _kernel_order(dn.rhs_spec, target)
      if not weight_grad:
        st.note_kernel(rhs, rhs_perm)
      rhs_arr = st.to_perm(rhs, rhs_perm)
    else:
      rhs_arr = rhs.array
    out_perm = identity(len(dn.out_spec)) if weight_grad else _act_order(dn.out_spec, target)
    lhs_inv, rhs_inv, out_inv = inverse(lhs_perm), inverse(rhs_perm), inverse(out_perm)
    new_dn = lax.ConvDimensionNumbers(
        lhs_spec=tuple(lhs_inv[a] for a in dn.lhs_spec),
        rhs_spec=tuple(rhs_inv[a] for a in dn.rhs_spec),
        out_spec=tuple(out_inv[a] for a in dn.out_spec))
    if new_dn != dn:
      st.count("convolutions re-laid")
    out = ctx.bind(eqn, [lhs_arr, rhs_arr], dimension_numbers=new_dn)[0]
    return [wrap(out, out_perm)]

  def windowed(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    rank = len(eqn.outvars[0].aval.shape)
    perm = _common_perm(invals, rank)
    if perm is None:
      return ctx.default(eqn, invals)
    st = self.st
    new = [st.to_perm(v, perm) if rank_of(v) == rank else v for v in invals]
    params = {k: _permuted(eqn.params[k], perm)
              for k in _WINDOW_PARAMS if eqn.params.get(k) is not None}
    st.count("pooling ops re-laid")
    outs = ctx.bind(eqn, new, **params)
    return [wrap(o, perm) for o in outs]

  def pad(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    operand, value = invals
    if not isinstance(operand, Laid):
      return ctx.default(eqn, invals)
    perm = operand.perm
    config = _permuted(eqn.params["padding_config"], perm)
    out = ctx.bind(eqn, [operand.array, self.st.logical(value)], padding_config=config)[0]
    return [wrap(out, perm)]

  # -- layout-agnostic -----------------------------------------------------

  def elementwise(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    out_shape = eqn.outvars[0].aval.shape
    rank = len(out_shape)
    perm = _common_perm(invals, rank)
    if perm is None or _sharded(eqn):
      outs = ctx.default(eqn, invals)
      if eqn.primitive.name in _CASTS:  # a kernel input cast (mixed precision) is still it
        self.st.same_input(invals[0], outs[0])
      return outs
    for v, var in zip(invals, eqn.invars):
      shape = var.aval.shape
      if shape and (len(shape) != rank
                    or any(d not in (o, 1) for d, o in zip(shape, out_shape))):
        return ctx.default(eqn, invals)  # not elementwise after all (e.g. a bitcast)
    st = self.st
    new = [st.to_perm(v, perm) if rank_of(v) == rank and rank else st.logical(v)
           for v in invals]
    outs = ctx.bind(eqn, new)
    return [wrap(o, perm) for o in outs]

  # -- axis-dependent ------------------------------------------------------

  def reduction(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    (operand,) = invals
    if not isinstance(operand, Laid) or _sharded(eqn):
      return ctx.default(eqn, invals)
    axes = tuple(eqn.params["axes"])
    inv = inverse(operand.perm)
    new_axes = tuple(sorted(inv[a] for a in axes))
    out = ctx.bind(eqn, [operand.array], axes=new_axes)[0]
    self.st.count("axis ops remapped")
    return [wrap(out, _drop_axes(operand.perm, axes))]

  def cumulative(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    (operand,) = invals
    if not isinstance(operand, Laid):
      return ctx.default(eqn, invals)
    axis = inverse(operand.perm)[eqn.params["axis"]]
    out = ctx.bind(eqn, [operand.array], axis=axis)[0]
    self.st.count("axis ops remapped")
    return [wrap(out, operand.perm)]

  def broadcast_in_dim(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    if len(invals) != 1 or _sharded(eqn):
      return ctx.default(eqn, invals)
    (operand,) = invals
    shape = tuple(eqn.params["shape"])
    dims = tuple(eqn.params["broadcast_dimensions"])
    if isinstance(operand, Bcast):
      operand = self.st.logical(operand)
    if not isinstance(operand, Laid):
      return [Bcast(operand, shape, dims)]
    # Keep the operand's physical order: its axes fill the broadcast positions in order.
    slots = sorted(dims)
    out_perm = list(range(len(shape)))
    for i, slot in enumerate(slots):
      out_perm[slot] = dims[operand.perm[i]]
    out_perm = tuple(out_perm)
    phys_shape = tuple(shape[a] for a in out_perm)
    out = ctx.bind(eqn, [operand.array], shape=phys_shape,
                   broadcast_dimensions=tuple(slots))[0]
    self.st.count("axis ops remapped")
    return [wrap(out, out_perm)]

  def transpose(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    del ctx
    (operand,) = invals
    array, perm = self._physical(operand)
    t_inv = inverse(eqn.params["permutation"])
    self.st.count("transposes absorbed")
    return [wrap(array, tuple(t_inv[a] for a in perm))]

  def concatenate(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    rank = len(eqn.outvars[0].aval.shape)
    perm = _common_perm(invals, rank)
    if perm is None:
      return ctx.default(eqn, invals)
    new = [self.st.to_perm(v, perm) for v in invals]
    dim = inverse(perm)[eqn.params["dimension"]]
    out = ctx.bind(eqn, new, dimension=dim)[0]
    self.st.count("axis ops remapped")
    return [wrap(out, perm)]

  def slice(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    (operand,) = invals
    if not isinstance(operand, Laid):
      return ctx.default(eqn, invals)
    p = operand.perm
    params = {k: _permuted(eqn.params[k], p)
              for k in ("start_indices", "limit_indices", "strides")
              if eqn.params.get(k) is not None}
    out = ctx.bind(eqn, [operand.array], **params)[0]
    return [wrap(out, p)]

  def dynamic_slice(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    operand, *idx = invals
    rank = rank_of(operand)
    if not isinstance(operand, Laid) or len(idx) != rank:
      return ctx.default(eqn, invals)
    p = operand.perm
    idx = [self.st.logical(i) for i in idx]
    out = ctx.bind(eqn, [operand.array, *_permuted(idx, p)],
                   slice_sizes=_permuted(eqn.params["slice_sizes"], p))[0]
    return [wrap(out, p)]

  def dynamic_update_slice(self, ctx: rewrite.Context, eqn: Any,
                           invals: Sequence[Any]) -> list[Any]:
    operand, update, *idx = invals
    rank = len(eqn.outvars[0].aval.shape)
    perm = _common_perm([operand, update], rank)
    if perm is None or len(idx) != rank:
      return ctx.default(eqn, invals)
    st = self.st
    idx = [st.logical(i) for i in idx]
    out = ctx.bind(eqn, [st.to_perm(operand, perm), st.to_perm(update, perm),
                         *_permuted(idx, perm)])[0]
    return [wrap(out, perm)]

  def rev(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    (operand,) = invals
    if not isinstance(operand, Laid):
      done = self.st.converted(operand)  # a kernel already re-laid for the forward conv
      if not done:
        return ctx.default(eqn, invals)
      operand = Laid(done[0][1], done[0][0])
    inv = inverse(operand.perm)
    dims = tuple(sorted(inv[d] for d in eqn.params["dimensions"]))
    out = ctx.bind(eqn, [operand.array], dimensions=dims)[0]
    return [wrap(out, operand.perm)]

  def squeeze(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    (operand,) = invals
    if not isinstance(operand, Laid):
      return ctx.default(eqn, invals)
    dims = tuple(eqn.params["dimensions"])
    inv = inverse(operand.perm)
    out = ctx.bind(eqn, [operand.array], dimensions=tuple(sorted(inv[d] for d in dims)))[0]
    return [wrap(out, _drop_axes(operand.perm, dims))]

  def split(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    (operand,) = invals
    if not isinstance(operand, Laid):
      return ctx.default(eqn, invals)
    axis = inverse(operand.perm)[eqn.params["axis"]]
    outs = ctx.bind(eqn, [operand.array], axis=axis)
    return [wrap(o, operand.perm) for o in outs]

  def reshape(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> list[Any]:
    operand = invals[0]
    if (not isinstance(operand, Laid) or len(invals) != 1 or _sharded(eqn)
        or eqn.params.get("dimensions") is not None):
      return ctx.default(eqn, invals)
    in_shape = tuple(eqn.invars[0].aval.shape)
    out_shape = tuple(eqn.params["new_sizes"])
    big_in = [a for a in range(len(in_shape)) if in_shape[a] != 1]
    big_out = [b for b in range(len(out_shape)) if out_shape[b] != 1]
    if [in_shape[a] for a in big_in] != [out_shape[b] for b in big_out]:
      return ctx.default(eqn, invals)  # merges or splits axes: needs the original layout
    to_out = dict(zip(big_in, big_out))
    phys_big = [to_out[a] for a in operand.perm if in_shape[a] != 1]
    out_perm = list(range(len(out_shape)))
    for slot, b in zip(big_out, phys_big):
      out_perm[slot] = b
    out_perm = tuple(out_perm)
    out = lax.reshape(operand.array, tuple(out_shape[b] for b in out_perm))
    self.st.count("axis ops remapped")
    return [wrap(out, out_perm)]

  def table(self) -> dict[str, Any]:
    rules: dict[str, Any] = {CONV: self.conv, "pad": self.pad}
    rules.update({name: self.elementwise for name in ELEMENTWISE})
    rules.update({name: self.reduction for name in REDUCTIONS})
    rules.update({name: self.cumulative for name in CUMULATIVE})
    rules.update({name: self.windowed for name in WINDOWED})
    rules.update({
        "broadcast_in_dim": self.broadcast_in_dim, "transpose": self.transpose,
        "concatenate": self.concatenate, "slice": self.slice,
        "dynamic_slice": self.dynamic_slice,
        "dynamic_update_slice": self.dynamic_update_slice, "rev": self.rev,
        "squeeze": self.squeeze, "split": self.split, "reshape": self.reshape,
    })
    return rules


def _drop_axes(perm: Perm, axes: Sequence[int]) -> Perm:
  """The layout left when logical `axes` are removed from a value held in `perm`."""
  dropped = set(axes)
  renumber = {a: a - sum(d < a for d in dropped) for a in range(len(perm))}
  return tuple(renumber[a] for a in perm if a not in dropped)


def _has_conv(eqn: Any) -> bool:
  """Whether a convolution is in `eqn`'s sub-jaxprs (at any depth)."""
  return any(e.primitive.name == CONV for sub in jex_core.jaxprs_in_params(eqn.params)
             for e in rewrite.iter_equations(sub))


class _Boundary(rewrite.Boundary):
  """Re-laid values cross rebuilt calls as their physical arrays.

  The engine rebuilds a `jax.checkpoint` body or a ``custom_jvp_call``
  (relu, gelu, ...) on the physical arrays, conjugated: the new body
  evaluates the original one through this pass on `Laid` values, so
  ``g(P x) == P f(x)`` and the derivative rule is the original one, exactly.
  """

  def __init__(self, state: LayoutState):
    self.st = state

  def tag(self, value: Any) -> Perm | None:
    return perm_of(value)

  def to_physical(self, value: Any, tag: Perm) -> Any:
    return self.st.to_perm(value, tag)

  def from_physical(self, array: Any, tag: Perm) -> Any:
    return Laid(array, tag)

  def physical_aval(self, aval: Any, tag: Perm) -> Any:
    return aval.update(shape=tuple(aval.shape[a] for a in tag))

  def applies(self, ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> bool:
    del ctx
    return any(isinstance(v, Laid) for v in invals) or _has_conv(eqn)

  def on_rebuild(self, ctx: rewrite.Context, eqn: Any, kind: str) -> None:
    del ctx, eqn
    if kind == "custom_jvp":
      self.st.count("custom_jvp calls re-laid")


def _inline(ctx: rewrite.Context, eqn: Any, invals: Sequence[Any]) -> bool:
  """Inline a nested jit (jnp functions, Flax modules) so regions span it."""
  del ctx
  return any(isinstance(v, (Laid, Bcast)) for v in invals) or _has_conv(eqn)


def make_pass(state: LayoutState) -> rewrite.Pass:
  """The layout pass for one trace, writing what it does into `state`.

  Args:
    state: the trace's `LayoutState` (target layout, counters).

  Returns:
    A `tunedjax.rewrite.Pass` whose `materialize` hook transposes re-laid
    values back to their original layout wherever they leave the pass.

  Example:
    >>> make_pass(LayoutState("NHWC")).name
    'layout'
  """
  return rewrite.Pass("layout", _Rules(state).table(),
                      materialize=lambda value, aval: state.logical(value),
                      inline_calls=_inline, boundary=_Boundary(state))
