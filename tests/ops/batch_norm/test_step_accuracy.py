"""End to end: kernel selection keeps a training step's updates as accurate as `jax.jit`'s.

A MobileNet-style train step in plain JAX (`benchmarks/step_accuracy.py`:
depthwise and pointwise convolutions; batch norm written in primitive ops,
found by the batch-norm family's pattern; batch 16, 32x32, two blocks) runs
under `tunedjax.jit` with each batch-norm kernel pinned (``kernel.hints``),
and with the tuner choosing every kernel in fresh caches. For each parameter,
its update's error against a float64 run of the same step is compared with
`jax.jit`'s own error, floored by how far `jax.jit`'s update moves when the
images move by 1e-7 of themselves (at float32's resolution the step is
chaotic for some parameters). Two measures, each within `WORST` of
`jax.jit` for the worst parameter: against the float64 step taking the run's
own ReLU branches (``same_branches``), always; against the float64 step on its
own branches, unless a ReLU input took the other branch than in float64 (a
pre-activation within float32's noise of zero: the update jumps there, and the
floor need not see it; not a kernel's error).
"""

from __future__ import annotations

import sys

import pytest

from tests.processes import ROOT
import tunedjax as tj
from tunedjax import autotune

sys.path.insert(0, str(ROOT / "benchmarks"))
import step_accuracy as sa  # noqa: E402  pylint: disable=wrong-import-position

WORST = 3.0
STEP = {"batch": 16, "size": 32, "widths": (32, 64), "strides": (1, 2)}


@pytest.fixture(scope="module")
def problem():
  return sa.Problem(**STEP)


def _tuned(step, cache_dir, hints=None):
  config = {"kernel": {"enable": True, "hints": hints or {}}, "cache": {"dir": str(cache_dir)}}
  with tj.config_context(config):
    f = tj.jit(step.update, session=autotune.TuningSession())
    got, masks = f(*step.args)
    kernels = {(c.kernel, c.why): c.count
               for c in f.report(memory=False).last.kernel_report.of("batch_norm")}
  return got, masks, kernels


def _check(step, got, masks, what):
  """Both measures within `WORST` (the own-branch one only without flips)."""
  same, same_name = sa.worst(got, step.reference(masks)[0], step.same_floor)
  assert same <= WORST, (f"{what}: {same_name}'s update is {same:.1f}x as far from float64 "
                         "(same branches) as jax.jit's")
  flips = step.flips(masks)
  own, name = sa.worst(got, step.want, step.floor)
  assert flips or own <= WORST, (f"{what}: {name}'s update is {own:.1f}x as far from float64 "
                                 "as jax.jit's, no ReLU input on another branch")


@pytest.mark.slow
def test_tuner_choosing_keeps_updates_within_3x_of_jax_jit(problem, tmp_path_factory):
  for run in range(2):  # fresh caches
    got, masks, kernels = _tuned(problem, tmp_path_factory.mktemp(f"fresh{run}"))
    assert sum(kernels.values()) == 4, kernels  # every batch norm found and decided
    _check(problem, got, masks, f"run {run}, batch-norm kernels {kernels}")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [k.name for k in autotune.kernels("batch_norm")])
def test_each_pinned_batch_norm_kernel_keeps_updates_within_3x(problem, kernel, tmp_path):
  got, masks, kernels = _tuned(problem, tmp_path, {"batch_norm": kernel, "conv": "xla"})
  if kernels != {(kernel, "hint"): 4}:
    pytest.skip(f"{kernel} does not apply here (the native library is not built)")
  _check(problem, got, masks, kernel)
