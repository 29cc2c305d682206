"""A train step under kernel selection, each family pinned to each of its kernels.

The MobileNet-style step of `benchmarks/step_accuracy.py` (depthwise and
pointwise convolutions, batch norm in primitive ops, one SGD update), small:
batch 4, 16x16, two blocks. Each run tunes with a fresh cache, one family
pinned to one kernel (``kernel.hints``) and the others tuned; each parameter's
update error is measured against the float64 step taking the run's own ReLU
branches, over `jax.jit`'s error on its own branches floored by its spread
under a 1e-7 change of the images (``same_branches``: a pre-activation within
float32's noise of zero may land on either side, and the update jumps there;
that is not a kernel's error). The worst parameter must stay within `WORST`
of `jax.jit` in every run.

`test_less_accurate_kernel_is_flagged` shows the measure can fail: a batch
norm whose statistics accumulate in bfloat16, pinned, is flagged.

The full sweep (every kernel of both families, three fresh caches each;
about 8 minutes on 2 cores) is ``bench_smoke``:
``pytest -m bench_smoke tests/ops/test_step_pinned_kernels.py``; ``make test``
runs the native batch norm pinned (the kernel of the escape the sweep was
built for) and the control.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from tests.processes import ROOT
from tunedjax import autotune

sys.path.insert(0, str(ROOT / "benchmarks"))
import step_accuracy as sa  # noqa: E402  pylint: disable=wrong-import-position

WORST = 3.0
SMALL = {"batch": 4, "size": 16, "widths": (8, 16), "strides": (1, 2)}
RUNS = 3


@pytest.fixture(scope="module")
def step():
  return sa.Problem(**SMALL)


def _same_branches(step, hints, cache_dir):
  """The run's worst parameter on the same branches (its ratio, its name), its
  flips and the kernels each family ran."""
  got, masks, kernels = sa.tuned(step.update, step.args, hints, str(cache_dir))
  ratio, name = sa.worst(got, step.reference(masks)[0], step.same_floor)
  return ratio, name, step.flips(masks), kernels


def _check(step, hints, cache_dir):
  ratio, name, flips, kernels = _same_branches(step, hints, cache_dir)
  assert ratio <= WORST, (f"{hints}: {name}'s update is {ratio:.1f}x as far from float64 "
                          f"(same branches; {flips} flips) as jax.jit's; kernels {kernels}")


@pytest.mark.slow
def test_native_batch_norm_pinned_keeps_updates_within_3x(step, tmp_path):
  _check(step, {"batch_norm": "native"}, tmp_path)


@pytest.mark.bench_smoke
@pytest.mark.parametrize("hints", sa.sweep_hints(),
                         ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()))
def test_each_pinned_kernel_keeps_updates_within_3x(step, hints, tmp_path_factory):
  for run in range(RUNS):  # fresh caches
    _check(step, hints, tmp_path_factory.mktemp(f"fresh{run}"))


def _bfloat16_statistics(x, scale, bias, spec):
  """Batch norm whose mean and variance accumulate in bfloat16: less accurate."""
  axes = tuple(range(x.ndim - 1))
  low = x.astype(jnp.bfloat16)
  mean = jnp.mean(low, axes, dtype=jnp.bfloat16)
  var = jnp.mean(jnp.square(low - mean), axes, dtype=jnp.bfloat16)
  mean, var = mean.astype(x.dtype), var.astype(x.dtype)
  y = (x - mean) * lax.rsqrt(var + jnp.asarray(spec.epsilon, x.dtype)) * scale + bias
  return y, mean, var


@pytest.fixture
def bfloat16_statistics():
  autotune.register_kernel("batch_norm", "bfloat16_statistics", _bfloat16_statistics,
                           applicable=lambda spec, platform: True)
  yield "bfloat16_statistics"
  autotune.unregister_kernel("batch_norm", "bfloat16_statistics")


@pytest.mark.slow
def test_less_accurate_kernel_is_flagged(step, bfloat16_statistics, tmp_path):
  hints = {"batch_norm": bfloat16_statistics, "conv": "xla"}
  ratio, name, _, kernels = _same_branches(step, hints, tmp_path)
  assert kernels["batch_norm"] == {bfloat16_statistics: 4}, kernels
  assert ratio > WORST, (name, ratio)  # 1.8e5 on this step (2026-12-06)
