"""Host memory (`tunedjax._host_memory`): what `import tunedjax` does to glibc's malloc
with ``TUNEDJAX_HOST_MEMORY=retain`` (opt in), and that it does nothing without it.

The import-time behaviour is checked in fresh processes: each runs a jitted
function whose temporary buffer (80 MiB, kept by an optimization barrier) is
larger than a glibc thread arena can hold, and counts the minor page faults of
each call after warm-up (the median of 15 calls). Page faults are counted, not timed, so these tests
do not depend on the machine's load.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import tunedjax as tj
from tests import processes
from tunedjax import _host_memory

TEMP_BYTES = 80 * 2**20
PAGES = TEMP_BYTES // 4096

# Runs in a fresh process: argv[1] = "jax-first" starts JAX's backend before
# importing tunedjax. Prints the status and the page faults per call.
_CHILD = r"""
import json, resource, statistics, sys, warnings
warnings.simplefilter("always")
if sys.argv[1] == "jax-first":
  import jax.numpy as jnp
  jnp.ones(3).block_until_ready()
with warnings.catch_warnings(record=True) as caught:
  import tunedjax as tj
import jax, jax.numpy as jnp

@jax.jit
def f(x):  # an 80 MiB temporary: the concatenation, kept by the barrier
  return jax.lax.optimization_barrier(jnp.concatenate([x * 2.0, x * 3.0])).sum()

x = jnp.arange(TEMP_BYTES // 8, dtype=jnp.float32) / 1e6
assert f.lower(x).compile().memory_analysis().temp_size_in_bytes >= TEMP_BYTES
for _ in range(5):
  f(x).block_until_ready()
faults = []
for _ in range(15):  # the heap may still grow in a few calls: the median is the steady state
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
import numpy as np
block = np.ones(64 * 2**20 // 8)  # with the settings, from the heap: mapping is off
del block
released = tj.release_host_memory()
print(json.dumps({"status": tj.host_memory_status().to_dict(),
                  "faults": statistics.median(faults), "released": released,
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
""".replace("TEMP_BYTES", str(TEMP_BYTES))


# Every variable the decision reads: cleared, so the machine's environment cannot steer a test.
_ALLOCATOR_ENV = (*_host_memory._MALLOC_ENV, "GLIBC_TUNABLES", "LD_PRELOAD", _host_memory.ENV_VAR)


def _clean_env(**extra: str) -> dict[str, str]:
  env = processes.cpu_env()
  for name in _ALLOCATOR_ENV:
    env.pop(name, None)
  return {**env, **extra}


def _child(order: str = "tunedjax-first", **env: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _CHILD, order], capture_output=True, text=True,
                       env=_clean_env(**env), cwd=processes.ROOT, timeout=240, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  return processes.last_json(out.stdout)


needs_glibc = pytest.mark.skipif(_host_memory._glibc() is None,
                                 reason="the host-memory settings are glibc's")


RETAIN = {_host_memory.ENV_VAR: "retain"}


@needs_glibc
def test_retain_reuses_memory_so_a_step_does_not_fault_its_temporaries_again():
  retained = _child(**RETAIN)
  assert retained["status"]["applied"] is True
  assert retained["status"]["settings"] == _host_memory.SETTINGS
  assert retained["warnings"] == []
  assert retained["faults"] < 0.05 * PAGES, retained
  assert retained["released"] is True  # the freed 64 MiB block went back to the OS
  # By default (and with "default") the allocator is untouched: the whole
  # temporary is faulted in again on every call.
  for env in ({}, {_host_memory.ENV_VAR: "default"}):
    default = _child(**env)
    assert default["status"] == {"mode": "default", "applied": False, "settings": {},
                                 "reason": default["status"]["reason"]}
    assert "is not 'retain'" in default["status"]["reason"]
    assert default["warnings"] == []
    assert default["faults"] > 0.5 * PAGES, default


@needs_glibc
def test_backend_started_before_import_warns_and_leaves_malloc_alone():
  got = _child("jax-first", **RETAIN)
  status = got["status"]
  assert status["applied"] is False and status["settings"] == {}
  assert "started before tunedjax was imported" in status["reason"]
  (warning,) = [w for w in got["warnings"] if w.startswith("HostMemoryWarning")]
  assert "Import tunedjax before running JAX code" in warning
  assert _host_memory.ENVIRONMENT_HINT in warning
  quiet = _child("jax-first")  # not opted in: nothing to warn about
  assert quiet["warnings"] == []


@needs_glibc
@pytest.mark.parametrize("name,value", [("MALLOC_ARENA_MAX", "2"),
                                        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")])
def test_an_environment_that_tunes_malloc_is_respected(name, value):
  status = _child(**RETAIN, **{name: value})["status"]
  assert status["applied"] is False
  assert status["reason"] == f"the environment already tunes malloc (${name})"


def test_a_bad_mode_warns_naming_the_value_and_the_valid_ones():
  got = _child(**{_host_memory.ENV_VAR: "always"})
  (warning,) = got["warnings"]
  assert warning.startswith("HostMemoryWarning")
  assert "'always'" in warning and "'retain' or 'default'" in warning
  assert got["status"]["applied"] is False


def _decide(monkeypatch, **env: str) -> _host_memory.HostMemoryStatus:
  """The decision `configure` would make in this process under `env` (no mallopt call
  unless every check passes; the suite's process already has the settings)."""
  for name in _ALLOCATOR_ENV:
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(_host_memory, "_STATUS", None)
  return _host_memory.configure()


def test_without_glibc_nothing_is_set(monkeypatch):
  monkeypatch.setattr(_host_memory, "_glibc", lambda: None)
  status = _decide(monkeypatch, **RETAIN)
  assert status == _host_memory.HostMemoryStatus(
      "retain", False, "the C library is not glibc (nothing to set)")
  assert tj.release_host_memory() is False


@pytest.mark.parametrize("preload", ["/usr/lib/libjemalloc.so.2", "libtcmalloc_minimal.so.4"])
def test_a_preloaded_allocator_is_respected(monkeypatch, preload):
  if _host_memory._glibc() is None:
    pytest.skip("the check follows the glibc check")
  status = _decide(monkeypatch, LD_PRELOAD=preload, **RETAIN)
  assert status.reason == "the environment already tunes malloc ($LD_PRELOAD)"


def test_status_is_decided_once(monkeypatch):
  first = tj.host_memory_status()
  monkeypatch.setenv(_host_memory.ENV_VAR, "retain" if first.mode == "default" else "default")
  assert tj.host_memory_status() is first


def test_not_opting_in_changes_nothing(monkeypatch):
  monkeypatch.setattr(_host_memory, "_glibc", lambda: pytest.fail("looked at the C library"))
  status = _decide(monkeypatch)
  assert status.mode == "default" and not status.applied and status.settings == {}


def test_status_is_json_able():
  status = tj.host_memory_status()
  assert json.loads(json.dumps(status.to_dict()))["mode"] == status.mode
  assert status.applied == bool(status.settings)


def test_minor_page_faults_count_up():
  before = _host_memory.minor_page_faults()
  block = np.ones(8 * 2**20 // 8)  # 8 MiB touched: new pages unless memory is reused
  assert _host_memory.minor_page_faults() >= before
  del block
