"""`Trainer`: a training loop with every tuner behind one flag.

The loop every researcher writes (compile the step, move the data, log,
checkpoint, resume), built on the library's parts: `tunedjax.jit` compiles
the step with the passes the config enables, a `Loader` tunes its workers
before the first step, loss scaling follows the precision policy, orbax keeps
the checkpoints, tqdm shows the progress.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tunedjax.ops.attention import _flax as _attention_flax
from tunedjax import _host_memory
from tunedjax import _tuning
from tunedjax import mixed_precision as mp
from tunedjax._config import Config, ConfigLike, config_context, get_config
from tunedjax._errors import format_choices
from tunedjax._policy import canonical_dtype
from tunedjax.trainer import _learning_rate
from tunedjax.trainer import _relayout
from tunedjax.trainer import _step
from tunedjax.trainer._callbacks import Callback, CallbackList
from tunedjax.trainer._checkpoint import Checkpointer
from tunedjax.trainer._data import (BatchChecker, BatchStream, Placement, is_arrays,
                                    predict_batches)
from tunedjax.trainer._history import History
from tunedjax.trainer._model import TrainerError, adapt, split_loss_output, takes_keyword
from tunedjax.trainer._programs import StepPrograms
from tunedjax.trainer._progress import Progress
from tunedjax.trainer._report import jit_summary, loader_summary
from tunedjax.trainer._saving import TrainerCheckpoints
from tunedjax._errors import is_int as _is_int
from tunedjax._errors import show_value as _show

logger = logging.getLogger("tunedjax.trainer")

_TUNERS_OFF = {"kernel": {"enable": False}, "layout": {"enable": False},
               "dataloader": {"enable": False}}


def _resolve_config(autotune_option: Any, policy: mp.Policy | None) -> Config:
  """The config this trainer runs under: the active one, with its options."""
  with contextlib.ExitStack() as stack:
    if autotune_option is True:
      stack.enter_context(config_context(None))
    elif autotune_option is False:
      stack.enter_context(config_context(_TUNERS_OFF))
    elif isinstance(autotune_option, (Mapping, Config, str)):
      stack.enter_context(config_context(autotune_option))
    else:
      raise TrainerError(f"autotune must be True, False, a config dict, a Config or a JSON "
                         f"path, got {autotune_option!r}.")
    if policy is not None:
      half = policy.compute_dtype != jnp.float32
      stack.enter_context(config_context(
          {"mixed_precision": {"enable": bool(half), "policy": str(policy)}}))
    return get_config()





def _check_positive(name: str, value: Any, *, optional: bool = False) -> Any:
  if optional and value is None:
    return value
  if _is_int(value) and value >= 1:
    return int(value)
  raise TrainerError(f"{name} must be an int >= 1{' or None' if optional else ''}, "
                     f"got {_show(value)}.")


def _check_bool(name: str, value: Any) -> bool:
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise TrainerError(f"{name} must be True or False, got {_show(value)}.")


_PROGRESS_MODES = ("auto", "bar", "log", "off")


def _check_metrics(metrics: Any) -> dict[str, Callable[..., Any]]:
  """`metrics` as a dict of names to functions, or a TrainerError saying what is wrong."""
  if metrics is not None and not isinstance(metrics, Mapping):
    raise TrainerError(f"metrics must be None or a dict {{name: fn(model, batch) -> "
                       f"scalar}}, got {_show(metrics)}.")
  metrics = dict(metrics or {})
  names = [k for k in metrics if not isinstance(k, str)]
  if names:
    raise TrainerError(f"metrics must map names (str) to functions fn(model, batch); "
                       f"these keys are not str: {names}.")
  bad = [k for k, f in metrics.items() if not callable(f)]
  if bad:
    raise TrainerError(f"metrics must map names to functions fn(model, batch); these are "
                       f"not callable: {bad}.")
  return metrics


def _check_progress(progress: Any) -> str:
  """The `Progress` mode of the Trainer's `progress` option."""
  if isinstance(progress, (bool, np.bool_)):
    return "auto" if progress else "off"
  if isinstance(progress, str) and progress in _PROGRESS_MODES:
    return str(progress)
  raise TrainerError(f"progress must be True, False, {format_choices(_PROGRESS_MODES)}, "
                     f"got {_show(progress)}.")


class Trainer:
  """Trains a Flax model with an optax optimizer, tuned behind one flag.

  ``autotune=True`` runs this trainer under ``set_config(None)``: kernel
  selection and layout in the compiled step (`tunedjax.jit`), a measured
  worker count for a `tunedjax.input_pipeline.Loader` (measured before the
  first step against the tuned step: kernels are tuned first); the model's Flax
  attention modules compute with `tunedjax.attention`, tuned per shape bucket
  (`tunedjax.use_tuned_attention`; `attention` holds the swap, and
  ``history.tuning["attention"]`` its buckets and fallbacks). ``precision`` adds the
  mixed-precision pass and the loss scaling its policy needs (dynamic for
  float16: a step whose gradients overflow is skipped and counted). Batches
  are sharded over the devices of `mesh` (all local devices by default,
  data-parallel); parameters are replicated. With the layout pass on, the
  convolution kernels it would transpose at every step (an NCHW model's OIHW
  kernels on CPU) are kept in `state` in the layout they run in, with their
  optimizer state, from the first step on (``history.tuning["layout_weights"]``);
  `model`, `variables`, `predict`, `evaluate` and checkpoints see the
  model's own layout.

  Args:
    model: a Flax ``nnx.Module``, or a ``linen.Module`` with `example_batch`.
    optimizer: an optax `GradientTransformation`.
    loss_fn: ``loss_fn(model, batch)`` returning a scalar loss or ``(loss,
      {name: scalar})``; it may take a ``train`` keyword (True while training).
      It is called on the model rebuilt from the trainer's state, inside the
      compiled step: nnx models in ``train()`` mode (``eval()`` to evaluate),
      linen modules bound to their variables.
    metrics: ``{name: fn(model, batch) -> scalar}`` computed by `evaluate`
      (and on `eval_data` during `fit`). Training metrics come from the
      dict `loss_fn` returns.
    precision: a `mixed_precision.Policy`, a policy string or a name
      (``"mixed_bfloat16"``, ``"mixed_float16"``, ``"float32"``); None keeps
      the config's.
    autotune: True (every tuner on: ``set_config(None)`` for this trainer),
      False (every tuner off), or a config dict / `Config` / JSON path.
    checkpoint_dir: where orbax keeps checkpoints; None for none.
    checkpoint_every: save every this many steps (and at the end of `fit`);
      None saves at the end only.
    max_checkpoints: how many checkpoints to keep.
    mesh: a `jax.sharding.Mesh`; None for all devices on one ``"data"`` axis.
    data_axis: the mesh axis the batch is split over (default ``"data"`` if
      the mesh has one, else its first axis).
    steps_per_execution: run this many steps in one compiled `lax.scan` over
      a stacked batch (whole-loop sinking, as MindSpore's O2): one dispatch
      per k steps, for models whose steps are short.
    seed: seed of a linen model's initialisation and of its per-step RNG
      streams, and of the shuffle when `fit` is given arrays (0 to 2**32 - 1).
    progress: True for a tqdm bar in terminals and notebooks and plain log
      lines elsewhere; False for nothing; or a `Progress` mode ("bar", "log").
    example_batch: a batch to initialise a linen module with.
    rng_streams: the RNG streams a linen module uses while training.
    allreduce_dtype: all-reduce the data-parallel gradients in this dtype
      ("bfloat16", "float16", or "compute" for the policy's compute dtype),
      halving the bytes on the wire: each device differentiates its shard of
      the batch in a `jax.shard_map` (BatchNorm normalises over each device's
      shard, as PyTorch DDP without SyncBatchNorm; its running statistics are
      averaged over devices). None (default): XLA partitions the whole step and
      reduces gradients in their own dtype. The tunedjax passes (layout,
      kernels, autocast) do not reach into the `shard_map` body.
    schedule: for the logs only (it changes nothing in training): the
      learning-rate schedule given to the optax optimizer (a function of the
      update count, or a number), so that each step's learning rate appears in
      the callbacks' logs and `History.learning_rates`. Not needed for an
      `optax.inject_hyperparams` optimizer, whose state holds the value; see
      docs/callbacks.md for the rule and its limits.

  Example:
    >>> import numpy as np, optax
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> loss_fn = lambda model, b: ((model(b["x"])[:, 0] - b["y"]) ** 2).mean()
    >>> trainer = tj.Trainer(model, optax.sgd(0.1), loss_fn, autotune=False,
    ...                      progress=False)
    >>> history = trainer.fit(data, batch_size=16, epochs=5)
    >>> len(history.losses), history.losses[-1] < history.losses[0]
    (20, True)
  """

  def __init__(self, model: Any, optimizer: optax.GradientTransformation,
               loss_fn: Callable[..., Any], *,
               metrics: Mapping[str, Callable[..., Any]] | None = None,
               precision: Any = None, autotune: bool | ConfigLike = True,
               checkpoint_dir: Any = None, checkpoint_every: int | None = None,
               max_checkpoints: int = 3, mesh: jax.sharding.Mesh | None = None,
               data_axis: str | None = None, steps_per_execution: int = 1, seed: int = 0,
               progress: bool | str = True, example_batch: Any = None,
               rng_streams: Sequence[str] = ("dropout",), allreduce_dtype: Any = None,
               schedule: Any = None):
    # Before JAX's backend starts (auto mode, CPU only): malloc set up for training steps.
    _host_memory.apply_for_training("a tunedjax Trainer was created")
    if not isinstance(optimizer, optax.GradientTransformation):
      raise TrainerError(f"optimizer must be an optax GradientTransformation (e.g. "
                         f"optax.adam(1e-3)), got {optimizer!r}.")
    self.metrics = _check_metrics(metrics)
    self.steps_per_execution = _check_positive("steps_per_execution", steps_per_execution)
    self.checkpoint_every = _check_positive("checkpoint_every", checkpoint_every, optional=True)
    # The seed also shuffles arrays given to `fit` (a Loader's seed: 32 bits).
    if not _is_int(seed) or not 0 <= seed < 2**32:
      raise TrainerError(f"seed must be an int from 0 to 2**32 - 1, got {_show(seed)}.")
    self.seed = int(seed)
    self._progress_mode = _check_progress(progress)
    self.policy = None if precision is None else mp.get_policy(precision)
    self.config = _resolve_config(autotune, self.policy)
    with config_context(self.config):
      self.loss_scale = (mp.loss_scale_for() if self.config.mixed_precision.enable
                         else mp.NoOpLossScale())
    self._skips = not isinstance(self.loss_scale, mp.NoOpLossScale)

    # Flax attention modules on tunedjax.attention while kernel selection is on.
    self.attention = _attention_flax.trainer_swap(model, self.config)
    self._attention_seen: tuple[Any, dict[str, Any]] | None = None
    self.adapter = adapt(model, self._with_metrics(loss_fn), example_batch=example_batch,
                         rng_streams=rng_streams)
    self.model = model
    self.placement = Placement(mesh, data_axis)
    opt = optimizer
    param_dtype = None if self.policy is None else self.policy.param_dtype
    if param_dtype is not None and param_dtype != jnp.float32:
      opt = mp.master_weights(opt)  # half parameters: keep a float32 copy
    if self._skips:
      opt = mp.skip_nonfinite(opt)
    self.optimizer = opt
    state = _step.init_state(self.adapter, opt, self.loss_scale, self.seed)
    if param_dtype is not None:
      state = state.replace(params=jax.tree_util.tree_map(
          lambda p: p.astype(param_dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
          state.params))
      state = state.replace(opt_state=opt.init(state.params))
    self.state: _step.TrainState = self.placement.replicate(state)

    allreduce = self._allreduce(allreduce_dtype)
    rate = _learning_rate.reader(state.opt_state, schedule)  # None: not known
    # This trainer's kernel-tuning phase, step counter and statistics.
    self.session = _tuning.TuningSession(f"Trainer-{id(self):x}")
    self._programs = StepPrograms.build(self.adapter, opt, self.session,
                                        self.steps_per_execution, skip_nonfinite=self._skips,
                                        allreduce=allreduce, learning_rate=rate)
    self.checkpointer = (Checkpointer(checkpoint_dir, max_to_keep=max_checkpoints)
                         if checkpoint_dir is not None else None)
    self._checkpoints = TrainerCheckpoints(self._programs, {
        "steps_per_execution": self.steps_per_execution, "seed": self.seed,
        "kind": self.adapter.kind})
    self.history = History()
    self.stop_training = False
    self._stream: BatchStream | None = None  # the data of the `fit` in progress

  # --- the pieces -------------------------------------------------------------

  def _logical_params(self) -> Any:
    """`state.params` in the model's own layout (`state` may hold re-laid kernels)."""
    return self._programs.logical(self.state.params)

  def _lay_out_weights(self, batch: Any) -> None:
    """Once, before the first step: keep kernels in the layout their convolutions
    run in (`StepPrograms.plan_layout`, `_relayout`)."""
    with self._running():
      weights = self._programs.plan_layout(self.state, batch, self.config)
    if weights is None:
      return
    self.state = self._programs.use_layout(weights, self.state)
    self.history.tuning[_relayout.KEY] = weights.summary()

  def _allreduce(self, dtype: Any) -> _step.AllReduce | None:
    if dtype is None:
      return None
    if isinstance(dtype, str) and dtype == "compute":
      if self.policy is None:
        raise TrainerError("allreduce_dtype='compute' needs precision= (a policy with a "
                           "compute dtype).")
      dtype = self.policy.compute_dtype
    try:
      dtype = canonical_dtype(dtype, what="allreduce_dtype")
    except mp.PolicyError:
      raise TrainerError(f"allreduce_dtype must be None, 'compute' or a floating dtype "
                         f"('bfloat16', 'float16', 'float32'), got {_show(dtype)}.") from None
    return _step.AllReduce(self.placement.mesh, self.placement.axis, dtype)

  def _with_metrics(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`loss_fn` plus the `metrics` functions when evaluating."""
    wants_train, extra = takes_keyword(loss_fn, "train"), self.metrics

    def combined(model: Any, batch: Any, train: bool = True) -> Any:
      out = loss_fn(model, batch, train=train) if wants_train else loss_fn(model, batch)
      if train or not extra:
        return out
      loss, metrics = split_loss_output(out, "loss_fn")
      return loss, {**metrics, **{k: f(model, batch) for k, f in extra.items()}}

    return combined

  @property
  def step(self) -> int:
    """Steps taken so far (restored ones included)."""
    return int(jax.device_get(self.state.step))

  @property
  def variables(self) -> dict[str, Any]:
    """The model's state: ``{"params": ..., <collections>}`` (linen) or nnx
    ``{"params": Param state, "rest": other state}``."""
    params = self._logical_params()
    if self.adapter.kind == "linen":
      return {"params": params, **self.state.rest}
    return {"params": params, "rest": self.state.rest}

  def _sync_model(self) -> None:
    self.adapter.write_back(self._logical_params(), self.state.rest)

  @contextlib.contextmanager
  def _running(self) -> Iterator[None]:
    with config_context(self.config), self.attention or contextlib.nullcontext():
      yield

  # --- fit ------------------------------------------------------------------------

  def fit(self, train_data: Any, *, epochs: int | None = None, steps: int | None = None,
          batch_size: int | None = None, eval_data: Any = None,
          eval_every: int | None = None, callbacks: Sequence[Callback] = (),
          resume: bool = False) -> History:
    """Trains until `steps` steps or `epochs` epochs have been run in all.

    Both count from the start of training, restored steps included, so a job
    restarted with the same arguments and ``resume=True`` ends where an
    uninterrupted one would. Without either, one epoch more.

    Args:
      train_data: a `tunedjax.input_pipeline.Loader` (its workers are tuned
        with this step as the consumer before the first step, when the config
        or the loader asks for it), arrays (an array, or a dict/tuple of
        arrays with one row per record; with `batch_size`), or any iterable
        of batches (re-iterated each epoch).
      epochs: train until this many epochs are done.
      steps: train until this many steps are done.
      batch_size: records per batch, for arrays.
      eval_data: data for `evaluate` at each epoch's end, or every
        `eval_every` steps.
      eval_every: evaluate every this many steps instead.
      callbacks: `Callback` objects (logging, early stopping and best
        checkpoints are ready-made in `tunedjax.callbacks`).
      resume: first restore the latest checkpoint of `checkpoint_dir`, if
        there is one: state, data position, history and step.

    Returns:
      The `History` of every step so far (this trainer's `history`).
    """
    self.stop_training = False
    resume = _check_bool("resume", resume)
    epochs = _check_positive("epochs", epochs, optional=True)
    steps = _check_positive("steps", steps, optional=True)
    eval_every = _check_positive("eval_every", eval_every, optional=True)
    callbacks = CallbackList(callbacks)
    stream = BatchStream(train_data, batch_size=batch_size, seed=self.seed)
    try:
      if resume:
        self._resume(stream)
      self._stream = stream
      return self._fit(stream, epochs, steps, eval_data, eval_every, batch_size, callbacks)
    finally:
      self._stream = None
      stream.close()

  def _fit(self, stream: BatchStream, epochs: int | None, steps: int | None, eval_data: Any,
           eval_every: int | None, batch_size: int | None, callbacks: CallbackList) -> History:
    start = self.step
    per_epoch = stream.steps_per_epoch
    if epochs is None and steps is None:
      epochs = stream.epoch + 1
    target = steps
    if epochs is not None and per_epoch is not None:
      by_epochs = epochs * per_epoch
      target = by_epochs if target is None else min(target, by_epochs)
    if target is not None and target <= start:
      logger.info("Trainer.fit: already at step %d (target %d): nothing to do.", start, target)
      return self.history
    self.history.tuning.setdefault("precision", str(self.policy) if self.policy else
                                   (self.config.mixed_precision.policy
                                    if self.config.mixed_precision.enable else "float32"))
    total = None if target is None else target - start
    self.session.horizon = total  # kernel tuning must pay back within this fit's steps
    checker = BatchChecker("train_data")
    with self._running(), Progress(total=total, mode=self._progress_mode, desc="train") as bar:
      callbacks.on_fit_start(self)
      self._tune_loader(stream, bar, total)
      loop = _Loop(self, stream, checker, bar, callbacks, target=target, epochs=epochs,
                   eval_data=eval_data, eval_every=eval_every, batch_size=batch_size)
      loop.run()
      self.history.tuning.update(jit_summary(self._programs.train_step))
      if self._programs.multi_step is not None:
        self.history.tuning["verification"] = self._programs.multi_step.verification()
      if self.attention is not None:
        self.history.tuning["attention"] = self._attention_summary()
      if self.checkpointer is not None:
        self.save(stream, force=True)
        self.checkpointer.wait()  # on disk when fit returns; periodic saves overlap steps
      self._sync_model()
      callbacks.on_fit_end(self, self.history)
    return self.history

  def _attention_summary(self) -> dict[str, Any]:
    """``history.tuning["attention"]``, worked out again only after a new trace.

    Its buckets come from `autotune.explain`, which traces the attention calls
    (tens of ms for a small Transformer): at the end of every `fit` that would
    be a fixed cost of each fit. The buckets and their kernels change only
    when the steps are traced again (their kernels are decided then).
    """
    key = self._programs.traces()
    if self._attention_seen is None or self._attention_seen[0] != key:
      self._attention_seen = (key, self.attention.summary(session=self.session))
    return copy.deepcopy(self._attention_seen[1])

  def _tune_loader(self, stream: BatchStream, bar: Progress, total: int | None) -> None:
    """Tunes a Loader's workers with the training step as the consumer."""
    loader = stream.loader
    if loader is None or not loader.needs_tuning:
      return
    scratch: list[Any] = []

    def consumer(batch: Any) -> None:
      if not self._programs.weights_planned:
        self._lay_out_weights(self.placement.put(batch))
      if not scratch:  # a copy: tuning never changes the real state
        scratch.append(_copied(self.state))
      scratch[0], out = self._programs.train_step(scratch[0], self.placement.put(batch))
      jax.block_until_ready(out)

    bar.message("Trainer: tuning the loader's worker count with the training step ...")
    # The loader is measured against the step it will feed: with kernel
    # selection on, the consumer's untimed first call tunes the kernels, so
    # the observe phase ends now (xla kernels would be a slower step to
    # measure against), and the steps before the tuning window run the tuned
    # program instead of compiling an all-xla one used once.
    self.session.step(index=self.step)
    if self.config.kernel.enable:
      self.session.end_observe()
    # Measured against the tuned step: the whole-program check waits for real steps.
    with self._programs.train_step.checks_paused():
      result = loader.tune(consumer=consumer, expected_batches=total)  # this fit's steps
    if result is not None:
      self.history.tuning["dataloader"] = loader_summary(result)
      bar.message(f"Trainer: loader uses {result.worker_count} workers, "
                  f"{result.read_threads} read threads "
                  f"({'cached' if result.from_cache else f'tuned in {result.seconds:.1f} s'})")

  # --- evaluate / predict -----------------------------------------------------------

  def evaluate(self, data: Any, *, batch_size: int | None = None) -> dict[str, float]:
    """The mean loss and metrics over one pass of `data` (weighted by batch size).

    Args:
      data: a Loader (one epoch of it is read), arrays with `batch_size`
        (every record, the last batch short if need be), or an iterable of
        batches.
      batch_size: records per batch, for arrays (default: all at once).

    Returns:
      ``{"loss": ..., <metric>: ...}`` as Python floats.
    """
    if is_arrays(data) and batch_size is None:
      data = [data]
    stream = BatchStream(data, batch_size=batch_size, seed=self.seed, shuffle=False,
                         what="eval data", drop_remainder=False)
    totals: dict[str, float] = {}
    count = 0
    try:
      with self._running():
        checker = BatchChecker("eval data")
        n = stream.steps_per_epoch
        index = 0
        while n is None or index < n:
          try:
            epoch, batch = stream.next()
          except StopIteration:
            break
          if epoch > 0 and index > 0 and stream.loader is None:
            break
          checker.check(batch, index)
          size = _size(batch)
          out = jax.device_get(self._programs.eval_step(self.state,
                                                        self._place_any(batch, size)))
          for k, v in out.items():
            totals[k] = totals.get(k, 0.0) + float(v) * size
          count += size
          index += 1
    finally:
      stream.close()
    if not count:
      raise TrainerError("evaluate: the data yielded no batch.")
    return {k: v / count for k, v in totals.items()}

  def _place_any(self, batch: Any, size: int) -> Any:
    """Sharded when the batch splits evenly over the devices, else replicated."""
    if size % self.placement.shards == 0:
      return self.placement.put(batch)
    return self.placement.replicate(batch)

  def predict(self, x_or_data: Any, *, batch_size: int | None = None,
              fn: Callable[..., Any] | None = None) -> Any:
    """The model's outputs in evaluation mode, compiled once per input shape.

    Args:
      x_or_data: inputs (an array or a pytree of arrays, one row per record)
        or an iterable of batches; outputs are concatenated along axis 0.
      batch_size: split array inputs into batches of this many records.
      fn: ``fn(model, batch)`` computing the output (default ``model(batch)``).

    Returns:
      The outputs, as NumPy arrays.
    """
    batch_size = _check_positive("predict(batch_size=...)", batch_size, optional=True)
    if fn is not None and not callable(fn):
      raise TrainerError(f"predict(fn=...) must be None or a function fn(model, batch), "
                         f"got {_show(fn)}.")
    batches = predict_batches(x_or_data, batch_size)  # checks x_or_data
    predict = self._programs.predictor(fn)
    outs = []
    with self._running():
      for batch in batches:
        size = _size(batch)
        outs.append(jax.device_get(predict(self.state, self._place_any(batch, size))))
    if not outs:
      raise TrainerError("predict: no inputs.")
    return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs, axis=0), *outs)

  # --- checkpoints ---------------------------------------------------------------

  def save(self, stream: BatchStream | None = None, *, force: bool = False) -> bool:
    """Saves a checkpoint of the state, the data position and the history now."""
    if self.checkpointer is None:
      raise TrainerError("This Trainer has no checkpoint_dir: pass checkpoint_dir= to "
                         "Trainer(...) to save checkpoints.")
    return self._save_to(self.checkpointer, stream, force=force)

  def _save_to(self, checkpointer: Checkpointer, stream: BatchStream | None = None, *,
               force: bool = False, metrics: Mapping[str, float] | None = None) -> bool:
    """Saves what `save` saves into `checkpointer`, with orbax `metrics` for its
    best-checkpoint policy (`Checkpointer(best_metric=...)`)."""
    if stream is None:
      stream = self._stream  # during `fit`: its data position
    return self._checkpoints.save(checkpointer, self.step, self.state, self.history, stream,
                                  force=force, metrics=metrics)

  def _weights_copy(self) -> tuple[Any, Any]:
    """A copy of the model's weights as stored (params, other state), on their devices.

    The steps donate the state's buffers, so a copy, not a reference, keeps them.
    """
    return _copied((self.state.params, self.state.rest))

  def _set_weights(self, weights: tuple[Any, Any]) -> None:
    """Puts back weights that `_weights_copy` took (the optimizer state stays)."""
    params, rest = _copied(weights)
    self.state = self.state.replace(params=params, rest=rest)
    self._sync_model()

  def restore(self, checkpoint_dir: Any = None, *, step: int | None = None) -> dict[str, Any]:
    """Restores the state and history of a checkpoint (the latest by default).

    Args:
      checkpoint_dir: the folder (default: this trainer's `checkpoint_dir`).
      step: the checkpoint's step (default: the latest).

    Returns:
      The checkpoint's metadata (the data position under ``"data"``).
    """
    checkpointer = (Checkpointer(checkpoint_dir) if checkpoint_dir is not None
                    else self.checkpointer)
    if checkpointer is None:
      raise TrainerError("Trainer.restore needs a checkpoint_dir: this Trainer has none.")
    self.state, self.history, metadata = self._checkpoints.restore(
        checkpointer, self.state, step, wait=checkpointer is self.checkpointer)
    self._sync_model()
    logger.info("Trainer: restored step %d from %s", self.step, checkpointer.directory)
    return metadata

  def _resume(self, stream: BatchStream) -> None:
    if self.checkpointer is None:
      raise TrainerError("fit(resume=True) needs a checkpoint_dir: pass checkpoint_dir= "
                         "to Trainer(...).")
    if self.checkpointer.latest_step() is None:
      logger.info("Trainer: no checkpoint in %s yet; starting from scratch.",
                  self.checkpointer.directory)
      return
    metadata = self.restore()
    if metadata.get("data") is not None:
      stream.set_state(metadata["data"])


class _Loop:
  """One `fit` call's loop: dispatch, read the losses back one step late, record.

  Reading step s's loss only after step s+1 was dispatched keeps the devices
  busy while the host records, logs and fetches the next batch. Epoch ends,
  evaluations and checkpoints wait for the steps before them.
  """

  def __init__(self, trainer: Trainer, stream: BatchStream, checker: BatchChecker,
               bar: Progress, callbacks: CallbackList, *, target: int | None,
               epochs: int | None, eval_data: Any, eval_every: int | None,
               batch_size: int | None):
    self.t, self.stream, self.checker, self.bar = trainer, stream, checker, bar
    self.callbacks, self.target, self.epochs = callbacks, target, epochs
    self.eval_data, self.eval_every, self.batch_size = eval_data, eval_every, batch_size
    self.pending: tuple[list[tuple[int, int]], list[jax.Array]] | None = None
    self.last_ready = time.perf_counter()
    self.epoch_started = self.last_ready
    self.current_epoch: int | None = None
    self.past_last_epoch = False
    self.index = 0

  def _take(self, n: int) -> list[tuple[int, Any]]:
    group = []
    for _ in range(n):
      if self.epochs is not None and self.stream.epoch >= self.epochs:
        break
      try:
        epoch, batch = self.stream.next()
      except StopIteration:
        break
      if self.epochs is not None and epoch >= self.epochs:  # found only by reading
        self.past_last_epoch = True
        break
      self.checker.check(batch, self.index)
      if self.index == 0:
        self.t.placement.check_batch_size(_size(batch), "train_data")
      self.index += 1
      group.append((epoch, batch))
    return group

  def run(self) -> None:
    t, k = self.t, self.t.steps_per_execution
    step = t.step
    while not t.stop_training and (self.target is None or step < self.target):
      group = self._take(k if self.target is None else min(k, self.target - step))
      if not group:
        break
      for epoch, run in itertools.groupby(group, key=lambda eb: eb[0]):
        if self.current_epoch is not None and epoch != self.current_epoch:
          self._end_epoch()
          if t.stop_training:  # stopped at the epoch's end: the batches read on are not run
            break
        self.current_epoch = epoch
        step = self._dispatch([b for _, b in run], step)
      if self.current_epoch is not None and self.stream.epoch > self.current_epoch:
        self._end_epoch()  # known to be complete: ended before reading the next batch
    self._read_pending()
    if self.current_epoch is not None and self.past_last_epoch:
      self._end_epoch()

  def _dispatch(self, batches: list[Any], step: int) -> int:
    """Runs `batches` from global step `step`; returns the next step."""
    t, k = self.t, self.t.steps_per_execution
    if not t._programs.weights_planned:
      t._lay_out_weights(t.placement.put(batches[0]))
    for s in range(step, step + len(batches)):
      t.session.step(index=s)
    sizes = [_size(b) for b in batches]
    if len(batches) == k > 1 and len(set(sizes)) == 1:
      stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *batches)
      t.state, out = t._programs.multi_step(t.state, t.placement.put(stacked, stacked=True))
      outs = [out]  # [k, outputs]
    else:
      outs = []
      for batch in batches:
        t.state, out = t._programs.train_step(t.state, t.placement.put(batch))
        outs.append(out)  # [outputs]
    self._read_pending()
    self.pending = ([(step + i, n) for i, n in enumerate(sizes)], outs)
    done = range(step + 1, step + len(batches) + 1)
    if t.checkpointer is not None and t.checkpoint_every and any(
        s % t.checkpoint_every == 0 for s in done):
      self._read_pending()
      t.save(self.stream)
    if self.eval_every and self.eval_data is not None and any(
        s % self.eval_every == 0 for s in done):
      self._read_pending()
      self._evaluate(step + len(batches))
    return step + len(batches)

  def _read_pending(self) -> None:
    if self.pending is None:
      return
    info, outs = self.pending
    self.pending = None
    values = [np.asarray(o) for o in outs]  # one array per dispatch
    now = time.perf_counter()
    share = (now - self.last_ready) / len(info)
    self.last_ready = now
    t = self.t
    rows = [row for v in values for row in (v if v.ndim == 2 else [v])]
    names = t._programs.out_names
    for (step, size), row in zip(info, rows):
      value = dict(zip(names, row.tolist()))
      loss, finite = value.pop("loss"), bool(value.pop("finite"))
      rate = value.pop("learning_rate", None)
      metrics = value
      if not finite and not t._skips:
        raise TrainerError(
            f"The loss or its gradients are not finite at step {step} (loss {loss}) and "
            "loss scaling is off, so the update went into the parameters. Lower the "
            "learning rate, check the data, or train with precision='mixed_float16' "
            "(dynamic loss scaling skips such steps).")
      t.history.record_step(step, loss, share, samples=size, metrics=metrics,
                            skipped=not finite, learning_rate=rate)
      logs = {"loss": loss, **metrics, "skipped": not finite}
      if rate is not None:
        logs["learning_rate"] = rate
      self.callbacks.on_step_end(t, step, logs)
    # Figures that cost host time are functions: computed only when shown.
    self.bar.update(info[-1][0] + 1, loss=t.history.losses[-1],
                    samples_per_s=lambda: t.history.throughput(last=50),
                    phase=(lambda: t.session.phase(t.config)) if t.config.kernel.enable
                    else None, n=len(info))

  def _evaluate(self, step: int) -> dict[str, float]:
    results = self.t.evaluate(self.eval_data, batch_size=self.batch_size)
    self.t.history.record_eval(step, results)
    self.bar.message(f"eval at step {step}: " + ", ".join(f"{k} {v:.4g}"
                                                          for k, v in results.items()))
    return results

  def _end_epoch(self) -> None:
    """Ends `current_epoch` (after reading its pending steps)."""
    self._read_pending()
    epoch, self.current_epoch = self.current_epoch, None
    extra = {}
    if self.eval_data is not None and not self.eval_every:
      extra = {f"eval_{k}": v for k, v in self._evaluate(self.t.step).items()}
    now = time.perf_counter()
    summary = self.t.history.end_epoch(epoch, now - self.epoch_started, extra=extra)
    self.epoch_started = now
    self.callbacks.on_epoch_end(self.t, epoch, summary)
    self.bar.message(f"epoch {epoch}: " + ", ".join(
        f"{k} {v:.4g}" for k, v in summary.items() if k != "epoch"))


def _copied(tree: Any) -> Any:
  """A copy of `tree`'s arrays in new buffers, on their devices and shardings.

  ``jax.device_put(..., may_alias=False)`` copies without compiling
  (``jnp.copy`` compiles a program per leaf shape: about 30 small compiles
  for a ResNet-style model's state, before its first step). Each leaf's
  sharding is given: without it a PRNG key array would come back on one
  device, uncommitted, and the step would be traced again for it. A tree
  with an array spread over other processes' devices (a multi-host mesh),
  which ``device_put`` cannot place from one process, is copied by
  ``jnp.copy``.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not all(x.is_fully_addressable for x in leaves):
    return jax.tree_util.tree_map(jnp.copy, tree)
  shardings = jax.tree_util.tree_map(lambda x: x.sharding, tree)
  return jax.device_put(tree, shardings, may_alias=False)


def _size(batch: Any) -> int:
  """Records in a batch: the leading dimension of its first leaf."""
  return int(jax.tree_util.tree_leaves(batch)[0].shape[0])
