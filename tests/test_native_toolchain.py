"""How native kernels are built and checked: compilers, warnings, sanitizers, no compiler.

* Each source compiles with ``-Wall -Wextra -Werror`` under every compiler
  installed (g++, clang++; one that is missing is skipped), and a clang build
  runs every handler right.
* ``$TUNEDJAX_NATIVE_CXX`` chooses the compiler before ``$CXX``.
* Sanitize mode (``TUNEDJAX_NATIVE_SANITIZE=1``) builds into folders of its
  own, warns instead of crashing where its runtime is not preloaded, and
  under ``make test-native-sanitize`` really loads instrumented libraries.
* A deliberate one-element write past a handler's output is caught: by the
  guard regions of ``tests/native_harness.py`` in any build, and by
  AddressSanitizer when XLA runs the handler on its own buffers.
* Without a compiler the native kernels step aside: not applicable, one
  warning per source, the same results.

The tests that compile the sources again (each compiler, the sanitizers; about
a minute on 2 cores) are marked ``native_checks``: `make test` leaves them
out and ``make test-native-sanitize`` runs them (or ``pytest -m native_checks``).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests import native_harness as nh
from tests.autotune import selection_helpers as h
from tunedjax import _native, autotune

NHWC = ("NHWC", "HWIO", "NHWC")
COMPILERS = ("g++", "clang++")
DEPTHWISE_END = "    ConvRows<T>(xp, wp, yp, H, W, C, KH, KW, OH, OW, g, segs, lo, hi);\n  });\n"
"""Where `DepthwiseConv` has written its output: a deliberate bug goes after it."""
ONE_PAST_THE_END = "  yp[N * OH * OW * C] = T(1);  // deliberate: one element past the output\n"


@pytest.fixture
def reset_native():
  """Native state forgotten before and after (libraries are loaded again on demand)."""
  _native.reset()
  yield
  _native.reset()


def source_path(stem: str) -> pathlib.Path:
  autotune.op_families()  # each family registers its C++ sources when it loads
  return _native.source_path(stem)


def write_patched_depthwise(folder: pathlib.Path) -> str:
  """``depthwise_oob.cc`` in `folder` (with the shared header): depthwise.cc writing one
  element past its output. Returns its stem."""
  folder.mkdir(parents=True, exist_ok=True)
  for header in _native.HEADER_DIR.glob("*.h"):
    shutil.copy(header, folder / header.name)
  text = source_path("depthwise").read_text()
  assert text.count(DEPTHWISE_END) == 1, "depthwise.cc changed: update DEPTHWISE_END"
  (folder / "depthwise_oob.cc").write_text(
      text.replace(DEPTHWISE_END, DEPTHWISE_END + ONE_PAST_THE_END))
  return "depthwise_oob"


# ------------------------------------------------------------------ compilers --


@pytest.mark.native_checks
@pytest.mark.slow
@pytest.mark.parametrize("cxx", COMPILERS)
def test_every_source_compiles_without_warnings(cxx, tmp_path):
  """`_native.FLAGS` (``-Wall -Wextra``) and ``-Werror``: each source and the test harness."""
  path = shutil.which(cxx)
  if path is None:
    pytest.skip(f"{cxx} is not installed (apt-get install -y "
                f"{'clang' if 'clang' in cxx else 'g++'})")
  autotune.op_families()  # each family registers its C++ sources when it loads
  files = [source_path(s) for s in _native.sources()] + [nh.HARNESS_SOURCE]
  jobs = {}
  for f in files:
    command = [path, *_native.FLAGS, "-Werror", "-pthread", "-isystem", jax.ffi.include_dir(),
               f"-I{_native.HEADER_DIR}", str(f), "-o", str(tmp_path / f"{f.stem}.so")]
    jobs[f.name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
  failed = {name: job.communicate(timeout=600)[0] for name, job in jobs.items()}
  failed = {name: out for name, out in failed.items() if jobs[name].returncode != 0 or out}
  assert not failed, f"{cxx} warned or failed:\n" + "\n".join(
      f"--- {name}\n{out[-3000:]}" for name, out in failed.items())


def _fake_compiler(folder: pathlib.Path, name: str) -> str:
  path = folder / name
  path.write_text(f"#!/bin/sh\necho '{name} 1.0'\n")
  path.chmod(0o755)
  return str(path)


def test_native_cxx_is_chosen_before_cxx(tmp_path, monkeypatch):
  first, second = _fake_compiler(tmp_path, "first-cxx"), _fake_compiler(tmp_path, "second-cxx")
  monkeypatch.setenv("CXX", second)
  monkeypatch.delenv(_native.NATIVE_CXX_ENV_VAR, raising=False)
  assert _native.find_compiler() == _native.Compiler(second, "second-cxx 1.0")
  monkeypatch.setenv(_native.NATIVE_CXX_ENV_VAR, first)
  assert _native.find_compiler() == _native.Compiler(first, "first-cxx 1.0")
  monkeypatch.delenv("CXX")
  assert _native.find_compiler().path == first
  monkeypatch.setenv(_native.NATIVE_CXX_ENV_VAR, str(tmp_path / "missing-cxx"))
  assert _native.find_compiler() is None  # chosen but not there: no silent fallback


@pytest.mark.native_checks
@pytest.mark.slow
def test_a_clang_build_runs_every_handler(tmp_path, monkeypatch, reset_native):
  """``TUNEDJAX_NATIVE_CXX=clang++``: its own libraries, every handler right."""
  if shutil.which("clang++") is None:
    pytest.skip("clang++ is not installed (apt-get install -y clang)")
  # Plain builds: a sanitizer run preloads the default compiler's runtime, and an
  # uninstrumented library loads beside it.
  monkeypatch.delenv(_native.SANITIZE_ENV_VAR, raising=False)
  monkeypatch.setenv(_native.NATIVE_CXX_ENV_VAR, "clang++")
  monkeypatch.setenv(_native.DIR_ENV_VAR, str(tmp_path / "native"))
  _native.reset()
  assert "clang" in _native.find_compiler().version
  from tests import test_native_edges as edges
  for dtype in (np.float32, np.float64):
    for kind, source, stem, ops, shapes, geo, wants, terms in edges.xla_edge_cases(dtype):
      got = nh.call(source, stem + edges.SUFFIX[dtype], ops, shapes, geo)
      for g, (want, scale) in zip(got, wants):
        nh.assert_close(f"clang {kind}", g, want, scale, terms)
  assert str(_native.library("depthwise")._name).startswith(str(tmp_path / "native"))


# ------------------------------------------------------------------ sanitizers --


def test_sanitize_mode_builds_apart_with_its_flags(monkeypatch):
  gcc = _native.Compiler("/usr/bin/g++", "g++ 12.2.0")
  monkeypatch.delenv(_native.SANITIZE_ENV_VAR, raising=False)
  plain = _native.build_digest("depthwise", gcc)
  assert _native.flags() == _native.FLAGS and "-w" not in _native.FLAGS
  monkeypatch.setenv(_native.SANITIZE_ENV_VAR, "1")
  sanitized = _native.build_digest("depthwise", gcc)
  assert sanitized.endswith("-sanitize") and sanitized[:16] != plain
  assert "-fsanitize=address,undefined" in _native.flags()
  assert "-fno-sanitize-recover=undefined" in _native.flags()
  monkeypatch.setenv(_native.SANITIZE_ENV_VAR, "0")
  assert _native.build_digest("depthwise", gcc) == plain


def test_sanitize_mode_without_its_runtime_is_a_warning(tmp_path, monkeypatch, reset_native):
  """Loading an ASan library into a process without the runtime would abort it: not loaded."""
  if _native._sanitizer_runtime_loaded():
    pytest.skip("the sanitizer runtime is loaded in this process")
  monkeypatch.setenv(_native.SANITIZE_ENV_VAR, "1")
  monkeypatch.setenv(_native.DIR_ENV_VAR, str(tmp_path / "native"))

  def no_compile(*args, **kwargs):
    raise AssertionError("built although the library could not be loaded")

  monkeypatch.setattr(_native, "_compile", no_compile)
  with pytest.warns(UserWarning, match=r"TUNEDJAX_NATIVE_SANITIZE=1.*LD_PRELOAD"):
    assert _native.library("pointwise") is None
  assert not _native.available("pointwise")


def test_sanitizer_preload_names_the_runtime_and_libstdcxx():
  preload = _native.sanitizer_preload()
  if preload is None:
    pytest.skip("the compiler has no AddressSanitizer runtime")
  assert "asan" in pathlib.Path(preload[0]).name and all(os.path.isabs(p) for p in preload)
  assert any("libstdc++" in p for p in preload)


def test_sanitize_mode_loads_instrumented_libraries():
  """Under ``make test-native-sanitize``: every source from a ``-sanitize`` folder, with ASan."""
  if not _native.sanitize():
    pytest.skip("not a sanitizer run (make test-native-sanitize)")
  assert _native._sanitizer_runtime_loaded()
  for source in _native.sources():
    lib = _native.library(source)
    assert lib is not None, source
    path = pathlib.Path(lib._name)
    assert path.parent.name.endswith("-sanitize"), path
    assert b"__asan_report_store" in path.read_bytes(), f"{path} is not instrumented"


# ----------------------------------------------------- a deliberate bug is caught --


@pytest.mark.slow
def test_a_write_past_the_output_is_caught_by_the_guards(tmp_path, monkeypatch, reset_native):
  """A patched depthwise.cc writing one element past its output: the harness sees it."""
  stem = write_patched_depthwise(tmp_path / "csrc")
  monkeypatch.setitem(_native._SOURCES, stem, tmp_path / "csrc" / f"{stem}.cc")
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((1, 4, 5, 3), np.float32), rng.standard_normal((3, 3, 3), np.float32)
  with pytest.raises(AssertionError, match=r"wrote outside its output .* offsets \[1\]"):
    nh.call(stem, "TjDepthwiseConvF32", [x, w], [(1, 4, 5, 3)], nh.geometry(pad=(1, 1)))


OOB_SCRIPT = textwrap.dedent("""
    import pathlib, sys
    import jax, jax.numpy as jnp, numpy as np
    from tunedjax import _native
    _native.register_source(pathlib.Path(sys.argv[1]) / "depthwise_oob.cc")
    target = _native.ffi_target("depthwise_oob", "TjDepthwiseConvF32")
    assert target is not None, "the patched source did not build"
    attrs = dict(zip(("stride_h", "stride_w", "pad_h", "pad_w", "lhs_dil_h", "lhs_dil_w",
                      "rhs_dil_h", "rhs_dil_w"), map(np.int64, (1, 1, 1, 1, 1, 1, 1, 1))))
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((1, 4, 5, 3), jnp.float32))(
        jnp.ones((1, 4, 5, 3)), jnp.ones((3, 3, 3)), **attrs)
    print("finished without a report:", float(y.sum()))
""")


@pytest.mark.native_checks
@pytest.mark.slow
def test_asan_reports_a_write_past_an_xla_buffer(tmp_path):
  """The same patched source in sanitize mode, run by XLA: AddressSanitizer aborts with a report.

  In a fresh process that preloads the runtime as ``make test-native-sanitize``
  does (whether or not this one is a sanitizer run).
  """
  preload = _native.sanitizer_preload()
  if preload is None:
    pytest.skip("the compiler has no AddressSanitizer runtime")
  write_patched_depthwise(tmp_path / "csrc")
  env = dict(os.environ, LD_PRELOAD=" ".join(preload), TUNEDJAX_NATIVE_SANITIZE="1",
             TUNEDJAX_NATIVE_DIR=str(tmp_path / "native"), ASAN_OPTIONS="detect_leaks=0",
             UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", OOB_SCRIPT, str(tmp_path / "csrc")], env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  report = done.stderr
  assert done.returncode != 0, done.stdout + report[-3000:]
  assert "ERROR: AddressSanitizer: heap-buffer-overflow" in report, report[-3000:]
  assert "WRITE of size 4" in report and "depthwise_oob.cc" in report, report[-3000:]


# ------------------------------------------------------------------ no compiler --


def _net(params, x):
  """A depthwise, a batch norm, a 1x1 and a dense 3x3 conv: every native kernel's site."""
  from tunedjax.ops.batch_norm import batch_norm
  c = x.shape[-1]
  y = lax.conv_general_dilated(x, params["dw"], (1, 1), "SAME", dimension_numbers=NHWC,
                               feature_group_count=c)
  y = jax.nn.relu(batch_norm(y, params["scale"], params["bias"]))
  y = lax.conv_general_dilated(y, params["pw"], (1, 1), "VALID", dimension_numbers=NHWC)
  y = lax.conv_general_dilated(y, params["k3"], (1, 1), "SAME", dimension_numbers=NHWC)
  return jnp.mean(jnp.tanh(y) ** 2)


def _net_args(rng, c=8):
  params = {"dw": rng.normal(size=(3, 3, 1, c)), "scale": rng.uniform(0.5, 1.5, size=c),
            "bias": rng.normal(size=c), "pw": rng.normal(size=(1, 1, c, c)) / c ** 0.5,
            "k3": rng.normal(size=(3, 3, c, c)) / (3 * c ** 0.5)}
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  return params, jnp.asarray(rng.normal(size=(2, 6, 7, c)), jnp.float32)


def test_without_a_compiler_the_native_kernels_step_aside(tmp_path, monkeypatch, reset_native,
                                                          rng):
  """Not applicable, one warning per source (never repeated), the same results as plain JAX."""
  import tunedjax as tj
  from tunedjax.ops.batch_norm import _native_kernel as _bn_native
  from tunedjax.ops.conv import _native_depthwise as _conv_native
  from tunedjax.ops.conv import _native_1x1 as _conv_native_1x1
  from tunedjax.ops.conv import _native_direct as _conv_native_direct
  from tunedjax.ops.batch_norm._spec import BatchNormSpec
  from tunedjax.ops.conv._spec import ConvSpec
  monkeypatch.delenv(_native.NATIVE_CXX_ENV_VAR, raising=False)
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
  monkeypatch.setenv(_native.DIR_ENV_VAR, str(tmp_path / "native"))
  params, x = _net_args(rng)
  grad = jax.jit(jax.grad(_net))
  config = {"cache": {"dir": str(tmp_path / "cache")}, "layout": {"enable": False},
            "mixed_precision": {"enable": False}, "kernel": {"enable": True}}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with tj.config_context(config):
      f = tj.jit(jax.grad(_net))
      got = [f(params, x), f(params, x)]
      kernels = f.report(memory=False).last.kernels
      rewritten = str(f.jaxpr(params, x))
    dw = ConvSpec.from_arrays(x, params["dw"], padding="SAME", dimension_numbers=NHWC,
                              feature_group_count=x.shape[-1])
    pw = ConvSpec.from_arrays(x, params["pw"], dimension_numbers=NHWC)
    k3 = ConvSpec.from_arrays(x, params["k3"], padding="SAME", dimension_numbers=NHWC)
    assert not _conv_native.applicable(dw, "cpu")
    assert not _conv_native_1x1.applicable(pw, "cpu")
    assert not _conv_native_direct.applicable(k3, "cpu")
    assert not _bn_native.native_applicable(BatchNormSpec.from_arrays(x), "cpu")
  native = [str(w.message) for w in caught if "native kernels from" in str(w.message)]
  assert native and all("no C++ compiler found" in m for m in native), native
  assert len(native) == len(set(native)) <= len(_native.sources()), native  # once per source
  assert "tunedjax_" not in rewritten
  assert not any("native" in k for k in kernels), kernels
  want = grad(params, x)
  assert all(h.max_rel_err(g, want) < 1e-5 for g in got)
  assert not list((tmp_path / "native").glob("*/*.so"))  # nothing built
