"""The demo's network: a small residual CNN with depthwise-separable and 1x1 stages.

MobileNet-style blocks (depthwise 3x3, then pointwise 1x1, with residual
connections) and a ResNet-50 bottleneck stage of 1x1 convolutions around a 3x3
one, so that each kind of convolution the kernel tuner knows has its own
shape buckets. Flax nnx, NHWC, BatchNorm.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx


class ConvBN(nnx.Module):
  """Convolution (no bias), BatchNorm, optional ReLU."""

  def __init__(self, cin: int, cout: int, kernel: int, *, rngs: nnx.Rngs, stride: int = 1,
               groups: int = 1, relu: bool = True):
    self.conv = nnx.Conv(cin, cout, (kernel, kernel), strides=stride, padding="SAME",
                         feature_group_count=groups, use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
    self.relu = relu

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.norm(self.conv(x))
    return nnx.relu(y) if self.relu else y


class SeparableBlock(nnx.Module):
  """MobileNet's depthwise 3x3 then pointwise 1x1, residual when shapes allow."""

  def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs, stride: int = 1):
    self.depthwise = ConvBN(cin, cin, 3, rngs=rngs, stride=stride, groups=cin)
    self.pointwise = ConvBN(cin, cout, 1, rngs=rngs, relu=False)
    self.residual = stride == 1 and cin == cout

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.pointwise(self.depthwise(x))
    return nnx.relu(x + y if self.residual else y)


class Bottleneck(nnx.Module):
  """ResNet-50's 1x1 reduce, 3x3, 1x1 expand, with an identity shortcut."""

  def __init__(self, channels: int, reduced: int, *, rngs: nnx.Rngs):
    self.reduce = ConvBN(channels, reduced, 1, rngs=rngs)
    self.conv = ConvBN(reduced, reduced, 3, rngs=rngs)
    self.expand = ConvBN(reduced, channels, 1, rngs=rngs, relu=False)

  def __call__(self, x: jax.Array) -> jax.Array:
    return nnx.relu(x + self.expand(self.conv(self.reduce(x))))


class DemoNet(nnx.Module):
  """A 3x3 stem, two depthwise-separable stages, a bottleneck stage, a classifier.

  At 32x32 input: the stem, then MobileNet blocks (depthwise 3x3, pointwise
  1x1, residual where the shapes allow) at full, half and quarter
  resolution, the downsampling ones strided, then a ResNet-50 bottleneck (1x1
  reduce, 3x3, 1x1 expand) at quarter resolution, global average pooling and
  a linear classifier. Each kind of convolution the kernel tuner knows has
  shape buckets here: 3x3, depthwise, 1x1, and their gradients.

  Args:
    num_classes: outputs of the classifier.
    width: channels of the first stage (the later ones use 2x and 4x).
    seed: initialisation seed.

  Example:
    >>> model = DemoNet(8, width=8)
    >>> model.head.out_features, model.stem.conv.in_features
    (8, 3)
  """

  def __init__(self, num_classes: int, *, width: int = 32, seed: int = 0):
    rngs = nnx.Rngs(seed)
    w = width
    self.stem = ConvBN(3, w, 3, rngs=rngs)
    self.separable = nnx.List([SeparableBlock(w, w, rngs=rngs),
                               SeparableBlock(w, 2 * w, rngs=rngs, stride=2),
                               SeparableBlock(2 * w, 2 * w, rngs=rngs),
                               SeparableBlock(2 * w, 4 * w, rngs=rngs, stride=2)])
    self.bottleneck = Bottleneck(4 * w, w, rngs=rngs)
    self.head = nnx.Linear(4 * w, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.stem(x)
    for block in self.separable:
      h = block(h)
    return self.head(self.bottleneck(h).mean(axis=(1, 2)))


def loss_fn(model: DemoNet, batch: dict[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Softmax cross-entropy, with accuracy as a metric."""
  logits = model(batch["image"])
  labels = batch["label"]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


def accuracy(model: DemoNet, batch: dict[str, Any]) -> jax.Array:
  """The fraction of a batch classified right."""
  return (model(batch["image"]).argmax(-1) == batch["label"]).mean()
