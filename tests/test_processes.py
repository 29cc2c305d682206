"""The suite's own set-up: child processes compile as their parent does, and
`make test` compiles fast only where nothing is timed."""

from __future__ import annotations

import re
import sys

from tests import fast_compile, processes

LEVEL = "--xla_backend_optimization_level=0"
EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def test_a_child_keeps_the_compile_speed_flags_and_no_other_xla_flag(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_enable_fast_math=false {LEVEL} {EMITTERS}")
  env = processes.cpu_env()
  assert env["XLA_FLAGS"] == f"{LEVEL} {EMITTERS}" and env["JAX_PLATFORMS"] == "cpu"
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  assert "XLA_FLAGS" not in processes.cpu_env()
  monkeypatch.delenv("XLA_FLAGS")
  assert "XLA_FLAGS" not in processes.cpu_env()


def test_auto_picks_the_candidates_this_jaxlib_starts_with():
  flags = fast_compile.fast_compile_flags(["auto"])
  assert LEVEL in flags and set(flags) <= set(fast_compile.CANDIDATES)
  assert fast_compile.known(flags)
  for dropped in set(fast_compile.CANDIDATES) - set(flags):
    assert not fast_compile.known([dropped])
  assert not fast_compile.known(["--xla_no_such_flag_anywhere=true"])


def test_flags_given_are_used_as_given_and_none_means_none():
  assert fast_compile.fast_compile_flags([LEVEL]) == [LEVEL]
  assert fast_compile.fast_compile_flags([]) == []


def test_make_test_compiles_fast_in_the_parallel_phase_only():
  makefile = (processes.ROOT / "Makefile").read_text()
  assert re.search(r"^FAST_COMPILE \?= auto$", makefile, re.M)
  suite = makefile[makefile.index("SUITE = "):makefile.index("exit $$status")]
  parallel, serial = suite.split('-m "$(ALONE)')
  assert '-m "not $(ALONE)' in parallel
  assert "tests/fast_compile.py $(FAST_COMPILE)" in parallel
  assert 'XLA_FLAGS="$$fast' in parallel and "-n $(WORKERS)" in parallel
  assert "fast" not in serial
  assert re.search(r"^ALONE := \(serial or default_compile\)$", makefile, re.M)
