"""On a GPU the layout pass keeps the user's layout (XLA:GPU assigns convolution
layouts itself) unless measure mode timed the other layout on that GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tunedjax import layout, rewrite
from tunedjax.layout import _measure

SPECS = {"NHWC": ("NHWC", "HWIO", "NHWC"), "NCHW": ("NCHW", "OIHW", "NCHW")}


def _net(user):
  def f(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=SPECS[user])
    return jax.nn.relu(y).sum()
  return f


def _args(user, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 6, 6, 4) if user == "NHWC" else (2, 4, 6, 6))
  w = rng.normal(size=(3, 3, 4, 5) if user == "NHWC" else (5, 4, 3, 3))
  return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("user", ["NHWC", "NCHW"])
def test_gpu_keeps_the_users_layout_and_says_why(user, dtype):
  args = _args(user, dtype)
  report = layout.explain(_net(user), *args, platform="gpu")
  assert report.decision == "unchanged" and report.target == user
  assert "XLA:GPU assigns" in report.reason and "nothing measured" in report.reason
  assert report.transposes_after == report.transposes_before == 0
  assert "XLA:GPU assigns" in str(report)
  opt = layout.optimize(_net(user), platform="gpu")
  np.testing.assert_array_equal(jax.jit(opt)(*args), jax.jit(_net(user))(*args))


def test_gpu_measure_mode_without_a_gpu_keeps_the_layout():
  report = layout.explain(_net("NCHW"), *_args("NCHW"), platform="gpu", mode="measure")
  assert report.decision == "unchanged" and "no GPU here" in report.reason


def test_gpu_uses_a_decision_measured_on_that_gpu(monkeypatch):
  asked = []

  def lookup(closed, target, platform=None):
    asked.append((target, platform))
    return {"choice": "relaid", "seconds": {"original": 2.0, "relaid": 1.0}}

  monkeypatch.setattr(_measure, "lookup", lookup)
  args = _args("NCHW")
  report = layout.explain(_net("NCHW"), *args, platform="gpu")
  assert asked == [("NHWC", "gpu")]
  assert report.decision == "relaid" and report.target == "NHWC" and report.cached
  got = jax.jit(layout.optimize(_net("NCHW"), platform="gpu"))(*args)
  np.testing.assert_allclose(got, _net("NCHW")(*args), rtol=1e-5)


def test_an_explicit_target_is_still_applied_on_gpu():
  report = layout.explain(_net("NCHW"), *_args("NCHW"), target="NHWC", platform="gpu")
  assert report.decision == "relaid"


def test_cpu_still_relays_nchw():
  report = layout.explain(_net("NCHW"), *_args("NCHW"), platform="cpu")
  assert report.decision == "relaid" and report.target == "NHWC"
