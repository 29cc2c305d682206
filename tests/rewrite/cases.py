"""Programs that real Flax/optax code produces, for testing rewrite passes.

Each `Case` is a function `fn(params, batch)` with random parameters and a
random batch whose leading axis is 16 (divisible by the 8 test devices). Between
them they contain every higher-order primitive the engine must recurse into:
`jit` (nnx and linen both emit it), `custom_jvp_call` (relu, gelu, softmax),
`custom_vjp_call`, `remat2`, `scan`, `cond` and `while`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

BATCH = 16


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  fn: Callable[[Any, Any], Any]
  params: Any
  batch: Any
  differentiable: bool = True  # whether d fn / d params is defined


def _normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> jax.Array:
  return jnp.asarray(rng.normal(size=shape, scale=scale).astype(np.float32))


class _CNN(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, (3, 3), strides=(2, 2), rngs=rngs)
    self.fc = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.bn(self.conv1(x)))
    x = self.drop(x)
    x = nnx.relu(self.conv2(x))
    return self.fc(x.mean(axis=(1, 2)))


def _cnn_parts(seed: int) -> tuple[Any, Any, Any, Callable[..., jax.Array]]:
  model = _CNN(nnx.Rngs(params=seed, dropout=seed + 1))
  model.train()  # BatchNorm uses batch statistics, Dropout is active
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params: Any, batch: Any) -> jax.Array:
    m = nnx.merge(graphdef, params, rest, copy=True)
    logits = m(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return graphdef, params, rest, loss


def _image_batch(rng: np.random.Generator) -> dict[str, jax.Array]:
  return {"x": _normal(rng, BATCH, 8, 8, 3),
          "y": jnp.asarray(rng.integers(0, 10, size=BATCH), jnp.int32)}


def nnx_cnn(rng: np.random.Generator) -> Case:
  _, params, _, loss = _cnn_parts(int(rng.integers(1 << 16)))
  return Case("nnx_cnn_bn_dropout", loss, params, _image_batch(rng))


def optax_train_step(rng: np.random.Generator) -> Case:
  _, params, _, loss = _cnn_parts(int(rng.integers(1 << 16)))
  opt = optax.adam(1e-2)
  state = {"params": params, "opt": opt.init(params)}

  def step(state: Any, batch: Any) -> Any:
    value, grads = jax.value_and_grad(loss)(state["params"], batch)
    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, value

  return Case("optax_train_step", step, state, _image_batch(rng), differentiable=False)


class _Block(nn.Module):

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(h, h)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(16)(nn.gelu(nn.Dense(32)(h)))
    return x + h


def linen_transformer(rng: np.random.Generator) -> Case:
  block = _Block()
  x = _normal(rng, BATCH, 6, 16)
  params = block.init(jax.random.key(int(rng.integers(1 << 16))), x)

  def loss(params: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(block.apply(params, x) ** 2)

  return Case("linen_transformer", loss, params, x)


def scan_rnn(rng: np.random.Generator) -> Case:
  params = {"w": _normal(rng, 12, 12, scale=0.3), "u": _normal(rng, 5, 12, scale=0.3)}

  def loss(params: Any, x: jax.Array) -> jax.Array:
    def cell(h, x_t):
      h = jnp.tanh(h @ params["w"] + x_t @ params["u"])
      return h, jnp.sin(h)
    h, ys = jax.lax.scan(cell, jnp.zeros((x.shape[0], 12)), jnp.swapaxes(x, 0, 1))
    return jnp.mean(h ** 2) + jnp.mean(ys)

  return Case("scan_rnn", loss, params, _normal(rng, BATCH, 7, 5))


def cond_while(rng: np.random.Generator) -> Case:
  params = {"w": _normal(rng, 4, 4, scale=0.5)}

  def fn(params: Any, x: jax.Array) -> jax.Array:
    # The while loop runs on values without tangents, so the whole function
    # stays reverse-differentiable; the cond carries the gradient.
    def body(c):
      i, v = c
      return i + 1, jnp.sin(v) * 1.5
    n, v = jax.lax.while_loop(lambda c: c[0] < 4, body, (0, jax.lax.stop_gradient(x).sum()))
    y = jax.lax.cond(v > 0, lambda a: jnp.sin(a @ params["w"]),
                     lambda a: jnp.cos(a) @ params["w"], x)
    return jnp.sum(y ** 2) + n.astype(jnp.float32) * v

  return Case("cond_while", fn, params, _normal(rng, BATCH, 4))


def checkpointed_block(rng: np.random.Generator) -> Case:
  params = {"w1": _normal(rng, 8, 16, scale=0.4), "w2": _normal(rng, 16, 8, scale=0.4)}

  @jax.checkpoint
  def block(p, x):
    return jnp.tanh(jnp.sin(x @ p["w1"])) @ p["w2"]

  def loss(params: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(block(params, block(params, x)) ** 2)

  return Case("checkpoint_block", loss, params, _normal(rng, BATCH, 8))


@jax.custom_vjp
def _clipped_sin(x):
  return jnp.sin(x)


def _clipped_sin_fwd(x):
  return jnp.sin(x), jnp.cos(x)


def _clipped_sin_bwd(cos_x, g):
  return (jnp.clip(cos_x * g, -0.5, 0.5),)


_clipped_sin.defvjp(_clipped_sin_fwd, _clipped_sin_bwd)


def custom_vjp_fn(rng: np.random.Generator) -> Case:
  params = {"w": _normal(rng, 6, 6, scale=0.5)}

  def loss(params: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(_clipped_sin(x @ params["w"]) ** 2)

  return Case("custom_vjp", loss, params, _normal(rng, BATCH, 6))


ALL_CASES = (nnx_cnn, linen_transformer, scan_rnn, cond_while, checkpointed_block,
             custom_vjp_fn, optax_train_step)
