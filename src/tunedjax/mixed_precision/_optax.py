"""Optax wrappers for mixed precision: skip non-finite steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from tunedjax.mixed_precision._loss_scale import all_finite, select_tree


class SkipNonFiniteState(NamedTuple):
  """State of `skip_nonfinite`.

  Attributes:
    inner_state: the wrapped optimizer's state.
    skipped: how many steps were skipped so far (int32).
    consecutive_skipped: skipped steps since the last finite one (int32).
    last_finite: whether the last step's updates were finite.
  """

  inner_state: Any
  skipped: jax.Array
  consecutive_skipped: jax.Array
  last_finite: jax.Array


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Wraps an optimizer so a step with an inf or NaN gradient changes nothing.

  On such a step the returned updates are zeros (so `optax.apply_updates`
  leaves the parameters as they were, bit for bit) and the inner optimizer's
  state is kept as it was (its moments never see the NaN); the step is
  counted in `SkipNonFiniteState.skipped`. Combined with a `DynamicLossScale`
  this is what Paddle's and PyTorch's `GradScaler` do on an overflow.

  Args:
    inner: the optimizer to wrap.

  Returns:
    An `optax.GradientTransformation` whose state is a `SkipNonFiniteState`.

  Example:
    >>> opt = skip_nonfinite(optax.sgd(0.1))
    >>> params = jnp.ones(2)
    >>> state = opt.init(params)
    >>> updates, state = opt.update(jnp.array([jnp.nan, 1.0]), state, params)
    >>> updates.tolist(), int(state.skipped)
    ([0.0, 0.0], 1)
  """

  def init(params: Any) -> SkipNonFiniteState:
    return SkipNonFiniteState(inner.init(params), jnp.int32(0), jnp.int32(0), jnp.bool_(True))

  def update(updates: Any, state: SkipNonFiniteState, params: Any = None,
             **extra: Any) -> tuple[Any, SkipNonFiniteState]:
    finite = all_finite(updates)
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, new_updates)
    skipped = (~finite).astype(jnp.int32)
    return select_tree(finite, new_updates, zeros), SkipNonFiniteState(
        inner_state=select_tree(finite, new_inner, state.inner_state),
        skipped=state.skipped + skipped,
        consecutive_skipped=jnp.where(finite, 0, state.consecutive_skipped + 1).astype(jnp.int32),
        last_finite=finite)

  return optax.GradientTransformationExtraArgs(init, update)
