"""Pattern sites: an op family's computation found written out in a jaxpr.

A family's pattern (`OpFamily.patterns`) looks at a jaxpr and returns a
`PatternSite` for each forward computation of its own it recognises (a
batch norm written as reductions and arithmetic): the equations, the inputs
in order, the outputs (the first is the primary one), the family's spec,
and how to call the family's kernel on the inputs (`PatternSite.call`).
This module turns each site into `rewrite.Match`es, family-agnostic:

- if nothing but the site's outputs is read outside its equations, one
  match replaces the forward: the chosen kernel runs in its place (its own
  backward serves a later `jax.grad`);
- otherwise, in a differentiated jaxpr, the backward region that reads the
  forward's intermediates is found and verified numerically
  (`rewrite._backward.find_backward`), and two linked matches replace both:
  ``out, vjp = jax.vjp(kernel call, *inputs)`` at the forward, the region's
  outputs from ``vjp(cotangent)`` at the backward;
- otherwise (an intermediate read by something that is not the backward,
  a region that does not verify) nothing: the equations stay as written.

A site is decided like any other (hint, phase, cache, tuner); when the
default kernel is chosen its equations are evaluated as written. A backward
region's check is kept in the tuning cache (namespace ``"backward"``, by a
digest of the region's structure: `BackwardChecks`), so a later process with
a warm cache compiles no check again.

Example:
  >>> site = PatternSite("batch_norm", spec=None, eqns=(0, 1), inputs=(), outputs=(),
  ...                    call=lambda kernel, *xs: kernel(*xs), spelling="two-pass")
  >>> site.spelling, site.eqns
  ('two-pass', (0, 1))
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from tunedjax import _tuning
from tunedjax.autotune import _multihost, _registry, _report
from tunedjax.rewrite import _backward, _compat, _engine, _pattern

logger = logging.getLogger("tunedjax.autotune")

# The name scope `dispatch` traces a call-site family's kernel in: a pattern site
# there is that kernel's own computation (already a site), not the user's.
SITE_SCOPE = "tunedjax_site"


@dataclasses.dataclass(frozen=True, eq=False)
class PatternSite:
  """One forward computation of an op family found in a jaxpr by its pattern.

  Attributes:
    family: the op family's name.
    spec: the site's spec (an instance of the family's `spec_type`).
    eqns: indices into ``jaxpr.eqns`` of the forward's equations.
    inputs: the values (variables or literals) the forward reads, in the
      order `call` takes them.
    outputs: the variables the kernel supplies; ``outputs[0]`` is the
      primary one (the one whose cotangent a backward receives; the others,
      such as a batch norm's mean and variance read for running averages,
      get zero cotangents). Every value of `eqns` read elsewhere must be here
      for the forward alone to be replaced.
    call: ``call(kernel, *invals) -> one value per output``: runs the family's
      kernel, ``kernel(*operands)`` (the chosen kernel with the spec bound),
      on the inputs and maps its result back (transposes, reshapes, casts),
      differentiably.
    spelling: which way of writing it this is, for reports (``"two-pass rsqrt"``).
  """

  family: str
  spec: Any
  eqns: tuple[int, ...]
  inputs: tuple[Any, ...]
  outputs: tuple[Any, ...]
  call: Callable[..., Sequence[Any]]
  spelling: str = ""


NAMESPACE = "backward"


def _validate(value: Any) -> None:
  _backward.outcome_from_json(value)  # raises ValueError on anything malformed


_tuning.register_validator(NAMESPACE, _validate)


@dataclasses.dataclass(frozen=True)
class BackwardChecks:
  """Backward regions' checks in the tuning cache (a `rewrite._backward.VerificationStore`).

  Attributes:
    session: the tuning session that reads and writes the cache.
    cache: the tuning cache (None: the session's memory only).

  Example:
    >>> checks = BackwardChecks(_tuning.TuningSession(), None)
    >>> checks.save("ab12", {"verified": False}); checks.load("ab12"), checks.load("cd34")
    ({'verified': False}, None)
  """

  session: _tuning.TuningSession
  cache: Any

  def load(self, digest: str) -> dict[str, Any] | None:
    return self.session.lookup(self.cache, NAMESPACE, {"region": digest})

  def save(self, digest: str, value: Any) -> None:
    # Only process 0 writes the cache (as kernel decisions); the others keep it in memory.
    cache = self.cache if _multihost.is_leader() else None
    self.session.store(cache, NAMESPACE, {"region": digest}, value)


class Chooser(Protocol):
  """How kernel selection decides a site and records it (`_select` gives one)."""

  def checks(self, ctx: _engine.Context) -> _backward.VerificationStore | None:
    """Where backward regions' checks are kept across processes (None: nowhere)."""

  def choose(self, ctx: _engine.Context, family: _registry.OpFamily, spec: Any
             ) -> tuple[str, str]:
    """``(kernel name, why)`` for the site."""

  def record(self, ctx: _engine.Context, family: _registry.OpFamily, kernel: str, why: str,
             matched: _report.MatchedSite, spec: Any = None) -> None:
    """Counts the site in the trace's tally and lists it (in `spec`'s bucket)."""


def _escaping(jaxpr: Any, eqns: Sequence[int]) -> set[Any]:
  """The values `eqns` define that something else reads (or the jaxpr returns)."""
  mine = set(eqns)
  defined = {v for i in mine for v in jaxpr.eqns[i].outvars}
  found = {v for i, e in enumerate(jaxpr.eqns) if i not in mine for v in e.invars
           if not isinstance(v, _compat.Literal) and v in defined}
  found.update(v for v in jaxpr.outvars if not isinstance(v, _compat.Literal) and v in defined)
  return found


def _eval_original(ctx: _engine.Context, jaxpr: Any, order: Sequence[int],
                   env: dict[Any, Any]) -> None:
  for i in sorted(order):
    ctx.eval_equation(jaxpr.eqns[i], env)


class _SiteRun:
  """Runs one site's forward (and backward) with the kernel chosen for it."""

  def __init__(self, jaxpr: Any, site: PatternSite, family: _registry.OpFamily,
               chooser: Chooser, backward: _backward.Backward | None):
    self.jaxpr, self.site, self.family = jaxpr, site, family
    self.chooser, self.backward = chooser, backward
    self.state: dict[str, Any] = {}

  def matched(self, kernel: str) -> _report.MatchedSite:
    replaced = ("none" if kernel == self.family.default
                else "forward+backward" if self.backward is not None else "forward")
    return _report.MatchedSite(self.family.name, self.site.spelling,
                               _compat.where(self.jaxpr.eqns[min(self.site.eqns)]), kernel,
                               replaced)

  def forward(self, ctx: _engine.Context, invals: Sequence[Any]) -> list[Any]:
    site = self.site
    name, why = self.chooser.choose(ctx, self.family, site.spec)
    if name != self.family.default:
      try:
        outs = self._kernel_forward(name, invals)
      except Exception as e:  # pylint: disable=broad-except  # never worse than the default
        logger.warning("autotune: %s kernel %r could not be applied to the %s at %s "
                       "(%s: %s); using %s.", self.family.name, name, site.spelling,
                       self.matched(name).where, type(e).__name__, e, self.family.default)
        why = _report.FAILED
      else:
        self.chooser.record(ctx, self.family, name, why, self.matched(name), site.spec)
        return outs
    env = {v: x for v, x in zip(site.inputs, invals) if not isinstance(v, _compat.Literal)}
    _eval_original(ctx, self.jaxpr, site.eqns, env)
    self.state["run"] = ("original", env)
    self.chooser.record(ctx, self.family, name, why, self.matched(self.family.default),
                        site.spec)
    return [env[v] for v in site.outputs]

  def _kernel_forward(self, name: str, invals: Sequence[Any]) -> list[Any]:
    kernel = _registry.get_kernel(self.family.name, name).fn
    spec = self.site.spec
    call = lambda *xs: tuple(self.site.call(lambda *ops: kernel(*ops, spec), *xs))
    if self.backward is None:
      outs = call(*invals)
    else:
      outs, vjp = jax.vjp(call, *invals)
      self.state["run"] = ("kernel", vjp)
    want = [(v.aval.shape, v.aval.dtype) for v in self.site.outputs]
    got = [(tuple(jnp.shape(o)), jnp.result_type(o)) for o in outs]
    if got != want:
      raise TypeError(f"it returned {got} for {want}")
    return list(outs)

  def backward_rule(self, ctx: _engine.Context, invals: Sequence[Any]) -> list[Any]:
    back = self.backward
    kind, obj = self.state.pop("run")
    ct = invals[0]
    if kind == "kernel":
      zeros = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in self.site.outputs[1:]]
      cts = obj((ct, *zeros))
      return [cts[j] for j in back.wrt]
    env = obj
    env[back.cotangent] = ct
    _eval_original(ctx, self.jaxpr, back.eqns, env)
    return [env[v] for v in back.outputs]


def site_matches(ctx: _engine.Context, jaxpr: Any, site: PatternSite,
                 family: _registry.OpFamily, chooser: Chooser) -> list[_pattern.Match]:
  """The matches that replace `site` (forward alone, or forward and backward), or none.

  Args:
    ctx: the engine's context.
    jaxpr: the jaxpr the site indexes into.
    site: what the family's pattern found.
    family: its `OpFamily`.
    chooser: decides and records the site when the match fires.

  Returns:
    One match, two linked ones, or an empty list (left alone).
  """
  name = f"{family.name} {site.spelling}".strip()
  if _escaping(jaxpr, site.eqns) <= set(site.outputs):
    run = _SiteRun(jaxpr, site, family, chooser, None)
    return [_pattern.Match(site.eqns, site.inputs, site.outputs, run.forward, name=name)]
  back = _backward.find_backward(jaxpr, site.eqns, site.inputs, site.outputs,
                                 chooser.checks(ctx))
  if back is None:
    logger.debug("autotune: %s at %s left alone: its intermediates are read by "
                 "something other than a backward that verifies.", name,
                 _compat.where(jaxpr.eqns[min(site.eqns)]))
    return []
  run = _SiteRun(jaxpr, site, family, chooser, back)
  fwd = _pattern.Match(site.eqns, site.inputs, site.outputs, run.forward, name=name)
  var_inputs = tuple(v for v in site.inputs if not isinstance(v, _compat.Literal))
  bwd = _pattern.Match(back.eqns, (back.cotangent, site.outputs[0], *var_inputs),
                       back.outputs, run.backward_rule, name=f"{name} backward",
                       requires=(fwd,))
  return [fwd, bwd]


def family_patterns(families: Sequence[_registry.OpFamily], chooser: Chooser
                    ) -> tuple[_pattern.Pattern, ...]:
  """One engine pattern per family pattern, turning its sites into matches."""

  def engine_pattern(family: _registry.OpFamily, pattern: Callable[..., Any]
                     ) -> _pattern.Pattern:
    def find(ctx: _engine.Context, jaxpr: Any) -> list[_pattern.Match]:
      found: list[_pattern.Match] = []
      try:
        for site in pattern(ctx, jaxpr):
          if not any(_compat.in_scope(jaxpr.eqns[i], SITE_SCOPE) for i in site.eqns):
            found.extend(site_matches(ctx, jaxpr, site, family, chooser))
      except Exception as e:  # pylint: disable=broad-except  # a pattern never breaks a program
        logger.warning("autotune: the %s pattern %s failed (%s: %s); its sites in this "
                       "jaxpr are left alone.", family.name,
                       getattr(pattern, "__qualname__", pattern), type(e).__name__, e)
        return []
      return found
    return find

  return tuple(engine_pattern(f, p) for f in families for p in f.patterns)
