"""The learning rate of each step, read from the optimizer state inside the step.

optax keeps a schedule's *value* in the optimizer state only under
`optax.inject_hyperparams`; a plain schedule (``optax.adam(schedule)``) is a
function inside the transformation, and its state holds just the update count
(`optax.ScaleByScheduleState`). So the rule, decided once from the state's
structure, is:

1. ``inject_hyperparams``: the ``learning_rate`` entry of the first
   ``hyperparams`` in the state after the update: the value that update used
   (on a skipped update, the previous one).
2. Else, with the Trainer's ``schedule=`` (the function given to the optax
   factory, or a number): ``schedule(count)``, where ``count`` is the first
   `optax.ScaleByScheduleState`'s count before the update, which is exactly what
   optax passes to the schedule (skipped updates and `optax.MultiSteps`'
   accumulation steps do not advance it); without one, the first ``count``
   field in the state; without any, the Trainer's step.
3. Else: unknown (not in the logs; nan in `History.learning_rates`).

Limits: a schedule that is not passed to the Trainer cannot be read from a
plain optax state; with several schedules in one optimizer (one per parameter
group in `optax.multi_transform`, or two chained `scale_by_schedule`), the
first in the state's order is the one reported.

Example:
  >>> import jax.numpy as jnp, optax
  >>> opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
  >>> read = reader(opt.init({"w": jnp.ones(2)}), None)
  >>> state = opt.init({"w": jnp.ones(2)})
  >>> float(read(state, state, jnp.int32(0)))
  0.5
  >>> schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
  >>> opt = optax.adam(schedule)
  >>> state = opt.init({"w": jnp.ones(2)})
  >>> _, after = opt.update({"w": jnp.ones(2)}, state)
  >>> round(float(reader(state, schedule)(after, after, jnp.int32(0))), 6)  # count 1
  0.9
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from optax import tree_utils as otu

from tunedjax._errors import show_value
from tunedjax.trainer._model import TrainerError

# reader(opt_state before the update, after it, the trainer's step) -> a scalar.
Reader = Callable[[Any, Any, jax.Array], jax.Array]


def _is_scalar_leaf(value: Any) -> bool:
  return hasattr(value, "shape") and hasattr(value, "dtype") and value.shape == ()


def _injected(state: Any) -> Callable[[Any], Any] | None:
  """The getter of the first injected ``learning_rate`` (a ``hyperparams`` entry)."""
  def is_hyperparam(path: tuple[Any, ...], value: Any) -> bool:
    names = [getattr(k, "name", None) for k in path]
    return len(names) >= 2 and names[-2] == "hyperparams" and _is_scalar_leaf(value)

  found = otu.tree_get_all_with_path(state, "learning_rate", filtering=is_hyperparam)
  if not found:
    return None
  path = found[0][0]
  return lambda tree: otu.tree_get_all_with_path(
      tree, "learning_rate", filtering=lambda p, v: p == path)[0][1]


def _count(state: Any) -> tuple[str, Callable[[Any], Any]] | None:
  """What the count a schedule is called with is, and its getter."""
  for key, what in (("ScaleByScheduleState", "count of ScaleByScheduleState"),
                    ("count", "first count in the optimizer state")):
    found = otu.tree_get_all_with_path(state, key)
    found = [(p, v) for p, v in found
             if _is_scalar_leaf(v if key == "count" else getattr(v, "count", None))]
    if found:
      path = found[0][0]

      def get(tree: Any, path: Any = path, key: str = key) -> Any:
        node = otu.tree_get_all_with_path(tree, key, filtering=lambda p, v: p == path)[0][1]
        return node if key == "count" else node.count

      return what, get
  return None


def _check(schedule: Any) -> None:
  if schedule is None or callable(schedule):
    return
  if isinstance(schedule, numbers.Real) and not isinstance(schedule, bool):
    return
  raise TrainerError(f"schedule must be None, a number or a function count -> learning "
                     f"rate (the one given to the optax optimizer), got {show_value(schedule)}.")


def reader(state: Any, schedule: Any) -> Reader | None:
  """How a step reads its learning rate from the optimizer state (None: unknown).

  Args:
    state: the optimizer state (its structure decides the rule).
    schedule: None, a number, or the schedule the optimizer was built with.
  """
  _check(schedule)
  injected = _injected(state)
  if injected is not None:
    return lambda old, new, step: jnp.asarray(injected(new), jnp.float32)
  if schedule is None:
    return None
  if not callable(schedule):
    value = float(schedule)
    return lambda old, new, step: jnp.float32(value)
  count = _count(state)
  if count is None:
    return lambda old, new, step: jnp.asarray(schedule(step), jnp.float32)
  get = count[1]
  return lambda old, new, step: jnp.asarray(schedule(get(old)), jnp.float32)
