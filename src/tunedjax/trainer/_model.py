"""Flax nnx and linen models as pure functions of explicit state.

The Trainer compiles pure functions of pytrees; users hand it a Flax model
and a ``loss_fn(model, batch)``. A `ModelAdapter` bridges the two: it splits
the model into trainable parameters and the rest of its state (BatchNorm
statistics, nnx RNG counters, linen's mutable collections) and calls the
user's function on a model rebuilt from that state inside the trace.

Both kinds are called the same way, so one ``loss_fn`` works for either:
``loss_fn(model, batch)`` returns a scalar loss or ``(loss, {name: value})``.
A ``loss_fn`` that takes a ``train`` keyword is told whether it is training
(``train=True``) or evaluating (``train=False``); nnx models are also put in
``eval()`` mode for evaluation and prediction.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from tunedjax._errors import TunedJaxError

LossFn = Callable[..., Any]


class TrainerError(TunedJaxError, ValueError):
  """A model, loss function, batch or option the Trainer cannot use."""


def takes_keyword(fn: Callable[..., Any], name: str) -> bool:
  """Whether `fn` accepts the keyword argument `name`.

  Example:
    >>> takes_keyword(lambda model, batch, train=True: 0, "train")
    True
    >>> takes_keyword(lambda model, batch: 0, "train")
    False
  """
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def split_loss_output(out: Any, where: str) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``loss`` or ``(loss, metrics)`` -> (scalar loss, metrics dict), checked."""
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
    loss, metrics = out
  else:
    loss, metrics = out, {}
  shape = getattr(loss, "shape", None)
  if shape is None or tuple(shape) != () or not jnp.issubdtype(jnp.result_type(loss),
                                                               jnp.floating):
    got = (f"{jnp.result_type(loss)}{list(shape)}" if shape is not None
           else f"{type(loss).__name__}")
    raise TrainerError(
        f"{where} must return a scalar floating loss, or (loss, {{name: scalar}}); "
        f"it returned {got}. Reduce the loss over the batch (e.g. `.mean()`).")
  bad = {k: jnp.shape(v) for k, v in metrics.items() if jnp.shape(v) != ()}
  if bad:
    raise TrainerError(f"{where}'s metrics must be scalars; these are not: {bad}.")
  return jnp.asarray(loss, jnp.float32), {k: jnp.asarray(v, jnp.float32)
                                          for k, v in metrics.items()}


class ModelAdapter:
  """How the Trainer turns a Flax model into state and calls on it.

  Attributes:
    kind: ``"nnx"`` or ``"linen"``.
  """

  kind = ""

  def init(self, rng: jax.Array) -> tuple[Any, Any]:
    """Returns ``(params, rest)``: the trainable parameters and other state."""
    raise NotImplementedError

  def loss(self, params: Any, rest: Any, batch: Any, rng: jax.Array, *, train: bool
           ) -> tuple[jax.Array, dict[str, jax.Array], Any]:
    """``loss_fn`` on the model rebuilt from state: (loss, metrics, new rest)."""
    raise NotImplementedError

  def predict(self, params: Any, rest: Any, x: Any, fn: Callable[..., Any] | None) -> Any:
    """The model's output on `x` in evaluation mode (``fn(model, x)`` if given)."""
    raise NotImplementedError

  def write_back(self, params: Any, rest: Any) -> None:
    """Makes the user's model object hold `params` and `rest` (nnx)."""


class NnxAdapter(ModelAdapter):
  """An `nnx.Module`: split into (graph, Param state, other state)."""

  kind = "nnx"

  def __init__(self, model: nnx.Module, loss_fn: LossFn):
    self.model, self.loss_fn = model, loss_fn
    self._train_kw = takes_keyword(loss_fn, "train")
    self.graphdef, self._params, self._rest = nnx.split(model, nnx.Param, ...)
    model.eval()
    self.eval_graphdef = nnx.split(model, nnx.Param, ...)[0]
    model.train()

  def init(self, rng: jax.Array) -> tuple[Any, Any]:
    del rng  # an nnx model is initialised by its constructor (its own nnx.Rngs)
    return self._params, self._rest

  def loss(self, params, rest, batch, rng, *, train):
    del rng  # nnx models carry their RNG streams in `rest`
    model = nnx.merge(self.graphdef if train else self.eval_graphdef, params, rest, copy=True)
    kwargs = {"train": train} if self._train_kw else {}
    loss, metrics = split_loss_output(self.loss_fn(model, batch, **kwargs), "loss_fn")
    return loss, metrics, nnx.state(model, nnx.Not(nnx.Param))

  def predict(self, params, rest, x, fn):
    model = nnx.merge(self.eval_graphdef, params, rest, copy=True)
    return fn(model, x) if fn is not None else model(x)

  def write_back(self, params, rest):
    nnx.update(self.model, params, rest)


class LinenAdapter(ModelAdapter):
  """A `linen.Module`, initialised by running ``loss_fn`` on an example batch.

  ``loss_fn`` gets the module bound to its variables, so ``model(x)`` calls
  it; collections other than ``params`` (``batch_stats``, ...) are mutable
  while training. RNG streams named in `rng_streams` get a fresh key each
  step.
  """

  kind = "linen"

  def __init__(self, module: nn.Module, loss_fn: LossFn, example_batch: Any,
               rng_streams: Sequence[str]):
    self.module, self.loss_fn, self.example_batch = module, loss_fn, example_batch
    self.rng_streams = tuple(rng_streams)
    self._train_kw = takes_keyword(loss_fn, "train")
    self._call_train_kw = takes_keyword(module.__call__, "train")
    self._mutable: tuple[str, ...] = ()

  def _method(self, train: bool) -> Callable[..., Any]:
    kwargs = {"train": train} if self._train_kw else {}
    return lambda module, batch: self.loss_fn(module, batch, **kwargs)

  def _rngs(self, rng: jax.Array) -> dict[str, jax.Array]:
    keys = jax.random.split(rng, len(self.rng_streams))
    return dict(zip(self.rng_streams, keys))

  def init(self, rng: jax.Array) -> tuple[Any, Any]:
    params_key, rng = jax.random.split(rng)
    variables = self.module.init({"params": params_key, **self._rngs(rng)},
                                 self.example_batch, method=self._method(True))
    variables = dict(variables)
    if "params" not in variables:
      raise TrainerError(f"The linen module {type(self.module).__name__} has no 'params' "
                         "collection after init: nothing to train.")
    params = variables.pop("params")
    self._mutable = tuple(sorted(variables))
    return params, variables

  def loss(self, params, rest, batch, rng, *, train):
    variables = {"params": params, **rest}
    rngs = self._rngs(rng) if train else {}
    if train and self._mutable:
      out, new_rest = self.module.apply(variables, batch, method=self._method(True),
                                        mutable=list(self._mutable), rngs=rngs)
      new_rest = {k: new_rest.get(k, rest[k]) for k in rest}
    else:
      out, new_rest = self.module.apply(variables, batch, method=self._method(train),
                                        rngs=rngs), rest
    loss, metrics = split_loss_output(out, "loss_fn")
    return loss, metrics, new_rest

  def predict(self, params, rest, x, fn):
    variables = {"params": params, **rest}
    if fn is not None:
      return self.module.apply(variables, x, method=fn)
    kwargs = {"train": False} if self._call_train_kw else {}
    return self.module.apply(variables, x, **kwargs)


def adapt(model: Any, loss_fn: LossFn, *, example_batch: Any = None,
          rng_streams: Sequence[str] = ("dropout",)) -> ModelAdapter:
  """The adapter for `model`, or a `TrainerError` saying what is accepted.

  Example:
    >>> from flax import nnx
    >>> adapter = adapt(nnx.Linear(2, 1, rngs=nnx.Rngs(0)),
    ...                 lambda model, batch: model(batch).mean())
    >>> adapter.kind
    'nnx'
  """
  if not callable(loss_fn):
    raise TrainerError(f"loss_fn must be a function loss_fn(model, batch), got {loss_fn!r}.")
  if isinstance(model, nnx.Module):
    return NnxAdapter(model, loss_fn)
  if isinstance(model, nn.Module):
    if example_batch is None:
      raise TrainerError(
          f"A linen module ({type(model).__name__}) needs example_batch= to be "
          "initialised: Trainer(model, optimizer, loss_fn, example_batch=first_batch).")
    return LinenAdapter(model, loss_fn, example_batch, rng_streams)
  raise TrainerError(f"model must be a flax nnx.Module or linen.Module, got {model!r} "
                     f"(type {type(model).__name__}).")
