"""What the callback tests share: data whose epoch figures are known, a recorder."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tests.trainer import models as m
from tunedjax.trainer import Callback, Trainer

QUIET = {"autotune": False, "progress": False}


class ScoredEpochs:
  """The same regression batches every epoch, each carrying ``score``: epoch e's
  batches all score ``scores[e]``, so the loss function's ``score`` metric has
  that mean over epoch e (and its epoch logs a known sequence)."""

  def __init__(self, scores: Sequence[float], *, batches: int = 3, batch_size: int = 16):
    self.scores = list(scores)
    self.epoch = 0
    self._batches = m.batches(m.regression_data(n=batches * batch_size), batch_size)

  def __len__(self) -> int:
    return len(self._batches)

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    score = self.scores[min(self.epoch, len(self.scores) - 1)]
    self.epoch += 1
    for batch in self._batches:
      yield {**batch, "score": np.full(len(batch["y"]), score, np.float32)}


def scored_loss(model, batch):
  loss, metrics = m.nnx_loss(model, {"x": batch["x"], "y": batch["y"]})
  return loss, {**metrics, "score": batch["score"].mean()}


def scored_trainer(**kwargs: Any) -> Trainer:
  return Trainer(m.NnxMLP(), m.optimizer(), scored_loss, **{**QUIET, **kwargs})


class WeightsAtEpochEnd(Callback):
  """Copies the model's variables (on the host) at each epoch's end."""

  def __init__(self):
    self.weights: dict[int, Any] = {}

  def on_epoch_end(self, trainer, epoch, logs):
    self.weights[epoch] = _host(trainer.variables)


def _host(tree: Any) -> Any:
  """`tree` on the host, typed PRNG keys as their key data."""
  def leaf(x):
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
      return jax.random.key_data(x)
    return x

  return jax.device_get(jax.tree_util.tree_map(leaf, tree))


def assert_bitwise_equal(a: Any, b: Any) -> None:
  leaves_a, tree_a = jax.tree_util.tree_flatten(_host(a))
  leaves_b, tree_b = jax.tree_util.tree_flatten(_host(b))
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()
