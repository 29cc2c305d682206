"""The prior table and option validation."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from tunedjax import ConfigError
from tunedjax import layout
from tunedjax.layout._prefer import canonical_platform, check_target


@pytest.mark.parametrize("dtype,platform,want", [
    (jnp.float32, "cpu", "NHWC"), (jnp.bfloat16, "cpu", "NHWC"), (jnp.float16, "cpu", "NHWC"),
    (jnp.float32, "gpu", "NCHW"), (jnp.float64, "cuda", "NCHW"),
    (jnp.bfloat16, "gpu", "NHWC"), (jnp.float16, "rocm", "NHWC"), (jnp.int8, "gpu", "NHWC"),
    (jnp.float32, "tpu", "NHWC"), (jnp.bfloat16, "TPU", "NHWC"), ("float32", "CPU", "NHWC"),
])
def test_preferred_table(dtype, platform, want):
  assert layout.preferred(dtype, platform) == want


def test_unknown_platform_names_the_valid_ones():
  with pytest.raises(ConfigError, match="did you mean 'gpu'.*'cpu', 'gpu', 'tpu'"):
    canonical_platform("gpuu")


def test_targets_and_modes_are_validated():
  assert check_target("nhwc") == "NHWC"
  with pytest.raises(ConfigError, match="'auto', 'NHWC' or 'NCHW'.*'NHCW'"):
    layout.optimize(lambda x: x, target="NHCW")
  with pytest.raises(ConfigError, match="'heuristic' or 'measure'.*did you mean 'measure'"):
    layout.optimize(lambda x: x, mode="measured")
  with pytest.raises(TypeError, match="expects a function"):
    layout.optimize(3)
