"""The Trainer's pure functions: its state, one train step, k steps, evaluation.

Everything here is a pure function of pytrees, as in optax: `TrainState`
holds what changes during training, the step functions return a new one.
The Trainer compiles them with `tunedjax.jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from tunedjax import mixed_precision as mp
from tunedjax.trainer._model import ModelAdapter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """What a training step reads and writes; a pytree.

  Attributes:
    params: the trainable parameters.
    rest: the model's other state (BatchNorm statistics, nnx RNG counters,
      linen's mutable collections).
    opt_state: the optax optimizer's state.
    loss_scale: a `mixed_precision` loss scale (`NoOpLossScale` when off).
    step: how many steps were taken (int32 scalar).
    rng: the Trainer's PRNG key; step ``s`` uses ``fold_in(rng, s)``.
  """

  params: Any
  rest: Any
  opt_state: Any
  loss_scale: Any
  step: jax.Array
  rng: jax.Array

  def replace(self, **changes: Any) -> TrainState:
    return dataclasses.replace(self, **changes)


StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]


def make_train_step(adapter: ModelAdapter, optimizer: optax.GradientTransformation, *,
                    skip_nonfinite: bool, allreduce: AllReduce | None = None,
                    learning_rate: Callable[[Any, Any, jax.Array], jax.Array] | None = None
                    ) -> StepFn:
  """One training step: loss, scaled gradients, optimizer update.

  Args:
    adapter: the model.
    optimizer: the optax optimizer (already wrapped in `mp.skip_nonfinite`
      when `skip_nonfinite`).
    skip_nonfinite: keep the model's other state (BatchNorm statistics) as it
      was on a step whose gradients are not finite, as the optimizer does.
    allreduce: compute each device's gradients on its shard of the batch in a
      `jax.shard_map` and all-reduce them in a narrower dtype
      (`mixed_precision.allreduce_gradients`); the loss, metrics and the
      model's floating state (BatchNorm statistics) are averaged over devices.
      None: XLA partitions the step and reduces gradients in their own dtype.
    learning_rate: ``fn(opt_state before, opt_state after, step)``, the
      learning rate of the update (`_learning_rate.reader`); None: not output.

  Returns:
    ``step(state, batch) -> (new state, {"loss", "finite", <metrics>})``, plus
    ``"learning_rate"`` with `learning_rate`.
  """

  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    rng = jax.random.fold_in(state.rng, state.step)

    def loss_of(params: Any, rest: Any = state.rest, batch: Any = batch, rng: Any = rng
                ) -> tuple[jax.Array, tuple[dict[str, jax.Array], Any]]:
      loss, metrics, rest = adapter.loss(params, rest, batch, rng, train=True)
      return loss, (metrics, rest)

    if allreduce is None:
      (loss, (metrics, rest)), grads, finite = mp.scaled_value_and_grad(
          loss_of, has_aux=True)(state.loss_scale, state.params)
    else:
      loss, metrics, rest, grads, finite = _sharded_grads(allreduce, loss_of, state, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if skip_nonfinite:
      rest = mp.select_tree(finite, rest, state.rest)
    new = state.replace(params=params, rest=rest, opt_state=opt_state,
                        loss_scale=state.loss_scale.adjust(finite), step=state.step + 1)
    out = {"loss": loss, "finite": finite, **metrics}
    if learning_rate is not None:
      out["learning_rate"] = learning_rate(state.opt_state, opt_state, state.step)
    return new, out

  return step


def packed(step: StepFn, names: list[str]) -> Callable[[TrainState, Any],
                                                       tuple[TrainState, jax.Array]]:
  """`step` with its outputs in one float32 vector, in the order of `names`.

  One device-to-host copy per step instead of one per output: the host
  reads every step's loss. `names` is filled when the step is traced.
  """

  def step_packed(state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
    state, out = step(state, batch)
    names[:] = list(out)
    return state, jnp.stack([jnp.asarray(v, jnp.float32) for v in out.values()])

  return step_packed


@dataclasses.dataclass(frozen=True)
class AllReduce:
  """Where and how to all-reduce gradients (see `make_train_step`)."""

  mesh: Mesh
  axis: str
  dtype: Any


def _sharded_grads(spec: AllReduce, loss_of: Callable[..., Any], state: TrainState,
                   batch: Any) -> tuple[Any, ...]:
  """Per-device gradients on a batch shard, all-reduced in `spec.dtype`."""

  def per_device(params, rest, loss_scale, rng, batch):
    rng = jax.random.fold_in(rng, jax.lax.axis_index(spec.axis))  # own dropout masks
    (loss, (metrics, rest)), grads, _ = mp.scaled_value_and_grad(
        loss_of, has_aux=True)(loss_scale, params, rest, batch, rng)
    grads = mp.allreduce_gradients(grads, spec.axis, dtype=spec.dtype)
    mean = lambda x: (jax.lax.pmean(x, spec.axis)  # noqa: E731
                      if jnp.issubdtype(x.dtype, jnp.floating) else x)
    rest = jax.tree_util.tree_map(mean, rest)
    return jax.lax.pmean(loss, spec.axis), jax.tree_util.tree_map(mean, metrics), rest, grads

  replicated, sharded = PartitionSpec(), PartitionSpec(spec.axis)
  mapped = jax.shard_map(per_device, mesh=spec.mesh,
                         in_specs=(replicated, replicated, replicated, replicated, sharded),
                         out_specs=replicated, check_vma=False)
  rng = jax.random.fold_in(state.rng, state.step)
  loss, metrics, rest, grads = mapped(state.params, state.rest, state.loss_scale, rng, batch)
  return loss, metrics, rest, grads, mp.all_finite(grads)


def make_multi_step(step: StepFn) -> StepFn:
  """`step` run over a stacked batch (leading axis k) in one `lax.scan`.

  Returns:
    ``steps(state, stacked) -> (state after k steps, outputs stacked over k)``.
  """

  def steps(state: TrainState, stacked: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    return jax.lax.scan(step, state, stacked)

  return steps


def make_eval_step(adapter: ModelAdapter) -> Callable[[TrainState, Any], dict[str, jax.Array]]:
  """The loss and metrics on one batch, in evaluation mode (no update)."""

  def evaluate(state: TrainState, batch: Any) -> dict[str, jax.Array]:
    loss, metrics, _ = adapter.loss(state.params, state.rest, batch, state.rng, train=False)
    return {"loss": loss, **metrics}

  return evaluate


def make_predict(adapter: ModelAdapter, fn: Callable[..., Any] | None
                 ) -> Callable[[TrainState, Any], Any]:
  """The model's output on inputs, in evaluation mode."""

  def predict(state: TrainState, x: Any) -> Any:
    return adapter.predict(state.params, state.rest, x, fn)

  return predict


def init_state(adapter: ModelAdapter, optimizer: optax.GradientTransformation,
               loss_scale: Any, seed: int) -> TrainState:
  """The state before the first step."""
  key = jax.random.key(seed)
  init_key, step_key = jax.random.split(key)
  params, rest = adapter.init(init_key)
  return TrainState(params=params, rest=rest, opt_state=optimizer.init(params),
                    loss_scale=loss_scale, step=jnp.zeros((), jnp.int32), rng=step_key)
