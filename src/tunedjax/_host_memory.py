"""Host memory: opt in, and a CPU step reuses the last step's memory instead of faulting it in.

XLA:CPU allocates each execution's temporary buffer as one block (73 MiB for the
MobileNet-style train step of ``benchmarks/kernels.py``) with ``posix_memalign``
on one of its worker threads, and frees it when the execution ends. glibc's
``malloc`` serves a block that large with a fresh ``mmap``: a thread's arena
cannot hold more than 64 MiB, and the main arena maps anything over its
threshold (at most 32 MiB). ``free`` unmaps it, so the next step faults every
page in and the kernel zeroes it again: about 18,000 minor page faults and
30 ms of system time per step there, a step that takes 28 ms without them.

With ``TUNEDJAX_HOST_MEMORY=retain`` in the environment, ``import tunedjax``
asks glibc (``mallopt``) to serve every thread from the main arena
(``M_ARENA_MAX=1``), never to map a block on its own (``M_MMAP_MAX=0``) and to
keep up to 2 GiB free at the top of the heap (``M_TRIM_THRESHOLD``), so one
step's temporaries are the next step's, as a caching allocator would have them.
It is opt-in because it has two costs. Resident memory: what the process once
used stays mapped until `release_host_memory` (or the process ends). And
dispatch: with one arena, JAX's Python thread and XLA's threads take the same
lock, so a tiny jitted call dispatched asynchronously went from about 20 to
37-52 us on 2 cores. Importing a library should not slow unrelated JAX code
that much, so by default (``default``) nothing is changed. PyTorch runs in the
same process are served by the same allocator.

With ``retain`` it is still left alone (and `host_memory_status` says why)
where it cannot help or someone chose otherwise:

* the C library is not glibc (macOS, musl);
* the environment already tunes the allocator (``MALLOC_ARENA_MAX``,
  ``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TOP_PAD_``, ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``, or
  jemalloc, tcmalloc or mimalloc in ``LD_PRELOAD``);
* JAX's backends were started before tunedjax was imported. XLA's worker
  threads then already hold their own arenas, so the settings would not reach
  them. On a CPU backend this gives a `HostMemoryWarning` that says to import
  tunedjax first (or to set the environment variables before Python starts).

This module imports neither JAX nor NumPy: ``import tunedjax`` stays cheap.

Example:
  >>> import tunedjax as tj
  >>> tj.host_memory_status().mode in ("retain", "default")
  True
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys
import threading
import warnings

from tunedjax._errors import HostMemoryWarning, format_choices

ENV_VAR = "TUNEDJAX_HOST_MEMORY"
"""``retain`` (opt in: set malloc up for large CPU steps) or ``default`` (the default: leave
the C library's allocator as it is)."""

MODES = ("retain", "default")

# glibc's mallopt parameters (malloc.h) and the values tunedjax sets.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
SETTINGS = {"M_ARENA_MAX": 1, "M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**31 - 1}
_PARAMS = {"M_ARENA_MAX": _M_ARENA_MAX, "M_MMAP_MAX": _M_MMAP_MAX,
           "M_TRIM_THRESHOLD": _M_TRIM_THRESHOLD}

# Environment variables through which a user (or a launcher) already tuned malloc.
_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

ENVIRONMENT_HINT = ("MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 "
                    "MALLOC_TRIM_THRESHOLD_=2147483647")
"""The same settings as environment variables, for a launcher to set before Python starts."""


@dataclasses.dataclass(frozen=True)
class HostMemoryStatus:
  """What tunedjax did to the host allocator at import, and why.

  Attributes:
    mode: ``"retain"`` or ``"default"`` (from ``$TUNEDJAX_HOST_MEMORY``).
    applied: True when tunedjax set `SETTINGS` with ``mallopt``.
    reason: one sentence: what was done, or why nothing was.
    settings: the ``mallopt`` parameters set (empty when not applied).
  """

  mode: str
  applied: bool
  reason: str
  settings: dict[str, int] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, object]:
    """A JSON-able dict (for ``tunedjax info --json``)."""
    return dataclasses.asdict(self)


_LOCK = threading.Lock()
_STATUS: HostMemoryStatus | None = None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
  """The process's C library if it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``).

  Looked up among the symbols already loaded (``dlopen(NULL)``), not with
  `ctypes.util.find_library`, which runs ``ldconfig`` in a subprocess.
  """
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(None)
  except OSError:
    return None
  if not all(hasattr(libc, f) for f in ("mallopt", "gnu_get_libc_version", "malloc_trim")):
    return None
  libc.gnu_get_libc_version.restype = ctypes.c_char_p
  libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  libc.malloc_trim.argtypes = (ctypes.c_size_t,)
  return libc


def _environment_tunes_malloc() -> str | None:
  """The environment variable through which malloc is already tuned, if any."""
  for name in _MALLOC_ENV:
    if name in os.environ:
      return name
  if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
    return "GLIBC_TUNABLES"
  preload = os.environ.get("LD_PRELOAD", "")
  if any(a in preload for a in _PRELOADED_ALLOCATORS):
    return "LD_PRELOAD"
  return None


def _jax_default_backend_if_started() -> str | None:
  """The default backend's platform if JAX has started its backends, else None.

  Reads the already-imported module's state; never imports JAX (nor starts a backend).
  """
  bridge = sys.modules.get("jax._src.xla_bridge")
  started = getattr(bridge, "backends_are_initialized", None)
  if started is None or not started():
    return None
  try:
    return sys.modules["jax"].default_backend()
  except (KeyError, RuntimeError):  # jax half-imported, or its backends failed
    return "unknown"


def _mode() -> tuple[str, str | None]:
  """(mode, complaint): the mode from ``$TUNEDJAX_HOST_MEMORY`` and, if its value
  is not a valid one, a message that names it and the valid values."""
  raw = os.environ.get(ENV_VAR)
  if raw is None or not raw.strip():
    return "default", None
  value = raw.strip().lower()
  if value in MODES:
    return value, None
  return "default", (f"${ENV_VAR}={raw!r} is not a valid value; valid values: "
                     f"{format_choices(MODES)}. The allocator is left as it is.")


def configure() -> HostMemoryStatus:
  """Applies the host-memory settings if asked (``retain``) and they can help; returns what
  was done.

  `tunedjax`'s import calls this once; later calls return the first status.

  Returns:
    The `HostMemoryStatus`.
  """
  global _STATUS
  with _LOCK:
    if _STATUS is None:
      _STATUS = _decide_and_apply()
    return _STATUS


def _decide_and_apply() -> HostMemoryStatus:
  mode, complaint = _mode()
  if complaint:
    warnings.warn(complaint, HostMemoryWarning, stacklevel=4)
    return HostMemoryStatus(mode, False, complaint)
  if mode == "default":
    return HostMemoryStatus(mode, False, f"${ENV_VAR} is not 'retain': the allocator is left "
                            "as it is (opt in for large CPU steps: README, 'Host memory')")
  libc = _glibc()
  if libc is None:
    return HostMemoryStatus(mode, False, "the C library is not glibc (nothing to set)")
  tuned_by = _environment_tunes_malloc()
  if tuned_by:
    return HostMemoryStatus(mode, False, f"the environment already tunes malloc (${tuned_by})")
  backend = _jax_default_backend_if_started()
  if backend is not None:
    reason = (f"JAX's backends (default: {backend}) started before tunedjax was imported, so "
              "XLA's threads already hold their own malloc arenas")
    if backend == "cpu":
      warnings.warn(
          f"tunedjax: {reason}. Each CPU step may map and fault in its temporary buffer "
          "again (tens of ms per step for a CNN). Import tunedjax before running JAX "
          f"code, or start Python with {ENVIRONMENT_HINT}. "
          f"Unset ${ENV_VAR} to silence this.", HostMemoryWarning, stacklevel=4)
    return HostMemoryStatus(mode, False, reason)
  for name, value in SETTINGS.items():
    if libc.mallopt(_PARAMS[name], value) != 1:
      return HostMemoryStatus(mode, False, f"glibc refused mallopt({name}, {value})")
  glibc = (libc.gnu_get_libc_version() or b"?").decode()
  return HostMemoryStatus(mode, True, f"set with mallopt (glibc {glibc}) at import",
                          dict(SETTINGS))


def host_memory_status() -> HostMemoryStatus:
  """What tunedjax did to the host allocator when it was imported, and why.

  Returns:
    A `HostMemoryStatus` (``tunedjax info`` shows it too).

  Example:
    >>> import tunedjax as tj
    >>> status = tj.host_memory_status()
    >>> status.applied == bool(status.settings)
    True
  """
  return configure()


def release_host_memory() -> bool:
  """Returns the heap's free memory to the operating system (glibc's ``malloc_trim``).

  With the host-memory settings applied (``TUNEDJAX_HOST_MEMORY=retain``),
  memory the process freed stays mapped for reuse; call this after a phase that used much more than training does
  (loading a large dataset into memory, say) to shrink the resident size.

  Returns:
    True if some memory was returned (always False without glibc).

  Example:
    >>> import tunedjax as tj
    >>> tj.release_host_memory() in (True, False)
    True
  """
  libc = _glibc()
  return bool(libc.malloc_trim(0)) if libc is not None else False


def minor_page_faults() -> int:
  """The process's minor page faults so far (``getrusage``), 0 where unavailable."""
  try:
    import resource  # pylint: disable=import-outside-toplevel
  except ImportError:  # not on this platform
    return 0
  return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
