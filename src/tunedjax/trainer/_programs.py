"""A `Trainer`'s step programs: the train step built once, compiled as the
one-step, k-steps and evaluation programs (`tunedjax.jit`) and the predict
programs, for the state as stored (convolution kernels possibly kept in the
layout they run in: `_relayout`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import optax

from tunedjax import _tuning
from tunedjax._config import Config
from tunedjax._jit import Jitted
from tunedjax._jit import jit as tj_jit
from tunedjax.ops.batch_norm._flax import route_batch_norm
from tunedjax.trainer import _relayout
from tunedjax.trainer import _step


class StepPrograms:
  """The compiled programs of one `Trainer`, and the layout its state is stored in.

  Attributes:
    train_step: the one-step program ``(state, batch) -> (state, outputs)``.
    multi_step: the k-steps program (`steps_per_execution` k > 1), else None.
    eval_step: the evaluation program ``(state, batch) -> {name: value}``.
    out_names: what each step's output vector holds (filled when traced).
    weights: the `_relayout.WeightLayout` the state is stored in, or None.
    weights_planned: whether the layout was planned (before the first step).
  """

  def __init__(self, adapter: Any, step_fn: Callable[..., Any], out_names: list[str],
               session: _tuning.TuningSession, steps_per_execution: int, *,
               weights_planned: bool):
    self.adapter, self.session, self.out_names = adapter, session, out_names
    self.steps_per_execution = steps_per_execution
    self._step_fn = step_fn
    # Convolution kernels stored in the layout they run in (planned before the
    # first step; the passes do not reach into an all-reduce's shard_map body).
    self.weights: _relayout.WeightLayout | None = None
    self.weights_planned = weights_planned
    self.compile()

  @classmethod
  def build(cls, adapter: Any, optimizer: optax.GradientTransformation,
            session: _tuning.TuningSession, steps_per_execution: int, *,
            skip_nonfinite: bool, allreduce: _step.AllReduce | None,
            learning_rate: Any) -> StepPrograms:
    """The train step of `adapter`'s model under `optimizer`, and its programs."""
    out_names: list[str] = []  # what each step's output vector holds
    step = _step.packed(_step.make_train_step(adapter, optimizer, skip_nonfinite=skip_nonfinite,
                                              allreduce=allreduce, learning_rate=learning_rate),
                        out_names)
    step = route_batch_norm()(step)  # Flax BatchNorm -> the batch_norm family, when tuning
    return cls(adapter, step, out_names, session, steps_per_execution,
               weights_planned=allreduce is not None)

  def compile(self) -> None:
    """The compiled steps, for the state as `weights` stores it."""
    step = self.stored(self._step_fn, step=True)
    k = self.steps_per_execution
    # The whole-program check runs on the program that runs the fit's steps:
    # with k > 1 the k-steps one (one call: k steps of the horizon); the
    # one-step program then only runs leftovers.
    self.train_step = tj_jit(step, donate_argnums=0, session=self.session, verify=k == 1)
    self.multi_step = (tj_jit(_step.make_multi_step(step), donate_argnums=0,
                              session=self.session) if k > 1 else None)
    if self.multi_step is not None:
      self.multi_step.runs_per_call = k
    # Evaluation runs too rarely to compare programs on (the whole-program check).
    self.eval_step = tj_jit(self.stored(_step.make_eval_step(self.adapter)),
                            session=self.session, verify=False)
    self.predictors: dict[Any, Jitted] = {}

  def predictor(self, fn: Callable[..., Any] | None) -> Jitted:
    """The predict program of ``fn(model, batch)`` (None: ``model(batch)``), made once."""
    if fn not in self.predictors:
      self.predictors[fn] = tj_jit(self.stored(_step.make_predict(self.adapter, fn)),
                                   session=self.session, verify=False)
    return self.predictors[fn]

  def traces(self) -> Hashable:
    """Changes when a step program is traced again (its kernels are decided then)."""
    steps = [j for j in (self.train_step, self.multi_step, self.eval_step) if j is not None]
    return tuple((id(j), j.trace_count) for j in steps)

  def stored(self, fn: Callable[..., Any], *, step: bool = False) -> Callable[..., Any]:
    """`fn(state, x)` taking the state as stored (re-laid kernels undone inside)."""
    if self.weights is None:
      return fn
    return self.weights.wrap_step(fn) if step else self.weights.wrap_reader(fn)

  def logical(self, tree: Any) -> Any:
    """A state (or its params, whose leaves come first) in the model's own layout."""
    return tree if self.weights is None else self.weights.to_logical(tree)

  def plan_layout(self, state: _step.TrainState, batch: Any,
                  config: Config) -> _relayout.WeightLayout | None:
    """Once, before the first step: the layout to keep kernels in (`_relayout.plan`).

    The layout pass would transpose each such kernel (an input of the step)
    on every call; stored re-laid, the step's own transposes cancel out.
    """
    self.weights_planned = True
    adapter = self.adapter

    def forward(params: Any, rest: Any, batch: Any, rng: Any) -> Any:
      return adapter.loss(params, rest, batch, rng, train=True)[0]

    return _relayout.plan(forward, state, batch, config)

  def use_layout(self, weights: _relayout.WeightLayout,
                 state: _step.TrainState) -> _step.TrainState:
    """Stores the state in `weights`' layout from now on; returns it stored."""
    self.weights = weights
    stored = weights.to_stored(state)
    self.compile()
    return stored
