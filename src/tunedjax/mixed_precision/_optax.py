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


class MasterWeightsState(NamedTuple):
  """State of `master_weights`.

  Attributes:
    master: the float32 copy of the parameters the optimizer updates.
    inner_state: the wrapped optimizer's state (over `master`).
  """

  master: Any
  inner_state: Any


def master_weights(inner: optax.GradientTransformation, *,
                   dtype: Any = jnp.float32) -> optax.GradientTransformation:
  """Keeps a float32 master copy of half-precision parameters in the optimizer.

  For `wrap(..., params="compute")`, where the model stores its parameters in
  bfloat16/float16: gradients are cast to `dtype`, the inner optimizer updates
  the master copy, and the returned updates take the model's parameters to
  the new master values rounded to their own dtype. Small updates thus
  accumulate in float32 instead of being lost to bfloat16 rounding.

  Args:
    inner: the optimizer to wrap.
    dtype: the master copy's dtype (default float32).

  Returns:
    An `optax.GradientTransformation` whose state is a `MasterWeightsState`;
    `update` needs `params`.

  Example:
    >>> opt = master_weights(optax.sgd(1e-3))
    >>> params = jnp.ones(2, jnp.bfloat16)
    >>> state = opt.init(params)
    >>> for _ in range(10):  # 1e-3 steps vanish in bfloat16 rounding alone
    ...   updates, state = opt.update(jnp.ones(2, jnp.bfloat16), state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params.dtype, round(float(state.master[0]), 4), float(params[0])
    (dtype(bfloat16), 0.99, 0.98828125)
  """

  def to_master(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def init(params: Any) -> MasterWeightsState:
    master = to_master(params)
    return MasterWeightsState(master, inner.init(master))

  def update(updates: Any, state: MasterWeightsState, params: Any = None,
             **extra: Any) -> tuple[Any, MasterWeightsState]:
    if params is None:
      raise ValueError("master_weights needs `params` in update(grads, state, params).")
    inner_updates, inner_state = inner.update(to_master(updates), state.inner_state,
                                              state.master, **extra)
    master = optax.apply_updates(state.master, inner_updates)
    # float32 deltas: apply_updates adds them in float32, then rounds once.
    deltas = jax.tree_util.tree_map(lambda m, p: m - p.astype(m.dtype), master, params)
    return deltas, MasterWeightsState(master, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)
