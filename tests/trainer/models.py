"""Small models and a generated regression/classification task for the Trainer tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx


def regression_data(n: int = 256, features: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
  """y = a fixed random linear map of x plus a little noise (random, never zeros)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, features)).astype(np.float32)
  w = rng.normal(size=(features,)).astype(np.float32)
  y = (x @ w + 0.05 * rng.normal(size=n)).astype(np.float32)
  return {"x": x, "y": y}


def batches(data: dict[str, np.ndarray], batch_size: int) -> list[dict[str, np.ndarray]]:
  n = len(data["y"]) // batch_size * batch_size
  return [{k: v[i:i + batch_size] for k, v in data.items()} for i in range(0, n, batch_size)]


class NnxMLP(nnx.Module):
  """Linear -> BatchNorm -> ReLU -> Dropout -> Linear: every kind of nnx state."""

  def __init__(self, features: int = 8, hidden: int = 32, *, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.fc1 = nnx.Linear(features, hidden, rngs=rngs)
    self.norm = nnx.BatchNorm(hidden, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, 1, rngs=rngs)

  def __call__(self, x):
    return self.fc2(self.drop(nnx.relu(self.norm(self.fc1(x)))))[:, 0]


class LinenMLP(nn.Module):
  hidden: int = 32

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(self.hidden)(x)
    h = nn.BatchNorm(use_running_average=not train)(h)
    h = nn.Dropout(0.1, deterministic=not train)(nn.relu(h))
    return nn.Dense(1)(h)[:, 0]


def nnx_loss(model, batch):
  err = model(batch["x"]) - batch["y"]
  return (err ** 2).mean(), {"mae": jnp.abs(err).mean()}


def linen_loss(model, batch, train=True):
  err = model(batch["x"], train=train) - batch["y"]
  return (err ** 2).mean()


def optimizer() -> optax.GradientTransformation:
  return optax.adam(1e-2)
