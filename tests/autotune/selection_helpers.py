"""Test kernels and a small MobileNet-style train step for the selection tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunedjax import _tuning
from tunedjax.autotune import _registry

# A correct alternative: the same convolution computed in canonical NCHW/OIHW
# order (transposes around `lax.conv_general_dilated`), applicable everywhere.


def conv_transposed(lhs: Any, rhs: Any, spec: Any) -> Any:
  lhs_spec, rhs_spec, out_spec = spec.dimension_numbers
  canon = tuple(range(len(lhs_spec)))
  params = dict(spec.params())
  params["dimension_numbers"] = lax.ConvDimensionNumbers(canon, canon, canon)
  out = lax.conv_general_dilated_p.bind(
      jnp.transpose(lhs, lhs_spec), jnp.transpose(rhs, rhs_spec), **params)
  return jnp.transpose(out, np.argsort(out_spec))


def _xla(lhs: Any, rhs: Any, spec: Any) -> Any:
  return _registry.get_kernel("conv", "xla").fn(lhs, rhs, spec)


def conv_wrong(lhs: Any, rhs: Any, spec: Any) -> Any:
  return 1.01 * _xla(lhs, rhs, spec)  # off by 1%: must be rejected


def conv_zeros(lhs: Any, rhs: Any, spec: Any) -> Any:
  del rhs  # very fast and wrong: must never win
  return jnp.zeros(spec.out_shape, spec.out_dtype) + 0 * jnp.sum(lhs)


def conv_boom(lhs: Any, rhs: Any, spec: Any) -> Any:
  raise RuntimeError("INTERNAL: test kernel failed on purpose")


def _always(spec: Any, platform: str) -> bool:
  del spec, platform
  return True


def _never(spec: Any, platform: str) -> bool:
  del spec, platform
  return False


TEST_KERNELS = {
    "t_transposed": (conv_transposed, _always),
    "t_wrong": (conv_wrong, _always),
    "t_zeros": (conv_zeros, _always),
    "t_boom": (conv_boom, _always),
    "t_never": (_xla, _never),
}


@contextlib.contextmanager
def registered(*names: str) -> Iterator[None]:
  """Registers the named test kernels for the duration of a block."""
  for name in names:
    fn, applicable = TEST_KERNELS[name]
    _registry.register_kernel("conv", name, fn, applicable=applicable, replace=True)
  try:
    yield
  finally:
    for name in names:
      _registry.unregister_kernel("conv", name)


# -- a MobileNet-style network: stem conv, depthwise 3x3 + BN + 1x1 blocks ----

DN = ("NHWC", "HWIO", "NHWC")


def mobilenet_params(rng: np.random.Generator, *, channels: int = 8,
                     blocks: int = 2, classes: int = 5) -> dict[str, Any]:
  def normal(*shape: int, scale: float) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape, scale=scale).astype(np.float32))

  params = {"stem": normal(3, 3, 3, channels, scale=0.3), "blocks": [],
            "head": normal(channels, classes, scale=0.3)}
  for _ in range(blocks):
    params["blocks"].append({
        "dw": normal(3, 3, 1, channels, scale=0.3),
        "gamma": 1.0 + normal(channels, scale=0.1),
        "beta": normal(channels, scale=0.1),
        "pw": normal(1, 1, channels, channels, scale=0.3),
    })
  return params


def _batchnorm(x: jax.Array, gamma: jax.Array, beta: jax.Array) -> jax.Array:
  mean = x.mean(axis=(0, 1, 2))
  var = x.var(axis=(0, 1, 2))
  return (x - mean) * lax.rsqrt(var + 1e-5) * gamma + beta


def mobilenet_loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
  h = lax.conv_general_dilated(x, params["stem"], (2, 2), "SAME", dimension_numbers=DN)
  h = jax.nn.relu(h)
  for i, block in enumerate(params["blocks"]):
    c = block["dw"].shape[-1]
    stride = (2, 2) if i == 0 else (1, 1)
    d = lax.conv_general_dilated(h, block["dw"], stride, "SAME", dimension_numbers=DN,
                                 feature_group_count=c)
    d = jax.nn.relu(_batchnorm(d, block["gamma"], block["beta"]))
    h = lax.conv_general_dilated(d, block["pw"], (1, 1), "VALID", dimension_numbers=DN)
  logits = h.mean(axis=(1, 2)) @ params["head"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


def mobilenet_step(params: dict[str, Any], x: jax.Array, y: jax.Array
                   ) -> tuple[jax.Array, Any]:
  """A train step's numbers: the loss and the gradients (jax.grad inside)."""
  return jax.value_and_grad(mobilenet_loss)(params, x, y)


def mobilenet_batch(rng: np.random.Generator, *, batch: int = 4, size: int = 12,
                    classes: int = 5) -> tuple[jax.Array, jax.Array]:
  x = jnp.asarray(rng.normal(size=(batch, size, size, 3)).astype(np.float32))
  y = jnp.asarray(rng.integers(0, classes, size=batch), jnp.int32)
  return x, y


def max_rel_err(a: Any, b: Any) -> float:
  """The largest over leaves of max|a - b| / max|b|."""
  errs = jax.tree.map(
      lambda u, v: float(jnp.max(jnp.abs(u - v)) / (jnp.max(jnp.abs(v)) + 1e-30)), a, b)
  return max(jax.tree.leaves(errs))


def isolated_selection(tmp_path: Any, **config: Any) -> contextlib.AbstractContextManager:
  """A fresh cache folder, step counter, statistics and in-process winners."""
  import tunedjax as tj  # pylint: disable=import-outside-toplevel
  from tunedjax.autotune import _phases  # pylint: disable=import-outside-toplevel

  @contextlib.contextmanager
  def scope() -> Iterator[Any]:
    _phases.reset()
    _tuning.default_session().forget_measured()
    overlay = {"cache": {"dir": str(tmp_path / "cache")}, **config}
    try:
      with tj.config_context(overlay) as cfg:
        yield cfg
    finally:
      _phases.reset()
      _tuning.default_session().forget_measured()

  return scope()


class StepClock:
  """Seconds that pass only when the code under test says so (`advance`).

  Example:
    >>> c = StepClock(); c.advance(0.5); c()
    0.5
  """

  def __init__(self):
    self.now = 0.0

  def advance(self, seconds):
    self.now += float(seconds)

  def __call__(self):
    return self.now
