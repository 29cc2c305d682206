"""The native-kernel build: compile on first use, reuse, and every way it can fail.

Most tests build a tiny C++ file (a fraction of a second) from a folder that
stands in for an op family's ``csrc``; one builds the real depthwise source and
calls its FFI handler against `lax.conv_general_dilated`.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
import subprocess
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tunedjax import _native
from tunedjax._errors import CacheWarning
from tunedjax._tuning import CpuInfo

TINY = 'extern "C" int tj_answer() { return 42; }\n'
USER_DEFAULT_DIR = _native.DEFAULT_DIR
# The suite's shared native folder (tests/conftest.py), before `fresh` unsets it.
SUITE_NATIVE_DIR = os.environ.get(_native.DIR_ENV_VAR)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
  """Each test: its own native folder, native kernels on, nothing loaded or warned yet."""
  monkeypatch.setenv("TUNEDJAX_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(_native, "DEFAULT_DIR", str(tmp_path / "native"))
  monkeypatch.delenv(_native.ENV_VAR, raising=False)
  monkeypatch.delenv(_native.DIR_ENV_VAR, raising=False)
  _native.reset()
  yield
  _native.reset()


@pytest.fixture
def sources(monkeypatch, tmp_path) -> pathlib.Path:
  """A stand-in source folder holding ``tiny.cc``."""
  folder = tmp_path / "csrc"
  folder.mkdir()
  (folder / "tiny.cc").write_text(TINY)
  monkeypatch.setattr(_native, "HEADER_DIR", folder)
  monkeypatch.setattr(_native, "_SOURCES", {"tiny": folder / "tiny.cc"})
  return folder


def needs_compiler():
  if _native.find_compiler() is None:
    pytest.skip("no C++ compiler on this machine")


def use_the_suites_native_folder(monkeypatch):
  """For a test of a shipped kernel rather than of building: the suite's folder
  (tests/conftest.py), where its libraries are built once, not this test's own."""
  if SUITE_NATIVE_DIR:
    monkeypatch.setenv(_native.DIR_ENV_VAR, SUITE_NATIVE_DIR)


def built(tmp_path: pathlib.Path) -> list[pathlib.Path]:
  return sorted((tmp_path / "native").glob("*/*"))


def test_builds_loads_and_caches_a_library(sources, tmp_path):
  needs_compiler()
  lib = _native.library("tiny")
  assert lib is not None and lib.tj_answer() == 42
  files = built(tmp_path)
  assert [f.name for f in files] == ["tiny.so"]  # no temporary file left beside it


def test_a_built_library_is_reused_without_compiling(sources, tmp_path, monkeypatch):
  needs_compiler()
  assert _native.library("tiny") is not None
  _native.reset()

  def no_compile(*args, **kwargs):
    raise AssertionError("compiled again although the library is cached")

  monkeypatch.setattr(_native, "_compile", no_compile)
  assert _native.library("tiny").tj_answer() == 42


def test_a_changed_source_builds_a_new_library(sources, tmp_path):
  needs_compiler()
  assert _native.library("tiny").tj_answer() == 42
  (sources / "tiny.cc").write_text(TINY.replace("42", "43"))
  _native.reset()
  assert _native.library("tiny").tj_answer() == 43
  assert len(built(tmp_path)) == 2


def test_the_first_build_compiles_every_source_side_by_side(sources, tmp_path, monkeypatch):
  """A new machine's first native kernel builds the others at the same time (not in turn)."""
  (sources / "second.cc").write_text(TINY.replace("tj_answer", "tj_second"))
  _native.register_source(sources / "second.cc")
  monkeypatch.setattr(_native, "find_compiler", lambda: _native.Compiler("/usr/bin/c++", "c++"))
  both_running = threading.Barrier(2, timeout=10)
  compiled = []

  def fake_compile(source, compiler, target):
    both_running.wait()  # raises BrokenBarrierError if the builds ran one after the other
    compiled.append(source)
    target.write_bytes(b"")

  monkeypatch.setattr(_native, "_compile", fake_compile)
  monkeypatch.setattr(_native.ctypes, "CDLL", lambda path: pathlib.Path(path).name)
  assert _native.library("tiny") == "tiny.so"
  assert sorted(compiled) == ["second", "tiny"]
  assert _native.library("second") == "second.so"  # already built: no second compile
  assert sorted(compiled) == ["second", "tiny"]


def test_digest_depends_on_compiler_and_cpu(sources, monkeypatch):
  gcc = _native.Compiler("/usr/bin/g++", "g++ 12.2.0")
  base = _native.build_digest("tiny", gcc)
  assert base == _native.build_digest("tiny", gcc)
  assert base != _native.build_digest("tiny", gcc._replace(version="g++ 13.1.0"))
  monkeypatch.setattr(_native, "host_cpu", lambda: CpuInfo("another CPU", ("sse2",)))
  assert base != _native.build_digest("tiny", gcc)


def test_turned_off_by_the_environment(sources, monkeypatch):
  monkeypatch.setenv(_native.ENV_VAR, "0")

  def no_compiler():
    raise AssertionError("looked for a compiler although native kernels are off")

  monkeypatch.setattr(_native, "find_compiler", no_compiler)
  assert _native.library("tiny") is None
  assert _native.ffi_target("tiny", "tj_answer") is None
  assert not _native.available("tiny")


def test_no_compiler_is_one_warning_naming_cxx(sources, monkeypatch):
  monkeypatch.delenv(_native.NATIVE_CXX_ENV_VAR, raising=False)
  monkeypatch.setenv("CXX", "/nonexistent/c++")
  with pytest.warns(UserWarning, match=r"no C\+\+ compiler found.*nonexistent.*\$CXX"):
    assert _native.library("tiny") is None
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _native.library("tiny") is None  # remembered: no second build, no second warning
    assert not _native.available("tiny")


def test_a_failed_build_warns_with_the_compiler_error_and_leaves_no_file(sources, tmp_path):
  needs_compiler()
  (sources / "broken.cc").write_text("this is not C++;\n")
  _native.register_source(sources / "broken.cc")
  with pytest.warns(UserWarning, match=r"broken\.cc are unavailable.*failed"):
    assert _native.library("broken") is None
  assert [f.name for f in built(tmp_path)] == ["tiny.so"]  # built beside it; nothing of broken


def test_an_unknown_source_lists_the_known_ones(sources):
  with pytest.warns(UserWarning, match=r"no native source 'nope'; available: \['tiny'\]"):
    assert _native.library("nope") is None


def test_a_build_cut_short_leaves_nothing_under_the_final_name(sources, tmp_path, monkeypatch):
  needs_compiler()

  def killed(command, timeout):
    pathlib.Path(command[-1]).write_bytes(b"\x7fELF half a library")
    raise subprocess.TimeoutExpired(command, timeout)

  monkeypatch.setattr(_native, "_run_in_own_group", killed)
  monkeypatch.setattr(_native, "find_compiler", lambda: _native.Compiler("/usr/bin/c++", "c++"))
  with pytest.warns(UserWarning, match="took over"):
    assert _native.library("tiny") is None
  assert built(tmp_path) == []


def test_a_corrupt_library_is_rebuilt_with_a_cache_warning(sources, tmp_path):
  needs_compiler()
  # A file under the final name that is not a library (a process loads a path
  # once, so the corrupt file is there before the first load).
  digest = _native.build_digest("tiny", _native.find_compiler())
  target = tmp_path / "native" / digest / "tiny.so"
  target.parent.mkdir(parents=True)
  target.write_bytes(b"not a shared object")
  with pytest.warns(CacheWarning, match="did not load"):
    lib = _native.library("tiny")
  assert lib.tj_answer() == 42
  assert isinstance(ctypes.CDLL(str(target)), ctypes.CDLL)


def test_the_native_dir_variable_moves_the_libraries(sources, tmp_path, monkeypatch):
  needs_compiler()
  monkeypatch.setenv(_native.DIR_ENV_VAR, str(tmp_path / "elsewhere"))
  assert _native.library("tiny").tj_answer() == 42
  assert built(tmp_path) == []
  assert [p.name for p in (tmp_path / "elsewhere").glob("*/*")] == ["tiny.so"]
  assert _native.status()["folder"] == str(tmp_path / "elsewhere")


def test_the_libraries_are_not_under_the_tuning_cache(sources, tmp_path, monkeypatch):
  """A fresh tuning cache re-tunes; it does not rebuild the C++ (the default folder stays)."""
  needs_compiler()
  assert _native.library("tiny").tj_answer() == 42
  monkeypatch.setenv("TUNEDJAX_CACHE_DIR", str(tmp_path / "another-cache"))
  _native.reset()
  monkeypatch.setattr(_native, "_compile", lambda *args: pytest.fail("rebuilt"))
  assert _native.library("tiny").tj_answer() == 42
  assert not (tmp_path / "cache").exists() and not (tmp_path / "another-cache").exists()
  assert _native.status()["folder"] == str(tmp_path / "native")


def test_the_default_folder_is_the_user_s():
  assert USER_DEFAULT_DIR == "~/.cache/tunedjax/native"  # the fixture moves it per test


def test_build_all_builds_each_source_once_and_reports_it(sources, tmp_path):
  needs_compiler()
  (sources / "second.cc").write_text(TINY.replace("tj_answer", "tj_second"))
  _native.register_source(sources / "second.cc")
  first = _native.build_all()
  assert [(b.source, b.error) for b in first] == [("second", None), ("tiny", None)]
  assert all(b.seconds > 0 and b.path.exists() for b in first)
  assert sorted(f.name for f in built(tmp_path)) == ["second.so", "tiny.so"]
  again = _native.build_all()
  assert [(b.source, b.path, b.seconds) for b in again] == [
      (b.source, b.path, 0.0) for b in first]
  assert _native.library("tiny").tj_answer() == 42  # loaded from what build_all built


def test_build_all_reports_a_failed_source_and_builds_the_others(sources, tmp_path):
  needs_compiler()
  (sources / "broken.cc").write_text("this is not C++;\n")
  _native.register_source(sources / "broken.cc")
  report = {b.source: b for b in _native.build_all()}
  assert "not C++" in report["broken"].error and not report["broken"].path.exists()
  assert report["tiny"].error is None and report["tiny"].path.exists()


def test_build_all_says_why_it_cannot_build(sources, monkeypatch):
  monkeypatch.setenv(_native.ENV_VAR, "off")
  with pytest.raises(_native.NativeBuildError, match=r"native kernels are off \(\$TUNEDJAX_NATIVE=off\)"):
    _native.build_all()
  monkeypatch.delenv(_native.ENV_VAR)
  monkeypatch.delenv(_native.NATIVE_CXX_ENV_VAR, raising=False)
  monkeypatch.setenv("CXX", "/nonexistent/c++")
  with pytest.raises(_native.NativeBuildError, match=r"no C\+\+ compiler found.*nonexistent"):
    _native.build_all()


def test_an_unusable_native_folder_builds_in_a_temporary_one(sources, tmp_path, monkeypatch):
  needs_compiler()
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  monkeypatch.setattr(_native, "DEFAULT_DIR", str(blocker / "native"))
  with pytest.warns(UserWarning, match="native kernel folder"):
    lib = _native.library("tiny")
  assert lib.tj_answer() == 42


@pytest.mark.slow
def test_the_depthwise_handler_matches_lax(rng, monkeypatch):
  """The real source: built, registered, called through `jax.ffi.ffi_call`."""
  needs_compiler()
  use_the_suites_native_folder(monkeypatch)
  from tunedjax.ops.conv import _native_depthwise  # registers the source
  assert _native_depthwise.SOURCE == "depthwise"
  target = _native.ffi_target("depthwise", "TjDepthwiseConvF64")
  assert target == "tunedjax_TjDepthwiseConvF64"
  assert _native.ffi_target("depthwise", "TjDepthwiseConvF64") == target  # registered once
  with jax.enable_x64():
    x = jnp.asarray(rng.normal(size=(3, 9, 7, 5)), jnp.float64)
    w = jnp.asarray(rng.normal(size=(3, 3, 1, 5)), jnp.float64)
    ref = lax.conv_general_dilated(x, w, (2, 1), ((1, 1), (0, 2)), feature_group_count=5,
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
    names = ("stride_h", "stride_w", "pad_h", "pad_w", "lhs_dil_h", "lhs_dil_w",
             "rhs_dil_h", "rhs_dil_w")
    attrs = {k: np.int64(v) for k, v in zip(names, (2, 1, 1, 0, 1, 1, 1, 1))}
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(ref.shape, ref.dtype))(
        x, w.reshape(3, 3, 5), **attrs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-12, atol=1e-12)


def test_a_kernel_module_s_native_sources_are_part_of_its_source_hash(sources, monkeypatch):
  """Editing a native kernel's C++ re-tunes its buckets, as editing its Python does."""
  import sys
  import types

  from tunedjax.autotune import _registry
  module = types.ModuleType("tj_native_kernel_example")

  def kernel(lhs, rhs, spec):
    del rhs, spec
    return lhs

  kernel.__module__ = module.__name__
  module.kernel = kernel
  module.NATIVE_SOURCES = ("tiny",)
  monkeypatch.setitem(sys.modules, module.__name__, module)
  before = _registry.source_hash(module.kernel)
  assert before == _registry.source_hash(module.kernel)
  (sources / "tiny.cc").write_text(TINY.replace("42", "7"))
  assert _registry.source_hash(module.kernel) != before


@pytest.mark.slow
def test_an_exported_program_calls_no_native_kernel(rng, monkeypatch):
  """`tj.jit(...).export()` leaves native kernels out, even pinned, even after a native call."""
  needs_compiler()
  use_the_suites_native_folder(monkeypatch)
  import tunedjax as tj
  from tunedjax import autotune

  def loss(x, scale, bias):
    return jnp.sum(jax.nn.relu(tj.ops.batch_norm.batch_norm(x, scale, bias)) ** 2)

  x = jnp.asarray(rng.normal(size=(8, 4, 4, 6)), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, size=6), jnp.float32)
  bias = jnp.asarray(rng.normal(size=6), jnp.float32)
  step = tj.jit(jax.grad(loss, argnums=(0, 1, 2)))
  with tj.config_context({"kernel": {"enable": True, "hints": {"batch_norm": "native"}}}):
    want = step(x, scale, bias)  # the native kernel, traced and run
    assert "tunedjax_TjBatchNorm" in jax.jit(step).lower(x, scale, bias).as_text()
    with pytest.warns(UserWarning, match="native"):  # the hint cannot be honoured in an export
      exported = step.export(x, scale, bias)
  text = exported.mlir_module()
  # No native custom call (``tunedjax_<symbol>`` targets); a scope name may mention tunedjax.
  assert not re.search(r"custom_call.*tunedjax_|call_target_name = \"tunedjax_", text)
  assert "tunedjax_Tj" not in text
  got = exported.call(x, scale, bias)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-5)


def test_a_build_past_its_time_limit_leaves_no_compiler_running(tmp_path, monkeypatch):
  # A compiler driver whose child outlives it, as cc1plus outlives `c++`: on the time-out
  # the whole process group goes, not the driver alone.
  child_pid = tmp_path / "child.pid"
  fake = tmp_path / "fake-c++"
  fake.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {child_pid}\nwait\n")
  fake.chmod(0o755)
  monkeypatch.setattr(_native, "BUILD_TIMEOUT_S", 1.0)
  with pytest.raises(_native.NativeBuildError, match="took over 1 s"):
    _native._compile("batch_norm", _native.Compiler(str(fake), "fake 1.0"),
                     tmp_path / "batch_norm.so")
  pid = int(child_pid.read_text())
  deadline = time.monotonic() + 10.0
  while time.monotonic() < deadline and _alive(pid):
    time.sleep(0.01)
  assert not _alive(pid), f"the compiler's child {pid} still runs after the time-out"
  assert list(tmp_path.glob(".batch_norm-*")) == []  # the partial output removed


def _alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie waiting for its parent to reap it does not)."""
  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except (FileNotFoundError, ProcessLookupError):
    return False
  return state not in ("Z", "X")
