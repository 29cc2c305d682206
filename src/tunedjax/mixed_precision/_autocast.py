"""`autocast`: a jaxpr pass that runs each op in the precision its list says.

Three op lists, modelled on PyTorch's autocast op reference
(https://pytorch.org/docs/stable/amp.html#autocast-op-reference: matmuls and
convolutions in lower precision; exp, log, pow, rsqrt, softmax, sums and
norms in float32) and on Paddle's AMP lists
(`paddle/static/amp/fp16_lists.py`: a white list of matmul/conv and a black
list of exp, log, mean, sum, softmax, cross-entropy):

- *allow*: run in the policy's `compute_dtype`. What matmuls and
  convolutions return is, by default, what the target platform runs natively
  (`native_accumulate_dtype`): matmuls accumulate in float32 everywhere
  (`preferred_element_type=float32`, native in cuBLAS, Triton, the TPU's MXU
  and XLA:CPU), then are cast to the compute dtype; on a GPU a convolution
  takes and returns the compute dtype (bf16 x bf16 -> bf16, as Flax's
  ``dtype=`` and `torch.autocast` write it), because XLA:GPU declares mixed
  precision for dots only and runs a bf16 x bf16 -> f32 convolution as a
  float32 one (``OperandUpcaster``); cuDNN still accumulates in float32
  inside it. An explicit ``accumulate_dtype`` overrides the platform's.
- *deny*: always run in (at least) float32.
- *follow*: run in the widest floating dtype of their inputs (weak-typed
  Python scalars do not widen, as in JAX's promotion).

Any primitive on no list (and not higher-order) runs exactly as traced: its
inputs are cast back to their traced dtypes first. The pass keeps half
precision values in its environment and casts them back wherever they leave
its reach (loop carries, branch outputs, the function's outputs), through the
rewrite engine's `materialize` hook.

A region of the program can be given its own compute dtype with
`precision_region(dtype)` (a `jax.named_scope`); `wrap` uses this to keep
normalization layers in float32. While the pass traces a function
(`autocast_transform`), the policy is current for call sites that decide at
trace time (`trace_compute_dtype`), and what such a call site runs in
`as_traced` is bound as traced (`rewrite.Pass.keep`): see `_scope.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunedjax import rewrite
from tunedjax.rewrite import _compat
from tunedjax._errors import did_you_mean
from tunedjax._policy import (DTypeLike, PolicyError,
                                              PolicyLike, canonical_dtype,
                                              get_policy)
from tunedjax.mixed_precision import _scope
from tunedjax.mixed_precision._scope import precision_region as precision_region

DEFAULT_ALLOW = ("dot_general", "conv_general_dilated")
DEFAULT_DENY = (
    "exp", "exp2", "log", "log1p", "expm1", "pow", "rsqrt", "logistic",
    "erf_inv", "reduce_sum", "reduce_prod", "cumsum", "cumprod",
    "cumlogsumexp")
DEFAULT_FOLLOW = (
    # elementwise
    "add", "add_any", "sub", "mul", "div", "neg", "abs", "sign", "max", "min",
    "square", "sqrt", "integer_pow", "tanh", "sin", "cos", "tan", "erf",
    "erfc", "floor", "ceil", "round", "clamp", "select_n", "is_finite",
    "eq", "ne", "lt", "le", "gt", "ge", "copy", "copy_p", "cbrt",
    "convert_element_type",
    # data movement
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
    "concatenate", "pad", "slice", "dynamic_slice", "dynamic_update_slice",
    "gather", "scatter-add", "scatter_add", "rev", "split",
    "sharding_constraint",
    # reductions that do not accumulate rounding error
    "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin",
)
KNOWN_PRIMITIVES = tuple(sorted({*DEFAULT_ALLOW, *DEFAULT_DENY, *DEFAULT_FOLLOW}))
_ACCUMULATING = ("dot_general", "conv_general_dilated")
PLATFORM_DEFAULT = "platform"
"""The ``accumulate_dtype`` default: what the target platform runs natively."""
_GPU_NAMES = ("gpu", "cuda", "rocm")


def native_accumulate_dtype(primitive: str, platform: str | None) -> np.dtype | None:
  """The accumulation dtype a platform runs `primitive` in natively (None: the compute dtype).

  GPU: matmuls float32 (cuBLAS/Triton take bf16 x bf16 -> f32), convolutions
  the compute dtype (XLA:GPU upcasts a mixed-precision convolution to a
  float32 one, forward and backward). TPU: float32 for both (the MXU
  accumulates in float32 and XLA:TPU takes a bf16 x bf16 -> f32 convolution
  as written). CPU: float32 for both (measured: a bf16-result convolution's
  step was within the A/A spread of the float32-accumulated one, and the
  conv kernels' buckets are keyed by the float32 result).

  Example:
    >>> native_accumulate_dtype("conv_general_dilated", "gpu") is None
    True
    >>> native_accumulate_dtype("dot_general", "gpu")
    dtype('float32')
  """
  if primitive == "conv_general_dilated" and str(platform).lower() in _GPU_NAMES:
    return None
  return np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class OpLists:
  """The resolved op lists of an autocast pass.

  Attributes:
    allow: primitives run in the compute dtype.
    deny: primitives always run in float32.
    follow: primitives run in the widest dtype of their inputs.

  Example:
    >>> lists = OpLists.resolve(allow=["tanh"], deny=["dot_general"])
    >>> "tanh" in lists.allow, "dot_general" in lists.deny
    (True, True)
  """

  allow: frozenset[str]
  deny: frozenset[str]
  follow: frozenset[str]

  @classmethod
  def resolve(cls, *, allow: Iterable[str] = (), deny: Iterable[str] = ()) -> OpLists:
    """The defaults with the user's names moved to `allow` or `deny`.

    Raises:
      PolicyError: for a name that is not a known primitive, or one named in
        both lists; the message lists the known names.
    """
    allow, deny = _check_names(allow, "allow"), _check_names(deny, "deny")
    both = set(allow) & set(deny)
    if both:
      raise PolicyError(f"autocast: {sorted(both)} named in both allow and deny; "
                        "a primitive can be on one list only.")
    user = set(allow) | set(deny)
    allow_set = (set(DEFAULT_ALLOW) - user) | set(allow)
    deny_set = (set(DEFAULT_DENY) - user) | set(deny)
    follow_set = set(DEFAULT_FOLLOW) - user
    return cls(frozenset(allow_set), frozenset(deny_set), frozenset(follow_set))


def _check_names(names: Iterable[str], which: str) -> tuple[str, ...]:
  if isinstance(names, str):
    names = (names,)
  names = tuple(getattr(n, "name", n) for n in names)  # a jax Primitive too
  for n in names:
    if n not in KNOWN_PRIMITIVES:
      raise PolicyError(
          f"autocast: unknown primitive {n!r} in {which}{did_you_mean(str(n), KNOWN_PRIMITIVES)}. "
          f"Known primitives: {', '.join(KNOWN_PRIMITIVES)}.")
  return names


def _is_float_dtype(dtype: Any) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _dtype_of(x: Any) -> Any:
  return getattr(x, "dtype", None)


def _cast(ctx: rewrite.Context, x: Any, dtype: np.dtype) -> Any:
  """`x` in `dtype`; one cast per value and dtype within a trace.

  A weight used by a forward convolution and by the backward one that takes
  its gradient would otherwise be cast twice (XLA would CSE the copies, but
  the program handed to it would carry twice the converts an expert's does).
  """
  current = _dtype_of(x)
  if current is None:  # a Python scalar literal
    return jnp.asarray(x, dtype)
  if current == dtype:
    return x
  key = ("autocast cast", id(x), np.dtype(dtype).name)
  hit = ctx.memo.get(key)
  trace = _compat.current_trace()
  if hit is not None and hit[0] is x and hit[2] is trace:
    return hit[1]
  moved = ctx.memo.get(("autocast moved", id(x)))
  if moved is not None and moved[0] is x and moved[3] is trace:
    # x = move(src) (a reverse, transpose, reshape, ...): move src's cast instead,
    # as the backward convolution's reversed kernel is in the expert's program.
    _, eqn, src, _ = moved
    out = ctx.bind(eqn, [_cast(ctx, src, dtype)])[0]
  else:
    ctx.count("casts inserted")
    out = lax.convert_element_type(x, dtype)
  ctx.memo[key] = (x, out, trace)  # keeps `x` alive, so its id stays unique
  return out


# Unary data movement commutes with a cast, element for element.
_MOVES = frozenset({"rev", "transpose", "reshape", "squeeze", "expand_dims",
                    "broadcast_in_dim", "slice", "copy", "copy_p"})


def _remember_move(ctx: rewrite.Context, eqn: Any, invals: list[Any], outs: list[Any]) -> None:
  if (eqn.primitive.name in _MOVES and len(invals) == 1 and len(outs) == 1
      and _dtype_of(invals[0]) == _dtype_of(outs[0])):
    ctx.memo[("autocast moved", id(outs[0]))] = (outs[0], eqn, invals[0],
                                                 _compat.current_trace())


def _materialize(value: Any, aval: Any) -> Any:
  dtype = getattr(aval, "dtype", None)
  current = _dtype_of(value)
  if (_is_float_dtype(dtype) and _is_float_dtype(current) and current != dtype):
    return lax.convert_element_type(value, dtype)
  return value


def _floating_inputs(eqn: Any) -> list[bool]:
  return [_is_float_dtype(getattr(v.aval, "dtype", None)) for v in eqn.invars]


AS_TRACED = "ops left as traced (a call site's own precision)"


def _keep(ctx: rewrite.Context, eqn: Any) -> bool:
  """Whether `eqn` stands inside `as_traced`: the engine then binds it as traced,
  a loop's or a call's body included (`rewrite.Pass.keep`)."""
  if not _scope.in_as_traced():
    return False
  ctx.count(AS_TRACED)
  return True


def _accumulate_for(ctx: rewrite.Context, name: str, target: np.dtype,
                    accumulate: np.dtype | None | str) -> np.dtype:
  if isinstance(accumulate, str):  # PLATFORM_DEFAULT
    accumulate = native_accumulate_dtype(name, ctx.platform)
    if accumulate is None:
      ctx.count(f"{name} returns {target.name} ({ctx.platform}-native)")
  return target if accumulate is None else jnp.promote_types(target, accumulate)


def _allow_rule(compute: np.dtype, accumulate: np.dtype | None | str) -> rewrite.Rule:
  def rule(ctx: rewrite.Context, eqn: Any, invals: list[Any]) -> list[Any]:
    floating = _floating_inputs(eqn)
    if not any(floating):
      return ctx.default(eqn, invals)
    target = _scope.region_dtype() or compute
    new = [_cast(ctx, x, target) if f else x for x, f in zip(invals, floating)]
    name = eqn.primitive.name
    ctx.count(f"{name} in {target.name}")
    if name in _ACCUMULATING:
      acc = _accumulate_for(ctx, name, target, accumulate)
      extra = {}
      if name == "dot_general" and ctx.platform == "cpu" and target != jnp.float32:
        new, extra = _leading_batch_dims(new, eqn.params["dimension_numbers"])
        if extra:
          ctx.count("dot_general rhs batch dims moved first (XLA:CPU)")
      outs = ctx.bind(eqn, new, preferred_element_type=acc, **extra)
      return [_cast(ctx, o, target) for o in outs]
    return ctx.bind(eqn, new)
  return rule


def _leading_batch_dims(operands: list[Any], dimension_numbers: Any
                        ) -> tuple[list[Any], dict[str, Any]]:
  """Moves the rhs batch dims of a dot_general first when the lhs's already are.

  XLA:CPU (jax 0.10) has no runtime kernel for a half-precision dot with a
  float32 result whose lhs batch dims lead and whose rhs batch dims do not
  ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32");
  attention's backward pass makes such dots. Of the 576 ways to lay out a
  4-d dot with two batch dims, the 22 that fail are all of this form, and
  every one runs once the rhs batch dims are moved first (its other dims
  keep their order, so the output is the same, element for element). Other
  dots are left as written: XLA runs them, and a transpose would cost time.

  Returns:
    The operands and ``{"dimension_numbers": ...}``, or the operands and
    ``{}`` when nothing needs to move.
  """
  (l_contract, r_contract), (l_batch, r_batch) = dimension_numbers
  lead = tuple(range(len(l_batch)))
  if tuple(l_batch) != lead or tuple(r_batch) == lead:
    return operands, {}
  rhs = operands[1]
  perm = list(r_batch) + [d for d in range(jnp.ndim(rhs)) if d not in r_batch]
  where = {old: new for new, old in enumerate(perm)}
  moved = jax.lax.transpose(rhs, perm)
  return [operands[0], moved, *operands[2:]], {
      "dimension_numbers": ((tuple(l_contract), tuple(where[c] for c in r_contract)),
                            (lead, lead))}


def _deny_rule(ctx: rewrite.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  floating = _floating_inputs(eqn)
  new = []
  for x, f, v in zip(invals, floating, eqn.invars):
    if f:
      target = jnp.promote_types(v.aval.dtype, jnp.float32)
      current = _dtype_of(x)
      if current is not None and current != target:
        x = _cast(ctx, x, jnp.promote_types(current, target))
    new.append(x)
  return ctx.bind(eqn, new)


def _follow_rule(ctx: rewrite.Context, eqn: Any, invals: list[Any]) -> list[Any]:
  floating = _floating_inputs(eqn)
  if not any(floating):
    return ctx.default(eqn, invals)
  region = _scope.region_dtype()
  strong = [_dtype_of(x) for x, f, v in zip(invals, floating, eqn.invars)
            if f and not getattr(v.aval, "weak_type", False) and _dtype_of(x) is not None]
  if region is not None:
    target = region
  elif strong:
    target = functools.reduce(jnp.promote_types, strong)
  else:
    target = functools.reduce(jnp.promote_types, [v.aval.dtype for v, f in zip(eqn.invars, floating) if f])
  if all(_dtype_of(x) == v.aval.dtype == target
         for x, f, v in zip(invals, floating, eqn.invars) if f):
    outs = ctx.bind(eqn, invals)
    _remember_move(ctx, eqn, invals, outs)
    return outs
  if eqn.primitive.name == "convert_element_type":  # its param sets the output dtype
    return ctx.bind(eqn, invals)
  new = [_cast(ctx, x, target) if f else x for x, f in zip(invals, floating)]
  try:
    return ctx.bind(eqn, new)
  except (TypeError, ValueError):  # a primitive that needs its traced dtypes
    ctx.count(f"{eqn.primitive.name} kept as traced")
    return ctx.default(eqn, invals)


def _resolve_accumulate(value: Any) -> np.dtype | None | str:
  if value is None or (isinstance(value, str) and value == PLATFORM_DEFAULT):
    return value
  try:
    return canonical_dtype(value, what="accumulate_dtype")
  except PolicyError as e:
    raise PolicyError(f"{e} Or None (the compute dtype), or {PLATFORM_DEFAULT!r} "
                      "(what the target platform runs natively).") from None


def autocast_pass(policy: PolicyLike = "mixed_bfloat16", *, allow: Iterable[str] = (),
                  deny: Iterable[str] = (),
                  accumulate_dtype: DTypeLike | None = PLATFORM_DEFAULT) -> rewrite.Pass:
  """The `tunedjax.rewrite.Pass` that `autocast` applies (for `tunedjax.jit`).

  Args:
    policy: a `Policy`, a policy string or a named policy.
    allow: primitive names to run in the compute dtype, on top of
      `DEFAULT_ALLOW` (moved from the other lists).
    deny: primitive names to always run in float32, on top of `DEFAULT_DENY`.
    accumulate_dtype: what matmuls and convolutions accumulate in (their
      `preferred_element_type`); None accumulates in the compute dtype; the
      default, ``"platform"``, is what the target platform runs natively
      (`native_accumulate_dtype`: float32, except convolutions on a GPU).

  Example:
    >>> autocast_pass("mixed_bfloat16").name
    'autocast[params=float32,compute=bfloat16,output=float32]'
  """
  policy = get_policy(policy)
  lists = OpLists.resolve(allow=allow, deny=deny)
  accumulate = _resolve_accumulate(accumulate_dtype)
  allow_rule = _allow_rule(policy.compute_dtype, accumulate)
  rules: dict[str, rewrite.Rule] = {name: _follow_rule for name in lists.follow}
  rules.update({name: _deny_rule for name in lists.deny})
  rules.update({name: allow_rule for name in lists.allow})
  # Plain calls are inlined, so half-precision values flow through `jax.nn`
  # helpers (which are jitted); a call that pins shardings is rebuilt as usual.
  return rewrite.Pass(f"autocast[{policy}]", rules, materialize=_materialize,
                      inline_calls=True, keep=_keep)


def autocast_transform(f: Callable[..., Any], policy: PolicyLike = "mixed_bfloat16", *,
                       allow: Iterable[str] = (), deny: Iterable[str] = (),
                       accumulate_dtype: DTypeLike | None = PLATFORM_DEFAULT,
                       platform: str | None = None,
                       on_trace: Callable[[rewrite.Context], None] | None = None
                       ) -> Callable[..., Any]:
  """`f` rewritten by `autocast_pass`, the policy current while `f` is traced.

  What `autocast`, `wrap` and `tunedjax.jit`'s mixed-precision stage run (the
  outputs are not cast to the output dtype here). While `f` is traced, call
  sites can ask `trace_compute_dtype` what their matmuls will run in
  (`_scope.tracing_under`).

  Example:
    >>> import jax.numpy as jnp
    >>> autocast_transform(lambda x: x @ x)(jnp.eye(2)).dtype  # bfloat16 inside, cast back
    dtype('float32')
  """
  policy = get_policy(policy)
  pass_ = autocast_pass(policy, allow=allow, deny=deny, accumulate_dtype=accumulate_dtype)
  current = _scope.TracePolicy(policy.compute_dtype,
                               OpLists.resolve(allow=allow, deny=deny).allow)

  @functools.wraps(f)
  def traced(*args: Any, **kwargs: Any) -> Any:
    with _scope.tracing_under(current):
      return f(*args, **kwargs)

  return rewrite.transform(traced, pass_, platform=platform, on_trace=on_trace)


def autocast(f: Callable[..., Any], policy: PolicyLike = "mixed_bfloat16", *,
             allow: Iterable[str] = (), deny: Iterable[str] = (),
             accumulate_dtype: DTypeLike | None = PLATFORM_DEFAULT,
             on_trace: Callable[[rewrite.Context], None] | None = None) -> Callable[..., Any]:
  """Returns `f` with each op run in the precision the op lists give it.

  Matrix multiplies and convolutions run in the policy's compute dtype with
  float32 accumulation; exp, log, pow, rsqrt, sums and products (softmax and
  LayerNorm statistics) stay in float32; everything else follows its inputs.
  Parameters are not touched: they stay in the dtype you pass them in and are
  cast at each use. Works inside `scan`/`cond`/`while`/`jit`/`remat`/
  `custom_vjp` bodies, and composes with `jax.jit`, `jax.grad` and `jax.vmap`.
  The floating outputs are cast to the policy's `output_dtype`.

  Args:
    f: the function (arrays in, pytree of arrays out).
    policy: a `Policy`, a policy string or a named policy (default
      "mixed_bfloat16").
    allow: extra primitive names to run in the compute dtype.
    deny: extra primitive names to always run in float32 (e.g.
      ["dot_general"] keeps matmuls in float32).
    accumulate_dtype: matmul/conv accumulation dtype (default ``"platform"``:
      float32, except a GPU's convolutions, which return the compute dtype;
      None accumulates in the compute dtype).
    on_trace: called with the pass's `Context` after each trace (its
      `counts` say what was cast).

  Returns:
    A function with `f`'s signature.

  Raises:
    PolicyError: for a bad policy or an unknown primitive name.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = autocast(lambda w, x: jnp.exp(x @ w), "mixed_bfloat16")
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> [e.invars[0].aval.str_short(short_dtypes=True) for e in jaxpr.eqns if e.primitive.name in ("dot_general", "exp")]
    ['bf16[4,3]', 'f32[4,2]']
  """
  policy = get_policy(policy)
  rewritten = autocast_transform(f, policy, allow=allow, deny=deny,
                                 accumulate_dtype=accumulate_dtype, on_trace=on_trace)

  @functools.wraps(f)
  def cast_outputs(*args: Any, **kwargs: Any) -> Any:
    return policy.cast_to_output(rewritten(*args, **kwargs))

  return cast_outputs
