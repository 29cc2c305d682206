"""The jaxpr rewriting engine every tunedjax pass builds on.

A pass is a table of per-primitive rules (`Pass`). The engine traces a
function to a closed jaxpr and evaluates it equation by equation on whatever
values it is given (concrete arrays, or the tracers of an enclosing `jax.jit`,
`jax.grad` or `jax.vmap`). An equation with a rule is handed to the rule; any
other equation is bound unchanged. Higher-order primitives (`jit`, `scan`,
`while`, `cond`, `remat`, `custom_jvp_call`, ...) are rebuilt with their
sub-jaxprs rewritten by the same rules and their other params intact, so a
pass reaches into loop bodies and branches. Because the evaluation happens
inside the caller's trace, `jax.jit` caching, `grad`, `vmap` and sharding keep
working: the result is just another JAX function.

This is the design of JAX's "Writing custom interpreters" tutorial and of
`jax.experimental.sparse`: one evaluation loop, a `primitive -> rule` table, a
default rule that passes the equation through, and explicit rules for the
higher-order primitives.

Two hooks let a pass that keeps values in its own form (layout keeps an
array plus the permutation it is stored in) carry that form across calls
without naming any higher-order primitive itself:

- `Pass(inline_calls=...)` / `Context.inline`: a plain call (a nested
  `jax.jit` pinning no shardings, or a `closed_call`) is seen through: its
  body is evaluated in place, on the pass's values as they are.
- `Pass(boundary=...)` / `Context.rebuild`: a `jax.checkpoint` body, a
  `custom_jvp_call` (with its JVP rule) or a plain call is rebuilt around the
  pass's values: a `Boundary` says how each value crosses the edge (its
  physical array and a tag), and the rebuilt body takes and returns physical
  arrays. A `custom_vjp_call` (its backward rule is user code on plain
  values), `scan`, `while` and `cond` are the boundary's edge: their operands
  are materialized and their bodies rewritten on their own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax

from tunedjax import _errors
from tunedjax._config import Config, get_config
from tunedjax.rewrite import _compat
from tunedjax.rewrite import _pattern

logger = logging.getLogger("tunedjax.rewrite")

JaxprEqn = _compat.JaxprEqn
ClosedJaxpr = _compat.ClosedJaxpr


class Rule(Protocol):
  """A rewrite rule: replaces one equation with any JAX computation.

  Args:
    ctx: the engine's `Context` (platform, config, counters, `default`/`bind`).
    eqn: the equation being evaluated: `eqn.primitive`, `eqn.params`, and the
      abstract values `[v.aval for v in eqn.invars]` / `eqn.outvars`.
    invals: the equation's input values (arrays or tracers, or whatever the
      pass put in its environment).

  Returns:
    A sequence with one value per `eqn.outvars`.
  """

  def __call__(self, ctx: Context, eqn: JaxprEqn, invals: Sequence[Any]) -> Sequence[Any]:
    ...


def _identity_materialize(value: Any, aval: Any) -> Any:
  del aval
  return value


class Boundary:
  """How a pass's own values cross the edge of a call the engine rebuilds.

  A pass whose environment holds values in another form than plain arrays
  (a pending transpose, say) gives the engine a `Boundary` (as
  `Pass(boundary=...)`). Where a `jax.checkpoint` body, a `custom_jvp_call`
  (``jax.nn.relu``, ``gelu``) or a plain nested `jit` meets such values,
  `Context.rebuild` rebuilds the call on their *physical* arrays: the new
  body turns its inputs back into the pass's values (`from_physical`),
  evaluates the original body with the pass's rules, and returns each output
  in the form it came out in (`to_physical`), so the values leave the call
  in the pass's form too. The call's derivative rule (a `custom_jvp` rule,
  or the autodiff of the rebuilt body) is rebuilt the same way, with each
  tangent in its primal's form.

  A tag of None means "plain": the engine materializes such values with the
  pass's `materialize` and passes them as they are. Override the four
  methods below; `applies` decides per equation whether to rebuild at all.

  The physical form must be a linear rearrangement of the value (a
  transpose, a reshape), so that a tangent held the same way is the tangent
  of the physical array.
  """

  def tag(self, value: Any) -> Any:
    """How `value` is held (a hashable tag), or None for a plain array."""
    del value
    return None

  def to_physical(self, value: Any, tag: Any) -> Any:
    """`value` (any value of the pass) as the physical array held as `tag`."""
    raise NotImplementedError(f"{type(self).__name__}.to_physical")

  def from_physical(self, array: Any, tag: Any) -> Any:
    """The pass's value for a physical `array` held as `tag`."""
    raise NotImplementedError(f"{type(self).__name__}.from_physical")

  def physical_aval(self, aval: Any, tag: Any) -> Any:
    """The abstract value of the physical array of a value of type `aval` held as `tag`."""
    raise NotImplementedError(f"{type(self).__name__}.physical_aval")

  def applies(self, ctx: Context, eqn: JaxprEqn, invals: Sequence[Any]) -> bool:
    """Whether to rebuild `eqn` across the boundary (default: when an operand is
    not plain); otherwise the engine's `default` applies."""
    del ctx, eqn
    return any(self.tag(v) is not None for v in invals)

  def on_rebuild(self, ctx: Context, eqn: JaxprEqn, kind: str) -> None:
    """Called after `eqn` was rebuilt (`kind`: "call", "remat" or "custom_jvp"),
    for a pass's counters. Does nothing by default."""
    del ctx, eqn, kind


InlinePredicate = Callable[["Context", JaxprEqn, Sequence[Any]], bool]


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Pass:
  """A jaxpr rewrite pass: a name and a table of per-primitive rules.

  Attributes:
    name: shown in reports, logs and errors.
    rules: primitive name (`"dot_general"`, `"conv_general_dilated"`, ...) to
      `Rule`. Names of higher-order primitives may be given too: the rule then
      replaces the engine's recursion for them (and may call
      `ctx.default(eqn, invals)` to get it back).
    materialize: `(value, aval) -> array`, turns a value from the pass's
      environment into a plain array of type `aval`. It is applied wherever a
      value leaves the pass's reach: inputs of equations bound unchanged,
      results of sub-jaxprs (loop carries, branch outputs) and of the function.
      A pass that keeps values in another representation (a pending
      transpose, a lower precision) converts them back here. Default: identity.
    skip_untouched: bind a higher-order equation as written when no rule can
      fire inside it (the default; it saves re-tracing its body). False
      re-traces every sub-jaxpr, which is useful for testing the engine and
      measuring its worst case.
    inline_calls: see through plain calls (nested `jax.jit` pinning no
      shardings, `closed_call`): True inlines every one (`Context.inline`), a
      predicate ``(ctx, eqn, invals) -> bool`` chooses per call; a call not
      inlined gets the `boundary` or the default. Default False.
    boundary: a `Boundary`: rebuild `remat`, `custom_jvp_call` and plain
      calls around values in the pass's own form (`Context.rebuild`) instead
      of materializing them at the call. Default None.
    patterns: functions ``(ctx, jaxpr) -> [rewrite.Match, ...]`` called on
      every jaxpr the pass evaluates (nested bodies too); the matches that
      can fire (`rewrite._pattern.plan`) replace their equations. Default ().
    keep: a predicate ``(ctx, eqn) -> bool`` asked of each equation in its
      equation context (its name stack current): an equation it holds for is
      bound exactly as traced (`Context.as_traced`: inputs materialized, no
      rule, no sub-jaxpr entered), so a pass can leave a marked region alone,
      loops and calls in it included. Default None.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import rewrite
    >>> def sin_to_cos(ctx, eqn, invals):
    ...   ctx.count("sin replaced")
    ...   return [jnp.cos(invals[0])]
    >>> p = rewrite.Pass("sin_to_cos", {"sin": sin_to_cos})
    >>> f = rewrite.transform(lambda x: jnp.sin(x) * 2.0, p)
    >>> float(f(0.0))
    2.0
  """

  name: str
  rules: Mapping[str, Rule] = dataclasses.field(default_factory=dict)
  materialize: Callable[[Any, Any], Any] = _identity_materialize
  skip_untouched: bool = True
  inline_calls: bool | InlinePredicate = False
  boundary: Boundary | None = None
  patterns: Sequence[_pattern.Pattern] = ()
  keep: Callable[[Context, JaxprEqn], bool] | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise TypeError(f"Pass name must be a non-empty string, got {self.name!r}.")
    bad = [k for k in self.rules if not isinstance(k, str)]
    if bad:
      raise TypeError(
          f"Pass {self.name!r}: rule keys must be primitive names (str), got "
          f"{bad!r}. Use `primitive.name`, e.g. jax.lax.sin_p.name == 'sin'.")
    object.__setattr__(self, "rules", types.MappingProxyType(dict(self.rules)))
    if self.boundary is not None and not isinstance(self.boundary, Boundary):
      raise TypeError(f"Pass {self.name!r}: boundary must be a rewrite.Boundary, "
                      f"got {self.boundary!r}.")
    object.__setattr__(self, "patterns", tuple(self.patterns))
    bad = [p for p in self.patterns if not callable(p)]
    if bad:
      raise TypeError(f"Pass {self.name!r}: patterns must be functions (ctx, jaxpr) -> "
                      f"[Match, ...], got {bad!r}.")
    if self.keep is not None and not callable(self.keep):
      raise TypeError(f"Pass {self.name!r}: keep must be None or a predicate (ctx, eqn) -> "
                      f"bool, got {self.keep!r}.")
    if not (isinstance(self.inline_calls, bool) or callable(self.inline_calls)):
      raise TypeError(f"Pass {self.name!r}: inline_calls must be a bool or a "
                      f"predicate (ctx, eqn, invals) -> bool, got {self.inline_calls!r}.")

  def table(self) -> dict[str, Rule]:
    """The rules the engine dispatches on: `rules`, plus the inline and
    boundary hooks for the primitives they cover (a rule of the pass's own wins)."""
    table: dict[str, Rule] = {}
    if self.boundary is not None:
      table.update(dict.fromkeys(_compat.BOUNDARY_PRIMITIVES, _boundary_hook))
    if self.inline_calls is not False:
      table.update(dict.fromkeys(_compat.CALL_PARAMS, _call_hook))
    table.update(self.rules)
    return table


class Context:
  """What a rule can see and use while the engine evaluates a jaxpr.

  One `Context` lives for one evaluation (one trace of the function), so
  nothing from one call leaks into another.

  Attributes:
    pass_: the `Pass` being applied.
    platform: the platform the program is compiled for (`"cpu"`, `"gpu"`, `"tpu"`).
    config: the tunedjax `Config` active when the function was traced.
    counts: a `collections.Counter` a rule adds to with `count`; shown in reports.
    memo: a dict patterns may cache what they computed in (once per
      structure), for the length of this trace.
  """

  def __init__(self, pass_: Pass, *, platform: str | None = None,
               config: Config | None = None):
    self.pass_ = pass_
    self.platform = platform or jax.default_backend()
    self.config = config if config is not None else get_config()
    self.counts: collections.Counter[str] = collections.Counter()
    self._rules = pass_.table()
    self._touches: dict[int, tuple[Any, bool]] = {}
    self._rewritten: dict[int, tuple[ClosedJaxpr, ClosedJaxpr]] = {}
    self._warned_unknown: set[str] = set()
    self._plans: dict[int, tuple[Any, _pattern.Plan]] = {}
    self.memo: dict[Any, Any] = {}  # for patterns: what they computed within this trace

  def __repr__(self) -> str:
    return (f"Context(pass={self.pass_.name!r}, platform={self.platform!r}, "
            f"counts={dict(self.counts)})")

  def count(self, what: str, n: int = 1) -> None:
    """Adds `n` to the counter `what` (for example "casts inserted")."""
    self.counts[what] += n

  def materialize(self, value: Any, aval: Any) -> Any:
    """Turns `value` into a plain array of type `aval` (the pass's hook)."""
    return self.pass_.materialize(value, aval)

  def bind(self, eqn: JaxprEqn, invals: Sequence[Any], **params: Any) -> list[Any]:
    """Binds `eqn`'s primitive on `invals` as given, with `params` overriding
    the equation's own. No recursion, no materialization: the rule decides."""
    return _compat.bind_equation(eqn, invals, {**eqn.params, **params})

  def default(self, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """What the engine does for `eqn` without a rule: materialize the inputs,
    then rebuild a higher-order equation with its sub-jaxprs rewritten, or
    bind any other equation unchanged."""
    invals = [self.materialize(x, v.aval) for x, v in zip(invals, eqn.invars)]
    name = eqn.primitive.name
    if _compat.is_higher_order(name) and self._eqn_touched(eqn):
      return self._rebuild_higher_order(eqn, invals)
    if (name not in self._warned_unknown and not _compat.is_higher_order(name)
        and name not in _compat.COMBINER_PRIMITIVES
        and _compat.has_jaxpr_params(eqn.params)):
      self._warned_unknown.add(name)
      logger.debug("pass %r: higher-order primitive %r is not known to the "
                   "rewrite engine; its sub-jaxprs are left untouched.",
                   self.pass_.name, name)
    return _compat.bind_equation(eqn, invals, eqn.params)

  def as_traced(self, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """`eqn` bound exactly as traced: its inputs materialized to their traced
    types, its params (sub-jaxprs included) as they are."""
    invals = [self.materialize(x, v.aval) for x, v in zip(invals, eqn.invars)]
    return _compat.bind_equation(eqn, invals, eqn.params)

  # -- evaluation -------------------------------------------------------------

  def plan(self, jaxpr: _compat.Jaxpr) -> _pattern.Plan:
    """Which of the pass's pattern matches fire in `jaxpr` (memoized per jaxpr)."""
    if not self.pass_.patterns:
      return _pattern.EMPTY_PLAN
    hit = self._plans.get(id(jaxpr))
    if hit is not None:
      return hit[1]
    matches = [m for p in self.pass_.patterns for m in p(self, jaxpr)]
    planned = _pattern.plan(jaxpr, matches)
    for m, why in planned.dropped:
      logger.debug("pass %r: match %r left alone: it %s.", self.pass_.name, m.name, why)
    self._plans[id(jaxpr)] = (jaxpr, planned)  # keeps `jaxpr` alive: ids stay unique
    return planned

  def eval_jaxpr(self, jaxpr: _compat.Jaxpr, consts: Sequence[Any],
                 args: Sequence[Any]) -> list[Any]:
    """Evaluates `jaxpr` with the pass's rules and patterns; returns the raw outputs."""
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x
    if len(args) != len(jaxpr.invars):
      raise TypeError(f"jaxpr takes {len(jaxpr.invars)} inputs, got {len(args)}.")
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    planned = self.plan(jaxpr)
    for i, eqn in enumerate(jaxpr.eqns):
      for m in planned.fire.get(i, ()):
        self._fire(m, env)
      if i not in planned.skip:
        self.eval_equation(eqn, env)
    for m in planned.fire.get(len(jaxpr.eqns), ()):
      self._fire(m, env)
    return [_read(env, v) for v in jaxpr.outvars]

  def eval_equation(self, eqn: JaxprEqn, env: dict[Any, Any]) -> None:
    """Evaluates one equation with the pass's rules, reading and writing `env`."""
    invals = [_read(env, v) for v in eqn.invars]
    rule = self._rules.get(eqn.primitive.name)
    with _compat.equation_context(eqn):
      if self.pass_.keep is not None and self.pass_.keep(self, eqn):
        outvals = self.as_traced(eqn, invals)
      else:
        outvals = rule(self, eqn, invals) if rule is not None else self.default(eqn, invals)
    if len(outvals) != len(eqn.outvars):
      raise _errors.RewriteError(
          f"Pass {self.pass_.name!r}: the rule for {eqn.primitive.name!r} "
          f"returned {len(outvals)} values for {len(eqn.outvars)} outputs. "
          "A rule returns a sequence with one value per equation output.")
    for v, x in zip(eqn.outvars, outvals):
      if not isinstance(v, _compat.DropVar):
        env[v] = x

  def _fire(self, match: _pattern.Match, env: dict[Any, Any]) -> None:
    outvals = match.rule(self, [_read(env, v) for v in match.inputs])
    if len(outvals) != len(match.outputs):
      raise _errors.RewriteError(
          f"Pass {self.pass_.name!r}: the rule of match {match.name!r} returned "
          f"{len(outvals)} values for {len(match.outputs)} outputs.")
    for v, x in zip(match.outputs, outvals):
      env[v] = x

  def finish(self, outs: Sequence[Any], avals: Sequence[Any], where: str) -> list[Any]:
    """Materializes `outs` and checks they have exactly the types `avals`."""
    return [self._checked(self.materialize(x, aval), aval, f"output {i} of {where}")
            for i, (x, aval) in enumerate(zip(outs, avals))]

  def _checked(self, x: Any, aval: Any, where: str) -> Any:
    """`x` with exactly the type `aval` (its weak type set), or a RewriteError."""
    got = _compat.typeof(x)
    if (getattr(got, "shape", None) != getattr(aval, "shape", None)
        or getattr(got, "dtype", None) != getattr(aval, "dtype", None)):
      raise _errors.RewriteError(_errors.REWRITE_TYPE_MISMATCH.format(
          pass_name=self.pass_.name, where=where,
          expected=aval.str_short(), got=got.str_short()))
    if (getattr(got, "weak_type", False) != getattr(aval, "weak_type", False)
        or not isinstance(x, jax.Array)):  # a literal returned as is (eager mode)
      x = _compat.convert_element_type(x, aval.dtype, aval.weak_type)
    return x

  def rewrite_closed(self, closed: ClosedJaxpr, where: str = "a sub-jaxpr") -> ClosedJaxpr:
    """Returns `closed` rewritten by the pass, with the same input and output
    types (memoized per jaxpr within this context)."""
    if not self._touches_jaxpr(closed.jaxpr):
      return closed
    hit = self._rewritten.get(id(closed))
    if hit is not None:
      return hit[1]

    def evaluate(*args: Any) -> list[Any]:
      outs = self.eval_jaxpr(closed.jaxpr, closed.consts, args)
      return self.finish(outs, closed.out_avals, where)

    new = _compat.trace_to_jaxpr(evaluate, closed.in_avals, closed.jaxpr.debug_info)
    self._rewritten[id(closed)] = (closed, new)  # keeps `closed` alive: ids stay unique
    return new


  # -- hooks: inlining a plain call, rebuilding across a boundary ---------------

  def inline(self, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluates a plain call's body in its place, with the pass's rules.

    A plain call is a nested `jax.jit` that pins no shardings or layouts,
    donates nothing and sets no compiler options, or a `closed_call`
    (`rewrite._compat.is_plain_call`). Its body sees `invals` as they are
    (nothing is materialized) and its outputs are returned as the body left
    them, so the pass's values flow through it as if the body were written
    inline. Any other equation gets `default`.
    """
    if not _compat.is_plain_call(eqn):
      return self.default(eqn, invals)
    body = _compat.call_body(eqn)
    return self.eval_jaxpr(body.jaxpr, body.consts, list(invals))

  def rebuild(self, eqn: JaxprEqn, invals: Sequence[Any],
              boundary: Boundary | None = None) -> list[Any]:
    """Rebuilds a higher-order equation around values in the pass's own form.

    Each operand crosses as its physical array (`boundary.to_physical`, or
    materialized when its tag is None); the body is traced over the physical
    types, turns them back into the pass's values, is evaluated with the
    pass's rules, and returns each output as the physical array of the form
    it came out in. The results are the pass's values again
    (`boundary.from_physical`). A `custom_jvp_call`'s JVP rule is rebuilt
    the same way (tangents held like their primals). Equations that cannot be
    rebuilt so (see `rewrite._compat.boundary_kind`: `custom_vjp_call`,
    `scan`, `while`, `cond`, a call that pins shardings) get `default`.

    Args:
      eqn: the equation.
      invals: its operands, as the pass holds them.
      boundary: how values cross; default the pass's `boundary`.

    Returns:
      One pass value per output.
    """
    boundary = boundary if boundary is not None else self.pass_.boundary
    kind = _compat.boundary_kind(eqn)
    if boundary is None or kind is None:
      return self.default(eqn, invals)
    name = eqn.primitive.name
    tags = [boundary.tag(v) for v in invals]
    phys = [self.materialize(x, v.aval) if t is None else boundary.to_physical(x, t)
            for x, v, t in zip(invals, eqn.invars, tags)]
    body = (_compat.call_body(eqn) if kind == "call"
            else eqn.params["call_jaxpr"] if kind == "custom_jvp"
            else ClosedJaxpr(eqn.params["jaxpr"], ()))
    new_body, out_tags = self._conjugate(body, tags, None, boundary, f"the {name!r} body")
    params, consts = _compat.with_body(eqn, new_body)
    if kind == "custom_jvp":

      def jvp_rule(jvp: ClosedJaxpr, in_zeros: Sequence[bool],
                   out_zeros: Sequence[bool]) -> ClosedJaxpr:
        t_in = [t for t, z in zip(tags, in_zeros) if not z]
        t_out = [t for t, z in zip(out_tags, out_zeros) if not z]
        new, _ = self._conjugate(jvp, [*tags, *t_in], [*out_tags, *t_out], boundary,
                                 f"the JVP rule of {name!r}")
        return new

      params = _compat.with_jvp_rule(params, jvp_rule)
    outs = _compat.bind_equation(eqn, [*consts, *phys], params)
    boundary.on_rebuild(self, eqn, kind)
    return [o if t is None else boundary.from_physical(o, t) for o, t in zip(outs, out_tags)]

  def _conjugate(self, closed: ClosedJaxpr, in_tags: Sequence[Any],
                 out_tags: Sequence[Any] | None, boundary: Boundary, where: str,
                 ) -> tuple[ClosedJaxpr, list[Any]]:
    """Traces ``g(*physical inputs) = physical outputs of closed``.

    Args:
      closed: the body.
      in_tags: how each input is held (None: plain).
      out_tags: how each output must be returned, or None to return each in
        the form the body produced it.
      boundary: how values cross.
      where: for errors.

    Returns:
      The new closed jaxpr and the tag of each of its outputs.
    """
    in_avals = [a if t is None else boundary.physical_aval(a, t)
                for a, t in zip(closed.in_avals, in_tags)]
    produced: list[Any] = []

    def body(*phys: Any) -> list[Any]:
      vals = [x if t is None else boundary.from_physical(x, t) for x, t in zip(phys, in_tags)]
      outs = self.eval_jaxpr(closed.jaxpr, closed.consts, vals)
      produced.clear()
      result = []
      for i, (o, aval) in enumerate(zip(outs, closed.out_avals)):
        t = out_tags[i] if out_tags is not None else boundary.tag(o)
        produced.append(t)
        if t is None:
          result.append(self._checked(self.materialize(o, aval), aval, f"output {i} of {where}"))
        else:
          result.append(self._checked(boundary.to_physical(o, t),
                                      boundary.physical_aval(aval, t), f"output {i} of {where}"))
      return result

    new = _compat.trace_to_jaxpr(body, in_avals, closed.jaxpr.debug_info)
    return new, list(produced)

  # -- higher-order primitives -------------------------------------------------

  def _rebuild_higher_order(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
    name = eqn.primitive.name
    where = f"the {name!r} equation's body"
    params = dict(eqn.params)
    extra_operands: list[Any] = []
    for key in _compat.HIGHER_ORDER_PARAMS[name]:
      sub = params.get(key)
      if isinstance(sub, ClosedJaxpr):
        params[key] = self.rewrite_closed(sub, where)
      elif isinstance(sub, tuple):
        params[key] = tuple(self.rewrite_closed(b, where) for b in sub)
      elif isinstance(sub, _compat.Jaxpr):
        new_open, consts = _compat.closed_to_open(
            self.rewrite_closed(ClosedJaxpr(sub, ()), where))
        if consts and name not in _compat.OPERANDS_FROM_CONSTS:
          raise _errors.RewriteError(
              f"Pass {self.pass_.name!r} introduced constants inside the body "
              f"of {name!r}, which cannot take extra operands. Build constants "
              "from the rule's inputs (e.g. jnp.zeros_like) instead.")
        params[key] = new_open
        extra_operands = consts
    params = _compat.wrap_custom_rule(
        name, params, lambda c: self.rewrite_closed(c, f"the derivative rule of {name!r}"))
    return _compat.bind_equation(eqn, [*extra_operands, *invals], params)

  def _eqn_touched(self, eqn: JaxprEqn) -> bool:
    for key in _compat.HIGHER_ORDER_PARAMS.get(eqn.primitive.name, ()):
      sub = eqn.params.get(key)
      subs = sub if isinstance(sub, tuple) else (sub,)
      for s in subs:
        if s is not None and self._touches_jaxpr(getattr(s, "jaxpr", s)):
          return True
    return False

  def _touches_jaxpr(self, jaxpr: _compat.Jaxpr) -> bool:
    """Whether any rule can fire in `jaxpr` or its sub-jaxprs (memoized)."""
    if not self.pass_.skip_untouched:
      return True
    hit = self._touches.get(id(jaxpr))
    if hit is not None:
      return hit[1]
    rules = self._rules
    result = any(
        eqn.primitive.name in rules
        or (_compat.is_higher_order(eqn.primitive.name) and self._eqn_touched(eqn))
        for eqn in jaxpr.eqns) or bool(self.plan(jaxpr).matches)
    self._touches[id(jaxpr)] = (jaxpr, result)
    return result


def _read(env: Mapping[Any, Any], v: Any) -> Any:
  return v.val if isinstance(v, _compat.Literal) else env[v]


def _call_hook(ctx: Context, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
  """The rule `Pass(inline_calls=...)` puts on call primitives."""
  wanted = ctx.pass_.inline_calls
  if _compat.is_plain_call(eqn) and (wanted is True or (callable(wanted)
                                                        and wanted(ctx, eqn, invals))):
    return ctx.inline(eqn, invals)
  if ctx.pass_.boundary is not None:
    return _boundary_hook(ctx, eqn, invals)
  return ctx.default(eqn, invals)


def _boundary_hook(ctx: Context, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
  """The rule `Pass(boundary=...)` puts on the primitives it can rebuild."""
  boundary = ctx.pass_.boundary
  if boundary is not None and boundary.applies(ctx, eqn, invals):
    return ctx.rebuild(eqn, invals, boundary)
  return ctx.default(eqn, invals)


def trace(fun: Callable[..., Any], *args: Any, **kwargs: Any
          ) -> tuple[ClosedJaxpr, list[Any], Any]:
  """Traces `fun(*args, **kwargs)` to a closed jaxpr.

  Returns:
    `(closed_jaxpr, flat_args, out_tree)`: the jaxpr, the leaves of
    `(args, kwargs)` in the order of its inputs, and the pytree structure of
    its result.
  """
  closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args, **kwargs)
  flat_args = jax.tree_util.tree_leaves((args, kwargs))
  return closed, flat_args, jax.tree_util.tree_structure(out_shape)


def eval_jaxpr(closed: ClosedJaxpr, args: Sequence[Any], pass_: Pass, *,
               context: Context | None = None) -> list[Any]:
  """Evaluates a closed jaxpr on flat `args` with `pass_`'s rules.

  Args:
    closed: the jaxpr, e.g. from `jax.make_jaxpr`.
    args: one value per input (arrays or tracers).
    pass_: the rules to apply.
    context: a `Context` to use (to read its `counts` afterwards); a new one
      for the current platform and config by default.

  Returns:
    The outputs, materialized to the jaxpr's output types.
  """
  ctx = context if context is not None else Context(pass_)
  outs = ctx.eval_jaxpr(closed.jaxpr, closed.consts, list(args))
  return ctx.finish(outs, closed.out_avals, "the function")


def rewrite_jaxpr(closed: ClosedJaxpr, pass_: Pass, *,
                  context: Context | None = None) -> ClosedJaxpr:
  """Returns the closed jaxpr that `pass_` makes of `closed`, same types in and out.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import rewrite
    >>> p = rewrite.Pass("double_sin", {"sin": lambda ctx, e, x: [2 * jnp.sin(x[0])]})
    >>> closed = jax.make_jaxpr(jnp.sin)(1.0)
    >>> [e.primitive.name for e in rewrite.rewrite_jaxpr(closed, p).eqns]
    ['sin', 'mul']
  """
  ctx = context if context is not None else Context(pass_)
  return ctx.rewrite_closed(closed, "the function")


def transform(fun: Callable[..., Any], pass_: Pass, *, platform: str | None = None,
              on_trace: Callable[[Context], None] | None = None) -> Callable[..., Any]:
  """Returns `fun` with `pass_` applied to its jaxpr at every call.

  The returned function traces `fun` on its arguments, evaluates the jaxpr
  with the pass's rules and returns the result in `fun`'s output structure.
  Under `jax.jit` this happens once per input signature, inside jit's own
  trace; it composes with `jax.grad`, `jax.vmap` and sharded inputs like any
  JAX function. Every leaf of the arguments must be an array or scalar: close
  over static Python values (`functools.partial`) before transforming.

  Args:
    fun: the function to rewrite.
    pass_: the `Pass` to apply.
    platform: the platform rules see; default `jax.default_backend()`.
    on_trace: called with the `Context` after each trace, to collect what the
      pass did (its `counts`) without storing per-call state on `fun`.

  Returns:
    A function with `fun`'s signature.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import rewrite
    >>> identity = rewrite.Pass("identity")
    >>> f = jax.jit(rewrite.transform(lambda x: jnp.tanh(x) @ x, identity))
    >>> f(jnp.eye(2)).shape
    (2, 2)
  """

  @functools.wraps(fun)
  def rewritten(*args: Any, **kwargs: Any) -> Any:
    closed, flat_args, out_tree = trace(fun, *args, **kwargs)
    ctx = Context(pass_, platform=platform)
    outs = eval_jaxpr(closed, flat_args, pass_, context=ctx)
    if on_trace is not None:
      on_trace(ctx)
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return rewritten
