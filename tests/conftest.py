"""Shared test set-up: 8 host CPU devices, fixed seeds, a hypothesis profile.

The device count must be set before JAX initialises its backends, which is why
it happens here at import time, before any test module runs JAX code.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_num_cpu_devices", 8)

settings.register_profile(
    "tunedjax",
    deadline=None,  # the first example of a JAX test compiles
    max_examples=int(os.environ.get("TUNEDJAX_HYPOTHESIS_EXAMPLES", "25")),
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # CI runs are repeatable; set the env var to explore more
)
settings.load_profile("tunedjax")


@pytest.fixture
def rng() -> np.random.Generator:
  """A seeded NumPy generator: random test data, the same on every run."""
  return np.random.default_rng(0)


@pytest.fixture
def mesh8() -> jax.sharding.Mesh:
  """A one-axis mesh ('data') over the 8 host CPU devices."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 host CPU devices)")
  return jax.make_mesh((8,), ("data",))
