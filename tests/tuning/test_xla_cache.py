"""XLA's caches kept with the tuning cache: on by default on a GPU or TPU, opt-in
(level O2) on a CPU; a second process's first call hits the compilation cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

import tunedjax as tj
from tests.processes import ROOT, cpu_env
from tunedjax import _tuning


@pytest.fixture
def no_compilation_cache():
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    yield
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


def _config(tmp_path, **cache):
  return tj.Config.from_dict({"cache": {"dir": str(tmp_path), **cache}})


def test_a_gpu_or_tpu_keeps_xlas_caches_with_the_tuning_cache(tmp_path, no_compilation_cache):
  for backend in ("gpu", "cuda", "tpu"):
    jax.config.update("jax_compilation_cache_dir", None)
    got = _tuning.persist_xla(_config(tmp_path), backend=backend)
    assert got == str(tmp_path / "xla") == jax.config.jax_compilation_cache_dir
  # XLA's GPU autotuning results go with the executables (JAX's default).
  assert "autotune" in jax.config.jax_persistent_cache_enable_xla_caches


def test_a_cpu_a_readonly_cache_and_the_users_own_directory_are_left_alone(
    tmp_path, no_compilation_cache):
  assert _tuning.persist_xla(_config(tmp_path), backend="cpu") is None
  assert _tuning.persist_xla(_config(tmp_path, readonly=True), backend="gpu") is None
  assert not jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
  assert _tuning.persist_xla(_config(tmp_path), backend="gpu") == str(tmp_path / "mine")


_SCRIPT = textwrap.dedent("""
    import json, jax, jax.numpy as jnp
    import tunedjax as tj
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if "cache_hits" in event else None)
    tj.set_config({{"cache": {{"dir": {cache!r}}}, "level": "O2"}})
    step = tj.jit(lambda w, x: jnp.tanh(x @ w).sum())
    jax.block_until_ready(step(jnp.ones((8, 8)), jnp.ones((4, 8))))
    print(json.dumps({{"hits": len(hits)}}))
""")


def test_a_second_processs_first_call_hits_the_compilation_cache(tmp_path):
  script = _SCRIPT.format(cache=str(tmp_path))
  env = {**cpu_env(), "PYTHONPATH": os.pathsep.join(
      filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
  runs = []
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  assert runs[0]["hits"] == 0 and runs[1]["hits"] > 0
  assert any((tmp_path / "xla").iterdir())
