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
"""

from tunedjax.rewrite._engine import Boundary as Boundary
from tunedjax.rewrite._engine import Context as Context
from tunedjax.rewrite._engine import Pass as Pass
from tunedjax.rewrite._engine import Rule as Rule
from tunedjax.rewrite._engine import eval_jaxpr as eval_jaxpr
from tunedjax.rewrite._engine import rewrite_jaxpr as rewrite_jaxpr
from tunedjax.rewrite._engine import trace as trace
from tunedjax.rewrite._engine import transform as transform
from tunedjax.rewrite._walk import count_primitives as count_primitives
from tunedjax.rewrite._walk import iter_equations as iter_equations

__all__ = [
    "Boundary",
    "Context",
    "Pass",
    "Rule",
    "count_primitives",
    "eval_jaxpr",
    "iter_equations",
    "rewrite_jaxpr",
    "trace",
    "transform",
]
