"""Shared test set-up: 8 host CPU devices, fixed seeds, a hypothesis profile.

The device count must be set before JAX initialises its backends, which is why
it happens here at import time, before any test module runs JAX code.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_num_cpu_devices", 8)

from tunedjax import _native  # noqa: E402  # pylint: disable=wrong-import-position

# The native CPU kernels (tunedjax/_native.py) are built once per machine into
# one folder for the whole suite, its subprocesses (the demo, the notebooks)
# included, rather than into each test's private tuning cache (about 3 s a
# source each time). The folder name holds each build's digest, so it is safe
# to keep between runs.
os.environ.setdefault(
    "TUNEDJAX_NATIVE_DIR",
    os.path.join(tempfile.gettempdir(), f"tunedjax-native-tests-{os.getuid()}"))


def _seed_native_dir(built: str, suite: str) -> None:
  """Copies the libraries `make`'s install built (into the default folder) to the
  suite's folder, so that the suite does not compile them again (10-20 s of g++
  a source). Same digest, same source and flags; copied under a temporary name
  and renamed, as a build writes, so a worker never loads half a file."""
  built = os.path.expanduser(built)
  if not os.path.isdir(built) or os.path.abspath(built) == os.path.abspath(suite):
    return
  for digest in os.listdir(built):
    for name in os.listdir(os.path.join(built, digest)):
      target = os.path.join(suite, digest, name)
      if name.startswith(".") or not name.endswith(".so") or os.path.exists(target):
        continue
      os.makedirs(os.path.dirname(target), exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{name}-")
      with os.fdopen(fd, "wb") as out, open(os.path.join(built, digest, name), "rb") as src:
        shutil.copyfileobj(src, out)
      os.chmod(tmp, 0o755)
      os.replace(tmp, target)


_seed_native_dir(_native.DEFAULT_DIR, os.environ["TUNEDJAX_NATIVE_DIR"])

# The suite's tunedjax.jit calls must not record host-memory decisions in the
# user's cache (tunedjax._host_memory, auto mode); tests/test_host_memory.py
# sets the mode itself, and its child processes start without this.
os.environ.setdefault("TUNEDJAX_HOST_MEMORY", "default")

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


def _mesh8(axis_type: jax.sharding.AxisType | None = None) -> jax.sharding.Mesh:
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets 8 host CPU devices)")
  types = None if axis_type is None else (axis_type,)
  return jax.make_mesh((8,), ("data",), axis_types=types)


@pytest.fixture
def mesh8() -> jax.sharding.Mesh:
  """A one-axis mesh ('data') over the 8 host CPU devices, as `jax.make_mesh`
  makes it: an Explicit axis (jax 0.10 to 0.12), as a user's would be."""
  return _mesh8()


@pytest.fixture
def mesh8_auto() -> jax.sharding.Mesh:
  """`mesh8` with an Auto axis, for programs that plain `jax.jit` rejects on an
  Explicit one since jax 0.11 (the gradient of `take_along_axis` on a sharded
  batch asks for an `out_sharding`; jax 0.10 resolved it). What tunedjax does
  on Explicit axes is tested in tests/test_explicit_sharding.py, against
  plain `jax.jit` on the same inputs."""
  return _mesh8(jax.sharding.AxisType.Auto)


@pytest.fixture
def mesh8_explicit() -> jax.sharding.Mesh:
  """`mesh8` with an Explicit axis whatever `jax.make_mesh`'s default."""
  return _mesh8(jax.sharding.AxisType.Explicit)


@pytest.fixture(autouse=True)
def _cold_tuner_families(monkeypatch):
  """Each test starts with no family counted warm by the tuner (`_tuner._WARM`), so
  that what a screening call decides does not depend on the tests run before."""
  from tunedjax.autotune import _tuner  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(_tuner, "_WARM", set())

