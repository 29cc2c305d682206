"""Reading jaxprs: walk every equation, count primitives.

Passes rewrite through the engine; tests, reports and benchmarks read the
result through these helpers rather than each walking jaxprs on their own.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax.extend.core as jex_core


def _as_jaxpr(jaxpr: Any) -> jex_core.Jaxpr:
  return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def iter_equations(jaxpr: Any, *, recursive: bool = True) -> Iterator[jex_core.JaxprEqn]:
  """Yields the equations of `jaxpr` (a Jaxpr or ClosedJaxpr), depth first.

  Args:
    jaxpr: the jaxpr to read.
    recursive: also yield the equations of every sub-jaxpr (loop bodies,
      branches, called functions), each after the equation that holds it.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import rewrite
    >>> closed = jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0)
    >>> sorted({e.primitive.name for e in rewrite.iter_equations(closed)})
    ['cond', 'convert_element_type', 'cos', 'gt', 'sin']
  """
  for eqn in _as_jaxpr(jaxpr).eqns:
    yield eqn
    if recursive:
      for sub in jex_core.jaxprs_in_params(eqn.params):
        yield from iter_equations(sub, recursive=True)


def count_primitives(jaxpr: Any, *, recursive: bool = True) -> collections.Counter[str]:
  """Counts the equations of `jaxpr` by primitive name (see `iter_equations`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import rewrite
    >>> rewrite.count_primitives(jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.sin(x))(1.0))
    Counter({'sin': 2, 'add': 1})
  """
  return collections.Counter(e.primitive.name for e in iter_equations(jaxpr, recursive=recursive))
