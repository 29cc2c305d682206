"""The suite's own set-up: child processes compile as their parent does, and
`make test` compiles fast only where nothing is timed."""

from __future__ import annotations

import re

from tests import processes

LEVEL = "--xla_backend_optimization_level=0"


def test_a_child_keeps_the_optimisation_level_and_no_other_xla_flag(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_enable_fast_math=false {LEVEL}")
  env = processes.cpu_env()
  assert env["XLA_FLAGS"] == LEVEL and env["JAX_PLATFORMS"] == "cpu"
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  assert "XLA_FLAGS" not in processes.cpu_env()
  monkeypatch.delenv("XLA_FLAGS")
  assert "XLA_FLAGS" not in processes.cpu_env()


def test_make_test_compiles_fast_in_the_parallel_phase_only():
  makefile = (processes.ROOT / "Makefile").read_text()
  assert re.search(rf"^FAST_COMPILE \?= {LEVEL}$", makefile, re.M)
  suite = makefile[makefile.index("SUITE = "):makefile.index("exit $$status")]
  parallel, serial = suite.split('-m "serial')
  assert 'XLA_FLAGS="$(FAST_COMPILE)' in parallel and "-n $(WORKERS)" in parallel
  assert "FAST_COMPILE" not in serial
