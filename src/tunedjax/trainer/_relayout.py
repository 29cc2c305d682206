"""Convolution weights kept, between steps, in the layout their convolutions run in.

The layout pass runs an NCHW model's convolutions in NHWC on CPU (see
`tunedjax.layout.preferred`), but it keeps a function's inputs in their
layout: an OIHW kernel that is an input of the step is transposed to HWIO
on every call, forward and (for its gradient) backward. The Trainer owns its
state between steps, so it can do better: `plan` asks the layout pass which
parameters are such kernels (`LayoutReport.kernel_inputs`), and a
`WeightLayout` keeps those parameters, and the optimizer state that mirrors
them (momentum, Adam's moments: same path, same shape), stored transposed.
Its wrapped step undoes the transpose at its top and redoes it at its end,
inside the compiled function, where the layout pass absorbs both (a user's
transpose is a change of layout, not data movement): the per-step weight
transposes are gone.

The wrapped step computes exactly the original step on the original layout,
whatever the optimizer is (an optimizer that is not elementwise sees the
weights in their own layout, at the price of a transpose), so a choice of
leaves can cost speed, never correctness. Everything the user reads (the
model, `Trainer.variables`, checkpoints) is converted back.

Example:
  >>> import jax.numpy as jnp
  >>> layout = WeightLayout({0: (2, 3, 1, 0)}, target="NHWC", weights=("conv",))
  >>> stored = layout.to_stored([jnp.ones((8, 3, 5, 5)), jnp.ones(8)])
  >>> stored[0].shape, layout.to_logical(stored)[0].shape
  ((5, 5, 3, 8), (8, 3, 5, 5))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax import lax

from tunedjax import _pipeline
from tunedjax._config import Config
from tunedjax.layout._value import Perm, inverse

logger = logging.getLogger("tunedjax.trainer")

KEY = "layout_weights"  # the History.tuning entry


def _path(path: Sequence[Any]) -> str:
  return jax.tree_util.keystr(tuple(path))


class WeightLayout:
  """Which leaves of a pytree are stored transposed, and how.

  Leaf ``i`` (in ``jax.tree_util.tree_leaves`` order) is stored as
  ``transpose(logical, perms[i])``; every other leaf as it is.

  Attributes:
    perms: ``{leaf index: perm}``.
    target: the layout the convolutions run in (``"NHWC"``, ``"NCHW"``).
    weights: the re-laid parameters' paths, for the report.
    mirrors: how many optimizer-state leaves are re-laid with them.
  """

  def __init__(self, perms: Mapping[int, Perm], *, target: str,
               weights: Sequence[str] = (), mirrors: int = 0):
    self.perms = {int(i): tuple(p) for i, p in perms.items()}
    self._inverse = {i: inverse(p) for i, p in self.perms.items()}
    self.target = target
    self.weights = tuple(weights)
    self.mirrors = int(mirrors)
    self._converters: dict[tuple[tuple[int, Perm], ...], Callable[..., Any]] = {}

  def __repr__(self) -> str:
    return (f"WeightLayout({len(self.weights)} weights and {self.mirrors} optimizer "
            f"leaves stored for {self.target})")

  def _apply(self, tree: Any, perms: Mapping[int, Perm]) -> Any:
    """`tree` with its leaves transposed; in a trace, as plain `lax.transpose`s (which
    the layout pass absorbs), else in one compiled program (one dispatch)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    chosen = tuple((i, perms[i]) for i in sorted(perms) if i < len(leaves))
    if any(isinstance(leaves[i], jax.core.Tracer) for i, _ in chosen):
      for i, perm in chosen:
        leaves[i] = lax.transpose(leaves[i], perm)
    elif chosen:
      convert = self._converters.get(chosen)
      if convert is None:
        convert = self._converters[chosen] = jax.jit(
            lambda xs: [lax.transpose(x, p) for x, (_, p) in zip(xs, chosen)])
      for (i, _), x in zip(chosen, convert([leaves[i] for i, _ in chosen])):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def to_stored(self, tree: Any) -> Any:
    """`tree` (in the model's own layout) as the steps keep it.

    `tree` is the whole state, or a prefix of its leaves (its parameters).
    """
    return self._apply(tree, self.perms)

  def to_logical(self, tree: Any) -> Any:
    """`tree` (as the steps keep it) back in the model's own layout (whole, or its
    parameters)."""
    return self._apply(tree, self._inverse)

  def logical_abstract(self, tree: Any) -> Any:
    """``jax.ShapeDtypeStruct``s of `to_logical(tree)`, shardings kept (nothing runs)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for i, x in enumerate(leaves):
      shape, sharding = tuple(x.shape), getattr(x, "sharding", None)
      if i in self._inverse:
        inv = self._inverse[i]
        shape = tuple(shape[a] for a in inv)
        sharding = _permuted_sharding(sharding, inv)
      out.append(jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, out)

  def wrap_step(self, step: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    """``step(state, batch) -> (state, out)`` on stored states, computing `step`."""

    def stored_step(state: Any, batch: Any) -> tuple[Any, Any]:
      new, out = step(self.to_logical(state), batch)
      return self.to_stored(new), out

    stored_step.__name__ = getattr(step, "__name__", "step")
    stored_step.__qualname__ = getattr(step, "__qualname__", stored_step.__name__)
    return stored_step

  def wrap_reader(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(state, x)`` (evaluation, prediction) on stored states."""

    def stored_reader(state: Any, x: Any) -> Any:
      return fn(self.to_logical(state), x)

    stored_reader.__name__ = getattr(fn, "__name__", "fn")
    stored_reader.__qualname__ = getattr(fn, "__qualname__", stored_reader.__name__)
    return stored_reader

  def summary(self) -> dict[str, Any]:
    """A JSON-able account for `History.tuning` (``"layout_weights"``)."""
    perms = sorted({str(p) for i, p in self.perms.items()})
    return {"target": self.target, "weights": len(self.weights),
            "optimizer_leaves": self.mirrors, "perms": perms,
            "reason": ("convolution kernels kept in the layout the layout pass runs them "
                       "in, so no step transposes them; converted back for the model "
                       "and checkpoints")}


def _permuted_sharding(sharding: Any, perm: Perm) -> Any:
  """A `NamedSharding` for the transposed array (others are returned as they are)."""
  spec = getattr(sharding, "spec", None)
  if spec is None or not len(spec):
    return sharding
  full = tuple(spec) + (None,) * (len(perm) - len(spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
      *(full[a] for a in perm)))


def _abstract(tree: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, tree)


def plan(forward: Callable[[Any, Any, Any, Any], Any], state: Any, batch: Any,
         config: Config, *, platform: str | None = None) -> WeightLayout | None:
  """Which of `state`'s leaves to keep transposed, from the layout pass's report.

  Traces ``forward(params, rest, batch, rng)`` (the loss, forward only:
  convolutions read their kernels there as in the whole step) through the
  passes the config enables up to and including layout, exactly as
  `tunedjax.jit` would (mixed precision changes which layout is preferred),
  and reads `LayoutReport.kernel_inputs`. Nothing is compiled or run.

  Args:
    forward: the loss as a function of the state's parts.
    state: the `TrainState` (arrays or `jax.ShapeDtypeStruct`s).
    batch: one batch.
    config: the trainer's config.
    platform: the platform the passes rewrite for (default: JAX's default).

  Returns:
    A `WeightLayout`, or None when nothing would be saved: layout pass off,
    in ``"measure"`` mode (the decision is timed per program, and a stored
    layout the program does not use costs two transposes), or no parameter
    is a kernel the pass transposes.
  """
  if not config.layout.enable or config.layout.mode != "heuristic":
    return None
  if not any(getattr(x, "ndim", 0) >= 3 for x in jax.tree_util.tree_leaves(state.params)):
    return None  # no parameter can be a convolution kernel: nothing to trace
  stages = []
  for stage in _pipeline.plan(config, platform):
    if isinstance(stage, (_pipeline.KernelStage, _pipeline.CleanupStage)):
      continue
    stages.append(stage)
  program: Callable[..., Any] = forward
  for stage in stages:
    program = stage.apply(program, platform)
  jax.make_jaxpr(program)(*_abstract((state.params, state.rest, batch, state.rng)))
  report = next((r for s in stages for r in s.reports() if r.name == "layout"), None)
  if report is None or report.decision != "relaid" or not report.kernel_inputs:
    return None
  params = jax.tree_util.tree_flatten_with_path(state.params)[0]
  kernels = {i: p for i, p in report.kernel_inputs.items() if i < len(params)}
  if not kernels:
    return None
  return _for_state(state, params, kernels, report.target)


def _for_state(state: Any, params: list[tuple[Any, Any]], kernels: Mapping[int, Perm],
               target: str) -> WeightLayout:
  """The `WeightLayout` over `state`'s leaves: the kernels and their optimizer mirrors."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  n_before = len(jax.tree_util.tree_leaves(state.params))
  assert len(params) == n_before  # TrainState: params are its first field
  by_path = {tuple(params[i][0]): (perm, tuple(params[i][1].shape))
             for i, perm in kernels.items()}
  perms: dict[int, Perm] = dict(kernels)
  mirrors = 0
  opt_field = jax.tree_util.GetAttrKey("opt_state")
  for index, (path, leaf) in enumerate(leaves):
    if index < n_before or not path or path[0] != opt_field:
      continue
    shape = tuple(getattr(leaf, "shape", ()))
    for start in range(1, len(path)):
      hit = by_path.get(tuple(path[start:]))
      if hit is not None and hit[1] == shape:
        perms[index] = hit[0]
        mirrors += 1
        break
  names = [_path(params[i][0]) for i in sorted(kernels)]
  logger.info("Trainer: %d convolution kernels (and %d optimizer-state leaves) stored for "
              "%s between steps: %s", len(names), mirrors, target, ", ".join(names))
  return WeightLayout(perms, target=target, weights=names, mirrors=mirrors)
