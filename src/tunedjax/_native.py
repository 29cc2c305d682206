"""Native CPU kernels: C++ XLA FFI handlers, built on first use and cached per machine.

tunedjax ships a few kernels as C++ sources that XLA calls through its FFI,
for work XLA:CPU compiles poorly (a depthwise convolution's weight gradient, batch norm's statistics). They are built the
first time a kernel needs them, with the host's C++ compiler
(``$TUNEDJAX_NATIVE_CXX``, else ``$CXX``, else ``c++``, ``g++`` or
``clang++``) and ``-O3 -march=native``, into a folder of the machine's user
(``~/.cache/tunedjax/native/<digest>/``), apart from the tuning cache: a
fresh tuning cache (``$TUNEDJAX_CACHE_DIR``) re-tunes without rebuilding
C++. The digest covers the sources, the XLA FFI headers of the installed
jaxlib, the compiler's version and flags and the host CPU, so a shared folder
serves every machine of a cluster with a library of its own; a later process
loads the library in milliseconds. ``$TUNEDJAX_NATIVE_DIR`` puts the
libraries elsewhere. `build_all` (``tunedjax native build``) builds them
ahead, as part of an install, so that no training run pays for the build.

``TUNEDJAX_NATIVE_SANITIZE=1`` builds every source with AddressSanitizer and
UndefinedBehaviorSanitizer (`SANITIZE_FLAGS`) into folders of their own
(``<digest>-sanitize``), never mixed with the normal libraries. A process
can load those only with the sanitizer runtime preloaded (``LD_PRELOAD``);
without it the kernels are unavailable, with a warning that says so.
``make test-native-sanitize`` sets up that environment and runs the native
kernels' tests under it.

Native kernels are optional. With no compiler, a failed build or
``TUNEDJAX_NATIVE=0``, `ffi_target` returns None (the build failure warned
once per process) and the kernels that need them are not applicable, so the
tuner never considers them: nothing else changes. A library that will not
load (a truncated file) is warned about, removed and rebuilt once. Builds
write to a temporary file and rename it into place, so a build interrupted
mid-write or two processes building at once never leave a broken library
under the final name.

Each op family keeps its C++ sources in its own package (``ops/<family>/csrc``)
and names them here with `register_source`; the headers every source shares
(``tj_parallel.h``) are in ``tunedjax/csrc``.

Example:
  >>> target = ffi_target("depthwise", "TjDepthwiseConvF32")
  >>> target is None or target == "tunedjax_TjDepthwiseConvF32"
  True
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jaxlib

from tunedjax._errors import CacheWarning
from tunedjax._tuning import host_cpu, usable_folder

ENV_VAR = "TUNEDJAX_NATIVE"
"""Set to ``0`` (or ``off``, ``false``, ``no``) to never build or use native kernels."""

DIR_ENV_VAR = "TUNEDJAX_NATIVE_DIR"
"""Where built libraries go instead of `DEFAULT_DIR` (e.g. a folder shared by a cluster,
or the test suite's own)."""

DEFAULT_DIR = "~/.cache/tunedjax/native"
"""The digests' parent folder unless ``$TUNEDJAX_NATIVE_DIR`` says otherwise."""

CXX_ENV_VAR = "CXX"
NATIVE_CXX_ENV_VAR = "TUNEDJAX_NATIVE_CXX"
"""The compiler for the native kernels alone (a path or a name on PATH); before ``$CXX``."""

SANITIZE_ENV_VAR = "TUNEDJAX_NATIVE_SANITIZE"
"""Set to ``1`` (or ``on``, ``true``, ``yes``) to build with `SANITIZE_FLAGS` (tests)."""

COMPILERS = ("c++", "g++", "clang++")
# -Wno-psabi: on a CPU without AVX-512, GCC notes that a function returning a 16-float
# vector by value would pass it differently with AVX-512; every such function is internal
# to its source (an anonymous namespace), so no ABI boundary is crossed.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra",
         "-Wno-psabi")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                  "-fno-omit-frame-pointer", "-g1")
"""Added to `FLAGS` in sanitize mode: out-of-bounds accesses and undefined behaviour abort."""
BUILD_TIMEOUT_S = 300.0
HEADER_DIR = pathlib.Path(__file__).parent / "csrc"
"""The headers every native source may include (``#include "tj_parallel.h"``)."""
TARGET_PREFIX = "tunedjax_"

_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")
_LOCK = threading.RLock()
_SOURCES: dict[str, pathlib.Path] = {}
# Its own lock: build threads read sources while `library` holds `_LOCK`.
_SOURCES_LOCK = threading.Lock()
_LIBRARIES: dict[str, ctypes.CDLL | None] = {}
_REGISTERED: set[str] = set()
_WARNED: set[str] = set()
_PREBUILD_TRIED: set[str] = set()
_SUSPENDED = contextvars.ContextVar("tunedjax_native_suspended", default=False)


class NativeBuildError(RuntimeError):
  """A native library could not be built or loaded.

  Kernels catch it (the tuner leaves native kernels out); only `build_all`
  raises it, for ``tunedjax native build`` to report.
  """


class Built(NamedTuple):
  """What `build_all` did for one source."""

  source: str
  path: pathlib.Path
  """The library (it exists unless `error` is set)."""
  seconds: float
  """How long its compile took; 0.0 when it was built already."""
  error: str | None = None


class Compiler(NamedTuple):
  """The C++ compiler that builds the native libraries: its path and version line."""

  path: str
  version: str


def disabled() -> bool:
  """True when ``$TUNEDJAX_NATIVE`` turns native kernels off."""
  return os.environ.get(ENV_VAR, "").strip().lower() in _OFF


def sanitize() -> bool:
  """True when ``$TUNEDJAX_NATIVE_SANITIZE`` asks for sanitizer builds."""
  return os.environ.get(SANITIZE_ENV_VAR, "").strip().lower() in _ON


def flags() -> tuple[str, ...]:
  """The compiler flags of this process's builds: `FLAGS`, plus `SANITIZE_FLAGS` if `sanitize`."""
  return FLAGS + SANITIZE_FLAGS if sanitize() else FLAGS


def find_compiler() -> Compiler | None:
  """The compiler that builds the native libraries, or None.

  ``$TUNEDJAX_NATIVE_CXX``, else ``$CXX``, if set (even when it is not
  there: then None); else the first of `COMPILERS` found on PATH.
  """
  chosen = os.environ.get(NATIVE_CXX_ENV_VAR) or os.environ.get(CXX_ENV_VAR)
  candidates = (chosen,) if chosen else COMPILERS
  for name in candidates:
    path = shutil.which(name)
    if path is None:
      continue
    try:
      out = subprocess.run([path, "--version"], capture_output=True, text=True,
                           timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
      continue
    return Compiler(path, out.splitlines()[0] if out else "")
  return None


def register_source(path: os.PathLike | str) -> str:
  """Names a C++ source that native kernels are built from; returns its stem.

  An op family calls this for each file of its ``csrc`` folder when its kernel
  module is imported; `ffi_target`, `available` and `library` then take the
  stem. Stems are unique across families.

  Args:
    path: the ``.cc`` file.

  Returns:
    The file's stem (``"depthwise"`` for ``.../csrc/depthwise.cc``).

  Raises:
    ValueError: another file was registered under the same stem.

  Example:
    >>> register_source(HEADER_DIR.parent / "ops" / "conv" / "csrc" / "depthwise.cc")
    'depthwise'
  """
  path = pathlib.Path(path)
  with _SOURCES_LOCK:
    known = _SOURCES.setdefault(path.stem, path)
  if known != path:
    raise ValueError(f"native source {path.stem!r} is already registered as {known}; "
                     f"cannot register {path} under the same stem.")
  return path.stem


def source_path(source: str) -> pathlib.Path | None:
  """The registered file of stem `source`, or None."""
  with _SOURCES_LOCK:
    return _SOURCES.get(source)


def _headers() -> list[pathlib.Path]:
  return sorted(HEADER_DIR.glob("*.h"))


def source_bytes(source: str) -> bytes:
  """`source`'s ``.cc`` file and the shared headers, as one byte string (for hashes)."""
  parts = []
  cc = source_path(source)
  for path in [*([cc] if cc is not None else []), *_headers()]:
    if path.exists():
      parts += [path.name.encode(), b"\0", path.read_bytes(), b"\0"]
  return b"".join(parts)


def build_digest(source: str, compiler: Compiler) -> str:
  """What a built library depends on, hashed: sources, FFI headers, compiler, flags, CPU."""
  h = hashlib.sha256()
  h.update(source_bytes(source))
  ffi_header = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "ffi.h"
  if ffi_header.exists():
    h.update(ffi_header.read_bytes())
  cpu = host_cpu()
  for part in (compiler.version, " ".join(flags()), jaxlib.__version__, platform.machine(),
               cpu.model or "", ",".join(cpu.features)):
    h.update(b"\0" + part.encode())
  return h.hexdigest()[:16] + ("-sanitize" if sanitize() else "")


def build_root() -> pathlib.Path:
  """``$TUNEDJAX_NATIVE_DIR`` if set, else `DEFAULT_DIR`: the digests' parent folder.

  Not under the tuning cache folder: the libraries depend on the sources,
  compiler and CPU (the digest), never on what was tuned.
  """
  return pathlib.Path(os.environ.get(DIR_ENV_VAR) or DEFAULT_DIR).expanduser()


def _build_folder(digest: str) -> pathlib.Path:
  """``<build root>/<digest>``, or a per-user temporary folder if that is unusable."""
  folder = usable_folder(build_root() / digest,
                         what="native kernel folder",
                         consequence="native kernels are built in a temporary folder")
  if folder is None:
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    folder = pathlib.Path(tempfile.gettempdir()) / f"tunedjax-native-{uid}" / digest
    folder.mkdir(parents=True, exist_ok=True)
  return folder


def _compile(source: str, compiler: Compiler, target: pathlib.Path) -> None:
  """Compiles `source`'s ``.cc`` into `target`, atomically (a temporary name, then a rename)."""
  fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source}-", suffix=".so")
  os.close(fd)
  # XLA's headers as system headers: -Wall -Wextra then speak of tunedjax's code only.
  command = [compiler.path, *flags(), "-isystem", jax.ffi.include_dir(), f"-I{HEADER_DIR}",
             str(source_path(source)), "-o", tmp]
  try:
    returncode, stderr = _run_in_own_group(command, BUILD_TIMEOUT_S)
    if returncode != 0:
      raise NativeBuildError(f"{' '.join(command)} failed:\n{stderr.strip()[-2000:]}")
    os.replace(tmp, target)
  except subprocess.TimeoutExpired as err:
    raise NativeBuildError(f"building {source}.cc took over {BUILD_TIMEOUT_S:.0f} s") from err
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _run_in_own_group(command: list[str], timeout: float) -> tuple[int, str]:
  """Runs `command` in a process group of its own; its return code and standard error.

  A compiler driver (``c++``) starts the compiler proper (``cc1plus``) as a
  child: killing the driver alone on a time-out would leave that child
  compiling, an orphan. On a time-out the whole group is killed, then
  `subprocess.TimeoutExpired` is raised.
  """
  with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
    try:
      _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
      raise
  return proc.returncode, stderr


def _print_file_name(compiler: Compiler, name: str) -> str | None:
  """The compiler's full path of library `name` (``-print-file-name``), or None if it has none."""
  try:
    out = subprocess.run([compiler.path, f"-print-file-name={name}"], capture_output=True,
                         text=True, timeout=30, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return out if os.path.isabs(out) and os.path.exists(out) else None


def sanitizer_preload(compiler: Compiler | None = None) -> list[str] | None:
  """What ``LD_PRELOAD`` must hold for a Python process to load sanitize-mode libraries.

  The compiler's AddressSanitizer runtime (GCC's ``libasan.so``, clang's
  ``libclang_rt.asan-<arch>.so``, which carries UBSan's handlers too), and
  ``libstdc++.so``: Python does not link libstdc++, so without it the
  runtime's ``__cxa_throw`` interceptor finds no function to forward to and
  aborts the first time jaxlib throws a C++ exception ("CHECK failed:
  asan_interceptors.cpp ... real___cxa_throw").

  Args:
    compiler: the compiler the libraries are built with; `find_compiler`'s if None.

  Returns:
    The libraries' full paths, or None when the compiler has no ASan runtime.
  """
  compiler = compiler or find_compiler()
  if compiler is None:
    return None
  runtime = (f"libclang_rt.asan-{platform.machine()}.so" if "clang" in compiler.version
             else "libasan.so")
  paths = [_print_file_name(compiler, runtime), _print_file_name(compiler, "libstdc++.so")]
  return None if paths[0] is None else [p for p in paths if p]


def _sanitizer_runtime_loaded() -> bool:
  """Whether AddressSanitizer's runtime is in the process (preloaded: ``LD_PRELOAD``)."""
  return hasattr(ctypes.pythonapi, "__asan_init")  # the process's global symbols


def _check_sanitizer_runtime() -> None:
  """In sanitize mode, raises unless the runtime is loaded (loading without it aborts)."""
  if sanitize() and not _sanitizer_runtime_loaded():
    raise NativeBuildError(
        f"${SANITIZE_ENV_VAR}={os.environ.get(SANITIZE_ENV_VAR)} builds with AddressSanitizer, "
        "whose runtime must be loaded first: run with LD_PRELOAD=\"$(python -c 'from tunedjax "
        "import _native; print(*_native.sanitizer_preload())')\" (`make "
        "test-native-sanitize` does), or unset it")


def _require_compiler() -> Compiler:
  """`find_compiler`'s compiler; raises `NativeBuildError` naming what was looked for."""
  compiler = find_compiler()
  if compiler is None:
    wanted = (os.environ.get(NATIVE_CXX_ENV_VAR) or os.environ.get(CXX_ENV_VAR)
              or " / ".join(COMPILERS))
    raise NativeBuildError(f"no C++ compiler found (looked for {wanted}; set "
                           f"${NATIVE_CXX_ENV_VAR} or ${CXX_ENV_VAR})")
  return compiler


def _load(source: str) -> ctypes.CDLL:
  """Builds (unless cached) and loads the library of `source`."""
  path = source_path(source)
  if path is None or not path.exists():
    raise NativeBuildError(f"no native source {source!r}; available: {sources()}")
  compiler = _require_compiler()
  _check_sanitizer_runtime()
  target = _build_folder(build_digest(source, compiler)) / f"{source}.so"
  if not target.exists():
    _compile(source, compiler, target)
  try:
    return ctypes.CDLL(str(target))
  except OSError as err:  # a truncated or foreign file under the final name: rebuild once
    _warn_once(f"load:{target}", f"tunedjax: the native library {target} did not load "
               f"({err}); rebuilding it.", CacheWarning)
    target.unlink(missing_ok=True)
    _compile(source, compiler, target)
    return ctypes.CDLL(str(target))


def _warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
  if key not in _WARNED:
    _WARNED.add(key)
    warnings.warn(message, category, stacklevel=3)


def _compile_side_by_side(compiler: Compiler,
                          jobs: dict[str, pathlib.Path]) -> dict[str, float | Exception]:
  """Compiles each source of `jobs` into its target, all at once; seconds or error per source.

  A compile is a subprocess, so building them together costs about the
  time of the slowest rather than the sum.
  """
  outcomes: dict[str, float | Exception] = {}

  def build(name: str) -> None:
    start = time.perf_counter()
    try:
      _compile(name, compiler, jobs[name])
      outcomes[name] = time.perf_counter() - start
    except (NativeBuildError, OSError) as err:
      outcomes[name] = err

  threads = [threading.Thread(target=build, args=(name,), daemon=True) for name in jobs]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return outcomes


def _build_missing(requested: str) -> dict[str, Exception]:
  """Compiles `requested` and every other shipped source not built yet, side by side.

  A model that needs one native kernel usually needs the others too (on a
  new machine's first run). Each other source is tried here once per
  process; a failure is returned, and raised only when that source is
  requested.
  """
  compiler = find_compiler()
  if compiler is None or (sanitize() and not _sanitizer_runtime_loaded()):
    return {}  # `_load` says so
  jobs = {}
  for name in sources():
    if name in _LIBRARIES or (name != requested and name in _PREBUILD_TRIED):
      continue
    _PREBUILD_TRIED.add(name)
    target = _build_folder(build_digest(name, compiler)) / f"{name}.so"
    if not target.exists():
      jobs[name] = target
  outcomes = _compile_side_by_side(compiler, jobs)
  return {name: err for name, err in outcomes.items() if isinstance(err, Exception)}


def build_all() -> list[Built]:
  """Builds every registered source not built yet for this machine, side by side.

  What ``tunedjax native build`` runs, and ``make``'s install step: a
  machine whose libraries are built ahead starts its first training run with
  them, instead of paying for the build there (several seconds on 2 cores).
  Loads nothing into this process.

  Returns:
    One `Built` per source, in `sources` order; a failed compile has its
    `Built.error` set (the compiler's message).

  Raises:
    NativeBuildError: native kernels are off (``$TUNEDJAX_NATIVE``), no
      compiler was found, or sanitize mode lacks its runtime.

  Example:
    >>> [built.source for built in build_all()] == sources()  # doctest: +SKIP
    True
  """
  if disabled():
    raise NativeBuildError(f"native kernels are off (${ENV_VAR}="
                           f"{os.environ.get(ENV_VAR)}); unset it to build them")
  compiler = _require_compiler()
  _check_sanitizer_runtime()
  with _LOCK:
    targets = {name: _build_folder(build_digest(name, compiler)) / f"{name}.so"
               for name in sources()}
    outcomes = _compile_side_by_side(
        compiler, {name: t for name, t in targets.items() if not t.exists()})
  report = []
  for name, target in targets.items():
    outcome = outcomes.get(name, 0.0)  # absent: built already
    if isinstance(outcome, Exception):
      report.append(Built(name, target, 0.0, str(outcome)))
    else:
      report.append(Built(name, target, outcome))
  return report


def library(source: str) -> ctypes.CDLL | None:
  """The loaded library of `source`'s ``.cc`` file, built if needed; None if native kernels are off.

  A failed build is warned about once and remembered for the process.
  """
  if disabled():
    return None
  with _LOCK:
    if source not in _LIBRARIES:
      errors = _build_missing(source) if source in sources() else {}
      try:
        if source in errors:
          raise errors[source]
        _LIBRARIES[source] = _load(source)
      except (NativeBuildError, OSError) as err:
        _warn_once(f"build:{source}", f"tunedjax: native kernels from {source}.cc are "
                   f"unavailable, so the tuner leaves them out: {err}")
        _LIBRARIES[source] = None
    return _LIBRARIES[source]


def ffi_target(source: str, symbol: str) -> str | None:
  """Registers handler `symbol` of `source`'s ``.cc`` file as a CPU FFI target; returns its name.

  Args:
    source: the C++ file's stem, as `register_source` returned it.
    symbol: the handler's exported name (``XLA_FFI_DEFINE_HANDLER_SYMBOL``).

  Returns:
    The target name for `jax.ffi.ffi_call` (``"tunedjax_" + symbol``), or
    None when native kernels are unavailable (see the module docstring).
  """
  lib = library(source)
  if lib is None:
    return None
  name = TARGET_PREFIX + symbol
  with _LOCK:
    if name not in _REGISTERED:
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
      _REGISTERED.add(name)
  return name


@functools.cache
def _builds(source: str) -> bool:
  return library(source) is not None


def available(source: str) -> bool:
  """Whether `source`'s ``.cc`` file's kernels can run here: built and loaded, and not `suspended`.

  The build's outcome is cached per process.
  """
  return not _SUSPENDED.get() and _builds(source)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
  """Within it, no native kernel is available: for programs that must run without tunedjax.

  `tunedjax.jit`'s ``export`` traces under it, so an exported program never
  calls a native kernel (which only a process that built and registered it
  could run). It is part of `tj.jit`'s trace key, so the program traced
  inside is a separate one.

  Example:
    >>> with suspended():
    ...   available("depthwise"), is_suspended()
    (False, True)
  """
  token = _SUSPENDED.set(True)
  try:
    yield
  finally:
    _SUSPENDED.reset(token)


def is_suspended() -> bool:
  """True inside `suspended`."""
  return _SUSPENDED.get()


def sources() -> list[str]:
  """The registered native sources' stems (the op families imported so far name theirs)."""
  with _SOURCES_LOCK:
    return sorted(_SOURCES)


def status() -> dict[str, object]:
  """What `tunedjax info` shows: on or off, the compiler, and which sources are built here.

  Builds nothing: a source counts as built when its library for this
  machine's digest is in the cache folder.

  Example:
    >>> sorted(status())
    ['built', 'compiler', 'enabled', 'folder', 'sources']
  """
  compiler = None if disabled() else find_compiler()
  built: list[str] = []
  folder = None
  if compiler is not None:
    base = build_root()
    folder = str(base)
    built = [s for s in sources()
             if (base / build_digest(s, compiler) / f"{s}.so").exists()]
  return {"enabled": not disabled(), "compiler": compiler.version if compiler else None,
          "folder": folder, "sources": sources(), "built": built}


def reset() -> None:
  """Forgets loaded libraries and warnings (tests); registered FFI targets stay registered."""
  with _LOCK:
    _LIBRARIES.clear()
    _WARNED.clear()
    _PREBUILD_TRIED.clear()
  _builds.cache_clear()
