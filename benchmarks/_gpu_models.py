"""The networks `benchmarks/gpu.py` trains.

* `ResNet` / `resnet50`: the Flax ImageNet example's linen ResNet
  (``examples/imagenet/models.py``: `BottleneckResNetBlock`, BatchNorm with
  momentum 0.9 and epsilon 1e-5, a ``dtype`` attribute), with its train step
  (cross-entropy plus the example's 1e-4 weight decay, SGD with
  Nesterov momentum 0.9 from optax). Single device: no ``axis_name``.
* `MiniGPT`: the JAX AI stack tutorial's miniGPT in Flax nnx: token and
  position embeddings, post-norm blocks of ``nnx.MultiHeadAttention`` called
  with ``mask=jnp.tril(jnp.ones((T, T)))`` and a GELU MLP, GPT-2's vocabulary.
* `functional_resnet`: a ResNet-50 of bottlenecks written with lax ops in either
  layout (as a PyTorch port would be), for the layout pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from jax import lax

ModuleDef = Any


class BottleneckResNetBlock(nn.Module):
  """Bottleneck ResNet block (1x1, 3x3, 1x1 convolutions)."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  """ResNetV1.5, as the Flax ImageNet example writes it."""

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  conv: ModuleDef = nn.Conv

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(self.conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = self.block_cls(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm,
                           act=self.act)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, self.dtype)


def resnet50(*, stages: Sequence[int] = (3, 4, 6, 3), width: int = 64, dtype: Any = jnp.float32,
             num_classes: int = 1000) -> ResNet:
  """The example's ResNet-50 (``stages``/``width`` shrink it for a smoke run)."""
  return ResNet(stage_sizes=tuple(stages), block_cls=BottleneckResNetBlock,
                num_classes=num_classes, num_filters=width, dtype=dtype)


def resnet_train_step(model: ResNet, *, learning_rate: float = 0.1, momentum: float = 0.9,
                      weight_decay: float = 1e-4):
  """``(init(x) -> state, step(state, images, labels) -> (state, loss))``, the example's step.

  ``state`` is ``(params, batch_stats, opt_state)``; the optimizer is optax SGD
  with Nesterov momentum, the loss the example's cross-entropy plus its L2
  weight penalty.
  """
  tx = optax.sgd(learning_rate, momentum=momentum, nesterov=True)

  @jax.jit
  def init(x):
    variables = model.init(jax.random.key(0), x[:1], train=False)
    params, stats = variables["params"], variables["batch_stats"]
    return params, stats, tx.init(params)

  def step(state, images, labels):
    params, stats, opt_state = state

    def loss_fn(p):
      logits, updates = model.apply({"params": p, "batch_stats": stats}, images,
                                    mutable=["batch_stats"])
      one_hot = jax.nn.one_hot(labels, logits.shape[-1])
      loss = jnp.mean(optax.softmax_cross_entropy(logits=logits.astype(jnp.float32),
                                                  labels=one_hot))
      l2 = sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(p) if x.ndim > 1)
      return loss + weight_decay * 0.5 * l2, updates["batch_stats"]

    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new_stats, opt_state), loss

  return init, step


def image_batch(batch: int, image: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  """Random NHWC float32 images and integer labels (ImageNet's 1000 classes)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, image, image, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 1000, size=batch), jnp.int32)
  return x, y


# --- miniGPT -----------------------------------------------------------------------------


class TransformerBlock(nnx.Module):
  """Masked multi-head self-attention and a GELU MLP, each followed by add & LayerNorm."""

  def __init__(self, width: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
    self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                            decode=False, rngs=rngs)
    self.norm1 = nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)
    self.up = nnx.Linear(width, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, width, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, epsilon=1e-6, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1])))  # the tutorial's: floats, not bools
    x = self.norm1(x + self.attention(x, mask=mask, decode=False))
    return self.norm2(x + self.down(nnx.gelu(self.up(x))))


class MiniGPT(nnx.Module):
  """Token ids ``[batch, tokens]`` to next-token logits ``[batch, tokens, vocab]``."""

  def __init__(self, *, vocab: int = 50257, tokens: int = 1024, width: int = 512,
               heads: int = 8, layers: int = 6, hidden: int | None = None, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.position = nnx.Embed(tokens, width, rngs=rngs)
    self.blocks = nnx.List([TransformerBlock(width, heads, hidden or 4 * width, rngs=rngs)
                            for _ in range(layers)])
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.embed(ids) + self.position(jnp.arange(ids.shape[1])[None, :])
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def lm_loss(model: MiniGPT, batch: dict[str, jax.Array]) -> jax.Array:
  """Next-token cross-entropy over the batch's ``ids`` (``[batch, tokens + 1]``)."""
  ids = batch["ids"]
  logits = model(ids[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), ids[:, 1:]).mean()


def lm_batches(count: int, batch: int, tokens: int, vocab: int, seed: int = 0) -> list[dict]:
  """`count` batches of random token ids ``[batch, tokens + 1]``."""
  rng = np.random.default_rng(seed)
  return [{"ids": rng.integers(0, vocab, size=(batch, tokens + 1)).astype(np.int32)}
          for _ in range(count)]


# --- ResNet-50 of lax ops, either layout ------------------------------------------------


def _weight(rng, k: int, cin: int, cout: int, layout: str, dtype) -> jax.Array:
  w = rng.normal(size=(k, k, cin, cout), scale=(2.0 / (k * k * cin)) ** 0.5)
  if layout == "NCHW":
    w = w.transpose(3, 2, 0, 1)
  return jnp.asarray(w, dtype)


def _functional_params(rng, stages, width, layout, dtype):
  params: dict[str, Any] = {"stem": _weight(rng, 7, 3, width, layout, dtype), "blocks": []}
  strides, cin = [], width
  for i, n in enumerate(stages):
    mid = width * 2**i
    for j in range(n):
      strides.append(2 if (j == 0 and i > 0) else 1)
      block = {"c1": _weight(rng, 1, cin, mid, layout, dtype),
               "c2": _weight(rng, 3, mid, mid, layout, dtype),
               "c3": _weight(rng, 1, mid, 4 * mid, layout, dtype),
               "g": jnp.ones(4 * mid, dtype), "b": jnp.zeros(4 * mid, dtype)}
      if j == 0:
        block["proj"] = _weight(rng, 1, cin, 4 * mid, layout, dtype)
      params["blocks"].append(block)
      cin = 4 * mid
  params["head"] = jnp.asarray(rng.normal(size=(cin, 1000), scale=cin**-0.5), dtype)
  return params, strides


def functional_resnet(*, batch: int, image: int, stages: Sequence[int] = (3, 4, 6, 3),
                      width: int = 64, layout: str = "NHWC", dtype: Any = jnp.float32,
                      seed: int = 0):
  """``(params, step, x, y)``: a ResNet of bottlenecks in lax ops and its SGD train step.

  ``layout`` is ``"NHWC"`` (HWIO kernels) or ``"NCHW"`` (OIHW kernels, as a
  PyTorch port); `step(params, x, y) -> (params, loss)`.
  """
  rng = np.random.default_rng(seed)
  params, strides = _functional_params(rng, stages, width, layout, dtype)
  nhwc = layout == "NHWC"
  dn = ("NHWC", "HWIO", "NHWC") if nhwc else ("NCHW", "OIHW", "NCHW")
  channel, spatial = (3, (1, 2)) if nhwc else (1, (2, 3))

  def conv(x, w, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=dn)

  def norm(x, g, b):
    axes = tuple(a for a in range(4) if a != channel)
    mean, var = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    shape = [1, 1, 1, 1]
    shape[channel] = -1
    return (x - mean) * lax.rsqrt(var + 1e-5) * g.reshape(shape) + b.reshape(shape)

  def loss(params, x, y):
    h = jax.nn.relu(conv(x, params["stem"], 2))
    for blk, s in zip(params["blocks"], strides):
      r = h if "proj" not in blk else conv(h, blk["proj"], s)
      h = jax.nn.relu(conv(h, blk["c1"]))
      h = jax.nn.relu(conv(h, blk["c2"], s))
      h = jax.nn.relu(norm(conv(h, blk["c3"]), blk["g"], blk["b"]) + r)
    logits = (h.mean(axis=spatial) @ params["head"]).astype(jnp.float32)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 1000), axis=-1))

  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - (0.01 * g).astype(p.dtype), params, grads), value

  shape = (batch, image, image, 3) if nhwc else (batch, 3, image, image)
  x = jnp.asarray(rng.normal(size=shape), dtype)
  y = jnp.asarray(rng.integers(0, 1000, size=batch), jnp.int32)
  return params, step, x, y
