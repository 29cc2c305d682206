"""Random NCHW conv nets written with lax ops, as a PyTorch port would be.

`random_net(spec_seed, ...)` draws a layer list (conv with random strides,
padding, dilation and groups; bias add; ReLU; max and average pooling;
BatchNorm-style batch statistics; residual adds; channel concatenation) and
ends in global pooling or flatten + dense. It returns `fn(x, params)` and
random params and input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NCHW = ("NCHW", "OIHW", "NCHW")


def conv(x, w, stride=(1, 1), padding="SAME", dilation=(1, 1), groups=1):
  return lax.conv_general_dilated(x, w, stride, padding, rhs_dilation=dilation,
                                  dimension_numbers=NCHW, feature_group_count=groups)


def batch_norm(x, gamma, beta):
  mean = x.mean(axis=(0, 2, 3), keepdims=True)
  var = x.var(axis=(0, 2, 3), keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * gamma[None, :, None, None] + beta[None, :, None, None]


def max_pool(x, k=2, s=2, padding="VALID"):
  return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, k, k), (1, 1, s, s), padding)


def avg_pool(x, k=2, s=2):
  return lax.reduce_window(x, 0.0, lax.add, (1, 1, k, k), (1, 1, s, s), "VALID") / (k * k)


@dataclasses.dataclass(frozen=True)
class Net:
  fn: Callable[[Any, Any], Any]
  params: Any
  x: Any
  layers: tuple[str, ...]


def random_net(seed: int, *, depth: int = 4, dtype: Any = jnp.float32, head: str | None = None) -> Net:
  """A random conv net; `seed` fixes the architecture, the params and the input."""
  rng = np.random.default_rng(seed)
  n, c_in, c, hw = 2, int(rng.choice([1, 3])), int(rng.choice([2, 4])), int(rng.choice([8, 9, 10]))
  params: list[Any] = []
  ops: list[Callable[[Any, list[Any]], Any]] = []
  names: list[str] = []

  def normal(*shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape, scale=scale), dtype)

  params.append(normal(c, c_in, 3, 3, scale=1.0 / np.sqrt(9 * c_in)))
  ops.append(lambda x, p: conv(x, p[0]))
  x0 = normal(n, c_in, hw, hw)

  def shape_now():
    def body(x):
      for op in ops:
        x = op(x, params)
      return x
    return jax.eval_shape(body, x0).shape

  size = hw
  for _ in range(depth):
    kind = rng.choice(["conv", "conv", "bn", "relu", "maxpool", "avgpool", "residual", "concat"])
    if kind in ("maxpool", "avgpool") and size < 4:
      kind = "conv"
    if kind == "conv":
      out = int(rng.choice([2, 4, 6]))
      groups = 2 if (c % 2 == 0 and out % 2 == 0 and rng.random() < 0.4) else 1
      k = int(rng.choice([1, 2, 3]))
      stride = (int(rng.choice([1, 2])), int(rng.choice([1, 2]))) if size >= 6 else (1, 1)
      dil = (int(rng.choice([1, 2])),) * 2 if k > 1 and size >= 6 else (1, 1)
      pad = ["SAME", "VALID", ((1, 0), (0, 2))][int(rng.integers(3))]
      if pad == "VALID" and (k - 1) * dil[0] + 1 > size - 2:
        pad = "SAME"
      i = len(params)
      params.append(normal(out, c // groups, k, k, scale=1.0 / np.sqrt(c * k * k)))
      params.append(normal(out, scale=0.1))
      ops.append(lambda x, p, i=i, s=stride, pd=pad, d=dil, g=groups:
                 conv(x, p[i], s, pd, d, g) + p[i + 1][None, :, None, None])
      names.append(f"conv{k}x{k}/s{stride}/d{dil[0]}/g{groups}/{pad}")
      c = out
    elif kind == "bn":
      i = len(params)
      params += [normal(c, scale=0.2) + 1, normal(c, scale=0.1)]
      ops.append(lambda x, p, i=i: batch_norm(x, p[i], p[i + 1]))
      names.append("bn")
    elif kind == "relu":
      ops.append(lambda x, p: jax.nn.relu(x))
      names.append("relu")
    elif kind == "maxpool":
      ops.append(lambda x, p: max_pool(x))
      names.append("maxpool")
    elif kind == "avgpool":
      ops.append(lambda x, p: avg_pool(x))
      names.append("avgpool")
    elif kind == "residual":  # x + conv3x3(relu(x)), same shape
      i = len(params)
      params.append(normal(c, c, 3, 3, scale=1.0 / np.sqrt(9 * c)))
      ops.append(lambda x, p, i=i: x + conv(jnp.maximum(x, 0), p[i]))
      names.append("residual")
    else:  # concat: channels of x and of a 1x1 conv of x
      i = len(params)
      params.append(normal(2, c, 1, 1, scale=1.0 / np.sqrt(c)))
      ops.append(lambda x, p, i=i: jnp.concatenate([x, conv(x, p[i])], axis=1))
      names.append("concat")
      c += 2
    size = min(shape_now()[2:])
  head = head or str(rng.choice(["global", "flatten"]))
  if head == "global":
    i = len(params)
    params.append(normal(c, 3, scale=1.0 / np.sqrt(c)))
    ops.append(lambda x, p, i=i: x.mean(axis=(2, 3)) @ p[i])
  else:
    i = len(params)
    flat = int(np.prod(shape_now()[1:]))
    params.append(normal(flat, 3, scale=1.0 / np.sqrt(flat)))
    ops.append(lambda x, p, i=i: x.reshape(x.shape[0], -1) @ p[i])
  names.append(head)

  def fn(x, p):
    for op in ops:
      x = op(x, p)
    return x

  return Net(fn, params, x0, tuple(names))
