"""End to end: kernel selection keeps a training step's updates as accurate as `jax.jit`'s.

A MobileNet-style train step in plain JAX (depthwise and pointwise
convolutions; batch norm written in primitive ops, found by the batch-norm
family's pattern) runs under `tunedjax.jit` with each batch-norm kernel
pinned (``kernel.hints``), and with the tuner choosing every kernel in fresh
caches. For each parameter, its update's error against a float64 run of the
same step is compared with `jax.jit`'s own error, floored by how far
`jax.jit`'s update moves when the images move by 1e-7 of themselves (at
float32's resolution the step is chaotic for some parameters). The worst
parameter must stay within `WORST` of `jax.jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tunedjax as tj
from tunedjax import autotune

WORST = 3.0
PERTURBATION = 1e-7
DN = ("NHWC", "HWIO", "NHWC")


def _conv(x, w, stride=1, groups=1):
  p = w.shape[0] // 2
  return lax.conv_general_dilated(x, w, (stride, stride), ((p, p), (p, p)),
                                  dimension_numbers=DN, feature_group_count=groups)


def _bn(x, g, b):  # batch norm as plain JAX writes it: two passes, rsqrt
  mean = x.mean(axis=(0, 1, 2))
  var = ((x - mean) ** 2).mean(axis=(0, 1, 2))
  return (x - mean) * lax.rsqrt(var + 1e-5) * g + b


def _params(rng, widths=(16, 32), c0=8):
  normal = lambda shape, s: rng.normal(size=shape) * s  # pylint: disable=unnecessary-lambda-assignment
  params = {"stem": normal((3, 3, 3, c0), 0.2), "head": normal((widths[-1], 10), 0.05)}
  cin = c0
  for i, cout in enumerate(widths):
    params[f"dw{i}"] = normal((3, 3, 1, cin), 0.3)
    params[f"g{i}a"], params[f"b{i}a"] = 1 + 0.1 * normal((cin,), 1), 0.1 * normal((cin,), 1)
    params[f"pw{i}"] = normal((1, 1, cin, cout), 0.1)
    params[f"g{i}b"], params[f"b{i}b"] = 1 + 0.1 * normal((cout,), 1), 0.1 * normal((cout,), 1)
    cin = cout
  return params


def _loss(params, x, y, strides=(1, 2)):
  h = jax.nn.relu(_conv(x, params["stem"], 2))
  for i, s in enumerate(strides):
    h = _conv(h, params[f"dw{i}"], s, groups=h.shape[-1])
    h = jax.nn.relu(_bn(h, params[f"g{i}a"], params[f"b{i}a"]))
    h = jax.nn.relu(_bn(_conv(h, params[f"pw{i}"]), params[f"g{i}b"], params[f"b{i}b"]))
  logits = h.mean(axis=(1, 2)) @ params["head"]
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()


def _update(params, x, y):  # SGD: the update is -lr * gradient
  return jax.tree.map(lambda g: -0.1 * g, jax.grad(_loss)(params, x, y))


@pytest.fixture(scope="module")
def problem():
  return make_problem()


def make_problem():
  """The step's float32 arguments, its float64 updates and each parameter's floor."""
  rng = np.random.default_rng(0)
  params = _params(rng)
  # Small: the property holds at any size, and the tuner times every candidate.
  x = rng.normal(size=(8, 16, 16, 3))
  y = rng.integers(0, 10, size=8)
  with jax.enable_x64(True):
    want = jax.jit(_update)(jax.tree.map(jnp.asarray, params), jnp.asarray(x), jnp.asarray(y))
    want = {k: np.asarray(v) for k, v in want.items()}
  p32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  x32 = jnp.asarray(x, jnp.float32)
  args = (p32, x32, jnp.asarray(y, jnp.int32))
  jitted = jax.jit(_update)(*args)
  moved = jax.jit(_update)(p32, x32 * (1 + PERTURBATION * rng.normal(size=x.shape)).astype(
      np.float32), args[2])
  floor = {k: max(_rel(jitted[k], want[k]), _rel(moved[k], jitted[k])) for k in want}
  return args, want, floor


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _worst(got, want, floor) -> tuple[float, str]:
  ratios = {k: _rel(got[k], want[k]) / floor[k] for k in want}
  name = max(ratios, key=ratios.get)
  return ratios[name], name


def _tuned(args, cache_dir, hints=None):
  config = {"kernel": {"enable": True, "hints": hints or {}}, "cache": {"dir": str(cache_dir)}}
  with tj.config_context(config):
    f = tj.jit(_update, session=autotune.TuningSession())
    got = f(*args)
    kernels = {(c.kernel, c.why): c.count
               for c in f.report(memory=False).last.kernel_report.of("batch_norm")}
  return got, kernels


@pytest.mark.slow
def test_tuner_choosing_keeps_updates_within_3x_of_jax_jit(problem, tmp_path_factory):
  args, want, floor = problem
  for run in range(2):  # fresh caches
    got, kernels = _tuned(args, tmp_path_factory.mktemp(f"fresh{run}"))
    assert sum(kernels.values()) == 4, kernels  # every batch norm found and decided
    worst, name = _worst(got, want, floor)
    assert worst <= WORST, (f"run {run}: {name}'s update is {worst:.1f}x as far from float64 "
                            f"as jax.jit's; batch-norm kernels {kernels}")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [k.name for k in autotune.kernels("batch_norm")])
def test_each_pinned_batch_norm_kernel_keeps_updates_within_3x(problem, kernel, tmp_path):
  args, want, floor = problem
  hints = {"batch_norm": kernel, "conv": "xla"}
  got, kernels = _tuned(args, tmp_path, hints)
  if kernels != {(kernel, "hint"): 4}:
    pytest.skip(f"{kernel} does not apply here (the native library is not built)")
  worst, name = _worst(got, want, floor)
  assert worst <= WORST, f"{kernel}: {name}'s update is {worst:.1f}x jax.jit's error"
