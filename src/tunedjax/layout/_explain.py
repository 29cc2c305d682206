"""`explain(f, *args)`: the layout report for one call, with exact transpose counts.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import layout
  >>> f = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
  >>> r = layout.explain(f, jnp.ones((1, 2, 4, 4)), jnp.ones((3, 2, 1, 1)))
  >>> r.decision, r.transposes_before
  ('relaid', 0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from tunedjax import rewrite
from tunedjax.layout._optimize import optimize
from tunedjax.layout._report import LayoutReport


def explain(f: Callable[..., Any], *args: Any, target: str = "auto",
            mode: str = "heuristic", platform: str | None = None,
            **kwargs: Any) -> LayoutReport:
  """Traces `layout.optimize(f)` on `args` and reports what the pass does.

  Nothing is executed in heuristic mode (the function is only traced);
  measure mode compiles and times both versions, as a call would.

  Args:
    f: the function.
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
    target: as in `optimize`.
    mode: as in `optimize`.
    platform: as in `optimize`.
    **kwargs: keyword arguments of `f`.

  Returns:
    A `LayoutReport` whose `transposes_before`/`transposes_after` count the
    transposes of the original and of the rewritten jaxpr (sub-jaxprs
    included). ``print(report)`` shows it in words.
  """
  opt = optimize(f, target=target, mode=mode, platform=platform)
  after = jax.make_jaxpr(opt)(*args, **kwargs)
  before = jax.make_jaxpr(f)(*args, **kwargs)
  report = opt.report()
  return dataclasses.replace(
      report, transposes_before=rewrite.count_primitives(before)["transpose"],
      transposes_after=rewrite.count_primitives(after)["transpose"])
