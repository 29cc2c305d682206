"""The jaxpr rewriting engine that every tunedjax pass builds on.

A pass is a table of per-primitive rules; the engine evaluates a function's
jaxpr with them, recursing into `jit`, `scan`, `while`, `cond`, `remat`,
`custom_jvp_call` and `custom_vjp_call` bodies, inside the caller's own trace.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import rewrite
  >>> p = rewrite.Pass("exp_as_f32", {"exp": lambda ctx, eqn, x: [jnp.exp(x[0])]})
  >>> jax.jit(rewrite.transform(jnp.exp, p))(0.0)
  Array(1., dtype=float32, weak_type=True)

Patterns
--------

``Pass(patterns=...)`` carries functions ``(ctx, jaxpr) -> [Match, ...]``:
a `Match` replaces several equations with one rule (a batch norm written
out in primitives becomes one kernel call). See `tunedjax.rewrite._pattern`.

Hooks for calls and higher-order primitives
-------------------------------------------

A pass never names `jit`, `remat2` or `custom_jvp_call` itself; it asks the
engine, which knows how each is built (and, in `_compat`, how each JAX
release spells it):

- ``Pass(inline_calls=True)`` (or a predicate ``(ctx, eqn, invals) -> bool``)
  sees through *plain calls*: a nested `jax.jit` that pins no shardings or
  layouts, donates nothing and sets no compiler options, or a
  `closed_call`. The call's body is evaluated in its place
  (`Context.inline`), so the pass's values flow through `jax.numpy` and
  `jax.nn` helpers, which are jitted. Autocast and layout both inline.
- ``Pass(boundary=b)`` rebuilds `jax.checkpoint` bodies, `custom_jvp_call`
  (with its JVP rule) and plain calls around values the pass holds in its
  own form (`Context.rebuild`): `b`, a `Boundary`, says how a value is held
  (`tag`) and what array crosses the call's edge (`to_physical`,
  `from_physical`, `physical_aval`). The layout pass keeps re-laid
  activations re-laid across ``jax.nn.relu`` and checkpointed blocks this
  way. `custom_vjp_call` (its backward rule is user code on plain values),
  `scan`, `while` and `cond` end a boundary: their operands are materialized.
- A rule of the pass's own for a call primitive wins, and may call
  ``ctx.inline(eqn, invals)`` or ``ctx.rebuild(eqn, invals, boundary)``.
- ``Pass(keep=predicate)`` leaves a region alone: an equation for which
  ``predicate(ctx, eqn)`` holds (asked with its name stack current, so a
  `jax.named_scope` marks the region) is bound exactly as traced
  (`Context.as_traced`), its body never entered. Autocast keeps
  `tunedjax.mixed_precision.as_traced` blocks this way.

Example:
  >>> p = rewrite.Pass("sin_to_cos", {"sin": lambda ctx, e, x: [jnp.cos(x[0])]})
  >>> seen = lambda p: [e.primitive.name for e in
  ...                   jax.make_jaxpr(rewrite.transform(lambda x: jax.jit(jnp.sin)(x), p))(1.0).eqns]
  >>> seen(p), seen(rewrite.Pass("sin_to_cos", p.rules, inline_calls=True))
  (['jit'], ['cos'])

  A pass that holds negated values lazily (``Neg(a)`` is ``-a``, so ``-(-a)``
  costs nothing) keeps them lazy across a checkpointed block:

  >>> class Neg:
  ...   def __init__(self, array): self.array = array
  >>> def neg(ctx, eqn, invals):
  ...   x = invals[0]
  ...   return [x.array if isinstance(x, Neg) else Neg(x)]
  >>> class NegBoundary(rewrite.Boundary):
  ...   def tag(self, value): return "neg" if isinstance(value, Neg) else None
  ...   def to_physical(self, value, tag): return value.array if isinstance(value, Neg) else -value
  ...   def from_physical(self, array, tag): return Neg(array)
  ...   def physical_aval(self, aval, tag): return aval
  >>> unneg = lambda value, aval: -value.array if isinstance(value, Neg) else value
  >>> f = lambda x: jnp.sin(jax.checkpoint(lambda y: -y)(-x))
  >>> for b in (None, NegBoundary()):
  ...   g = rewrite.transform(f, rewrite.Pass("lazy_neg", {"neg": neg}, materialize=unneg, boundary=b))
  ...   print(rewrite.count_primitives(jax.make_jaxpr(g)(1.0))["neg"], bool(g(0.5) == f(0.5)))
  2 True
  0 True
"""

from tunedjax.rewrite._engine import Boundary as Boundary
from tunedjax.rewrite._engine import Context as Context
from tunedjax.rewrite._engine import Pass as Pass
from tunedjax.rewrite._engine import Rule as Rule
from tunedjax.rewrite._engine import eval_jaxpr as eval_jaxpr
from tunedjax.rewrite._engine import rewrite_jaxpr as rewrite_jaxpr
from tunedjax.rewrite._engine import trace as trace
from tunedjax.rewrite._engine import transform as transform
from tunedjax.rewrite._pattern import Match as Match
from tunedjax.rewrite._pattern import Pattern as Pattern
from tunedjax.rewrite._walk import count_primitives as count_primitives
from tunedjax.rewrite._walk import iter_equations as iter_equations

__all__ = [
    "Boundary",
    "Context",
    "Match",
    "Pass",
    "Pattern",
    "Rule",
    "count_primitives",
    "eval_jaxpr",
    "iter_equations",
    "rewrite_jaxpr",
    "trace",
    "transform",
]
