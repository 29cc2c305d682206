"""Host memory: a CPU step reuses the last step's memory instead of faulting it in, where that pays.

XLA:CPU allocates each execution's temporary buffer as one block (73 MiB for the
MobileNet-style train step of ``benchmarks/kernels.py``) with ``posix_memalign``
on one of its worker threads, and frees it when the execution ends. glibc's
``malloc`` serves a block that large with a fresh ``mmap``: a thread's arena
cannot hold more than 64 MiB, and the main arena maps anything over its
threshold (at most 32 MiB). ``free`` unmaps it, so the next step faults every
page in and the kernel zeroes it again: about 18,000 minor page faults and
30 ms of system time per step there, a step that takes 28 ms without them.

The settings (`SETTINGS`, set with ``mallopt`` before JAX starts its threads)
serve every thread from the main arena (``M_ARENA_MAX=1``), never map a block
on its own (``M_MMAP_MAX=0``) and keep up to 2 GiB free at the top of the heap
(``M_TRIM_THRESHOLD``), so one step's temporaries are the next step's. They
cost where a program makes many tiny calls: with one arena, JAX's Python
thread and XLA's threads take the same lock, and a tiny jitted call
dispatched asynchronously went from about 20 to 37-52 us on 2 cores. No
cheaper setting removes the faults (``benchmarks/malloc_settings.py``).

So tunedjax decides per machine and workload, by measurement
(``$TUNEDJAX_HOST_MEMORY``, `MODES`):

* ``auto`` (the default): `tunedjax.jit` measures the page faults and system
  time per call of each CPU program over its calls 4 to 131 (`CallProbe`).
  Where one faults at least 16 MiB per call and spends at least a tenth of
  its time doing so, that is recorded (`_decisions`) and the settings are applied
  from the next ``import tunedjax`` of the same workload on. The process
  that measured gets what can act mid-process (`RETENTION`) at once: its
  import had XLA:CPU allocate temporaries in blocks of at most 48 MiB
  (`_xla`: ``$XLA_FLAGS``), which the arenas of XLA's threads keep once
  mapping and trimming are off and the top pad is large. Where tunedjax
  starts the work itself before JAX's backend starts (the ``tunedjax demo``
  command, a `Trainer` created first), they are applied at once
  (`apply_for_training`: `RETENTION` where XLA's temporaries are split, all
  of `SETTINGS` where not).
* ``retain``: always (as a launcher's ``MALLOC_*`` variables would).
* ``default``: never, and nothing is measured.

Either way malloc is left alone (and `host_memory_status` says why) where the
C library is not glibc, where the environment already tunes the allocator
(``MALLOC_*`` variables, ``glibc.malloc`` tunables, a preloaded jemalloc,
tcmalloc or mimalloc), or where JAX's backends started before tunedjax was
imported (XLA's threads already hold their own arenas; on a CPU backend with
the settings wanted, a `HostMemoryWarning` says to import tunedjax first).
What the process once used stays mapped until `release_host_memory`.

This package imports neither JAX nor NumPy: ``import tunedjax`` stays cheap.

Example:
  >>> import tunedjax as tj
  >>> tj.host_memory_status().mode in ("auto", "retain", "default")
  True
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import os
import pathlib
import resource
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from tunedjax._errors import HostMemoryWarning, format_choices
from tunedjax._host_memory import _decisions, _xla

ENV_VAR = "TUNEDJAX_HOST_MEMORY"
"""``auto`` (the default: decided by measurement), ``retain`` (always set malloc up for
large CPU steps) or ``default`` (never: leave the C library's allocator as it is)."""

MODES = ("auto", "retain", "default")

# glibc's mallopt parameters (malloc.h) and the values tunedjax sets.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_M_TOP_PAD = -2
SETTINGS = {"M_ARENA_MAX": 1, "M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**31 - 1}
# What can be set mid-process, where a measurement shows that the settings pay (an arena
# limit cannot: each thread keeps the arena it drew at its first malloc). A thread arena
# cannot hold a block over 64 MiB, so `_xla` has XLA:CPU split its temporaries; the top
# pad keeps a thread arena from unmapping a heap it emptied (glibc's heap_trim).
RETENTION = {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**31 - 1, "M_TOP_PAD": 64 * 2**20}
_PARAMS = {"M_ARENA_MAX": _M_ARENA_MAX, "M_MMAP_MAX": _M_MMAP_MAX,
           "M_TRIM_THRESHOLD": _M_TRIM_THRESHOLD, "M_TOP_PAD": _M_TOP_PAD}
# The in-process settings keep one copy of a program's temporaries per XLA thread that ran
# it: they are set only where that fits in this share of the machine's memory.
_RETENTION_MEMORY_SHARE = 0.25

# Environment variables through which a user (or a launcher) already tuned malloc.
_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

ENVIRONMENT_HINT = ("MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 "
                    "MALLOC_TRIM_THRESHOLD_=2147483647")
"""The same settings as environment variables, for a launcher to set before Python starts."""


@dataclasses.dataclass(frozen=True)
class HostMemoryStatus:
  """What tunedjax did to the host allocator, and why.

  Attributes:
    mode: ``"auto"``, ``"retain"`` or ``"default"`` (from ``$TUNEDJAX_HOST_MEMORY``).
    applied: True when tunedjax set `SETTINGS` with ``mallopt``.
    reason: one sentence: what was done, or why nothing was.
    settings: the ``mallopt`` parameters set (empty when not applied).
    workload: what this process runs, as its decision is keyed (``auto`` only).
    decision: the measurement the decision rests on (a record of the
      decisions file: ``pays``, ``faults_per_call``, ``system_ms_per_call``,
      ``call_ms``, ``program``, ``measured_at``), or None.
  """

  mode: str
  applied: bool
  reason: str
  settings: dict[str, int] = dataclasses.field(default_factory=dict)
  workload: str | None = None
  decision: dict[str, Any] | None = None

  def to_dict(self) -> dict[str, object]:
    """A JSON-able dict (for ``tunedjax info --json``)."""
    return dataclasses.asdict(self)


_LOCK = threading.RLock()
_STATUS: HostMemoryStatus | None = None
_FOLDER: pathlib.Path | None = None  # the decisions folder as seen at import
_MEASURING = False  # auto mode, not applied: tunedjax.jit's CPU programs are measured
# Applied by a decision: measured until one program is large enough to confirm it
# (else the decision is withdrawn at exit, and the workload measured again next time).
_CONFIRMING = False
CONFIRM_S = 0.002  # a call this long (with the settings) confirms the decision
_MEASURED: list[dict[str, Any]] = []  # this process's measurements (for `tunedjax info`)
# Why XLA:CPU's temporaries are not in blocks a thread arena keeps (None: they are).
_UNSPLIT: str | None = "not asked for"


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
    return "auto", None
  value = raw.strip().lower()
  if value in MODES:
    return value, None
  return "default", (f"${ENV_VAR}={raw!r} is not a valid value; valid values: "
                     f"{format_choices(MODES)}. The allocator is left as it is.")


def decisions_folder() -> pathlib.Path:
  """The folder of the decisions file: the tuning cache's, as configured at import
  (``$TUNEDJAX_CONFIG``'s ``cache.dir``, else ``$TUNEDJAX_CACHE_DIR``, else
  ``~/.cache/tunedjax``)."""
  if _FOLDER is not None:
    return _FOLDER
  if not os.environ.get("TUNEDJAX_CONFIG"):  # at import nothing else can have chosen one
    return pathlib.Path(os.environ.get("TUNEDJAX_CACHE_DIR") or "~/.cache/tunedjax").expanduser()
  try:
    from tunedjax._config import get_config  # pylint: disable=import-outside-toplevel
    return get_config().cache.resolved_dir
  except Exception:  # pylint: disable=broad-except  # a bad $TUNEDJAX_CONFIG: its users say so
    chosen = os.environ.get("TUNEDJAX_CACHE_DIR") or "~/.cache/tunedjax"
    return pathlib.Path(chosen).expanduser()


def configure() -> HostMemoryStatus:
  """Applies the host-memory settings where asked or decided and they can help;
  returns what was done.

  `tunedjax`'s import calls this once; later calls return the first status
  (or the one `apply_for_training` or a recorded measurement left).

  Returns:
    The `HostMemoryStatus`.
  """
  global _STATUS, _FOLDER
  with _LOCK:
    if _STATUS is None:
      _FOLDER = decisions_folder()
      _STATUS = _decide_and_apply()
    return _STATUS


def _mallopt(libc: ctypes.CDLL, settings: dict[str, int] = SETTINGS) -> str | None:
  """Sets `settings` (`SETTINGS` or `RETENTION`); the refusal, if glibc refused one."""
  for name, value in settings.items():
    if libc.mallopt(_PARAMS[name], value) != 1:
      return f"glibc refused mallopt({name}, {value})"
  return None


def _blocked(mode: str) -> HostMemoryStatus | None:
  """Why the settings cannot be set in this process at all, as a status, or None."""
  if _glibc() is None:
    return HostMemoryStatus(mode, False, "the C library is not glibc (nothing to set)")
  tuned_by = _environment_tunes_malloc()
  if tuned_by:
    return HostMemoryStatus(mode, False, f"the environment already tunes malloc (${tuned_by})")
  return None


def _confirm_later() -> None:
  global _CONFIRMING
  _CONFIRMING = True
  atexit.register(_withdraw_if_unconfirmed)


def _withdraw_if_unconfirmed() -> bool:
  """At exit of a process that applied a decision: where tunedjax.jit measured programs
  but none was large enough to confirm it, the decision is withdrawn (the workload may
  have changed; the next process measures again). True if withdrawn."""
  with _LOCK:
    if not (_CONFIRMING and _MEASURED and _STATUS is not None and _STATUS.workload):
      return False
    return _decisions.forget(decisions_folder(), _STATUS.workload)


def _decide_and_apply() -> HostMemoryStatus:
  global _MEASURING, _UNSPLIT
  mode, complaint = _mode()
  if complaint:
    warnings.warn(complaint, HostMemoryWarning, stacklevel=4)
    return HostMemoryStatus(mode, False, complaint)
  if mode == "default":
    return HostMemoryStatus(mode, False, f"${ENV_VAR}=default: the allocator is left as it "
                            "is and nothing is measured")
  blocked = _blocked(mode)
  if blocked is not None:
    return blocked
  workload, decision = None, None
  backend = _jax_default_backend_if_started()
  if mode == "auto":
    _UNSPLIT = _xla.split_heaps(backend is not None)  # in every process of the workload
    workload = _decisions.workload()
    decision = _decisions.lookup(_FOLDER, workload)
    if decision is None or not decision["pays"]:
      _MEASURING = True
      return HostMemoryStatus(mode, False, _undecided(), workload=workload, decision=decision)
  if backend is not None:
    return _too_late(mode, backend, workload, decision)
  refused = _mallopt(_glibc())
  if refused:
    return HostMemoryStatus(mode, False, refused, workload=workload, decision=decision)
  if decision is not None:
    _confirm_later()
  glibc = (_glibc().gnu_get_libc_version() or b"?").decode()
  reason = (f"set with mallopt (glibc {glibc}) at import" if decision is None else
            f"set with mallopt (glibc {glibc}) at import: {_describe(decision)}")
  return HostMemoryStatus(mode, True, reason, dict(SETTINGS), workload, decision)


def _undecided() -> str:
  head = ("not set: no measurement of this workload on this machine has shown that they pay "
          "yet; tunedjax.jit measures the page faults of its CPU programs' calls 4 to 131")
  if _UNSPLIT is None:
    return (f"{head}. XLA:CPU allocates temporaries in blocks of at most "
            f"{_xla.HEAP_BYTES // 2**20} MiB ({_xla.HEAP_FLAG} in $XLA_FLAGS), so where one "
            f"pays, {', '.join(RETENTION)} are set in this process at once (one arena from the "
            "next import)")
  return f"{head}, and where one pays they apply from the next import ({_UNSPLIT})"


def _describe(decision: dict[str, Any]) -> str:
  verdict = "they pay" if decision["pays"] else "they do not pay"
  return (f"{verdict} for this workload, measured {decision['measured_at']}: "
          f"{decision['program']} faulted {decision['faults_per_call']:,.0f} pages and spent "
          f"{decision['system_ms_per_call']:.1f} ms in the kernel per call of "
          f"{decision['call_ms']:.1f} ms without them")


def _too_late(mode: str, backend: str, workload: str | None,
              decision: dict[str, Any] | None) -> HostMemoryStatus:
  reason = (f"JAX's backends (default: {backend}) started before tunedjax was imported, so "
            "XLA's threads already hold their own malloc arenas")
  if backend == "cpu":
    why = (f"${ENV_VAR}=retain asks for them" if decision is None else
           f"they pay for this workload (measured {decision['measured_at']})")
    warnings.warn(
        f"tunedjax: {reason}, so its host-memory settings could not be set, though {why}. "
        "Each CPU step may map and fault in its temporary buffer again (tens of ms per step "
        f"for a CNN). Import tunedjax before running JAX code, or start Python with "
        f"{ENVIRONMENT_HINT}. Set ${ENV_VAR}=default to silence this.",
        HostMemoryWarning, stacklevel=5)
  return HostMemoryStatus(mode, False, reason, workload=workload, decision=decision)


def host_memory_status() -> HostMemoryStatus:
  """What tunedjax did to the host allocator, and why.

  Returns:
    A `HostMemoryStatus` (``tunedjax info`` shows it too).

  Example:
    >>> import tunedjax as tj
    >>> status = tj.host_memory_status()
    >>> status.applied == bool(status.settings)
    True
  """
  return configure()


def _likely_cpu_only() -> bool:
  """Whether JAX will run on the CPU only (`_xla.likely_cpu_only`; read without JAX)."""
  return _xla.likely_cpu_only()


def apply_for_training(who: str) -> HostMemoryStatus:
  """Applies the settings now, in ``auto`` mode, for CPU training that tunedjax starts itself.

  Called where tunedjax is about to train (``tunedjax demo``, a `Trainer`
  being created). It acts only before JAX's backend has started and where JAX
  will run on the CPU only; otherwise (and in the other modes) it changes
  nothing. Where XLA:CPU's temporaries come in blocks a thread arena keeps
  (`_xla`), it sets `RETENTION` and leaves the arenas as they are: one arena
  serialises the threads XLA compiles with (the demo's first call took
  16.2 s with it, 12.5 s without, on 2 cores); else all of `SETTINGS`.

  Args:
    who: what is about to train, for the status's reason.

  Returns:
    The `HostMemoryStatus` after the call.

  Example:
    >>> import tunedjax as tj
    >>> apply_for_training("a doctest").mode in MODES
    True
  """
  global _STATUS, _MEASURING
  with _LOCK:
    status = configure()
    if (status.mode != "auto" or status.applied or _blocked(status.mode) is not None
        or _jax_default_backend_if_started() is not None or not _likely_cpu_only()):
      return status
    settings = RETENTION if _UNSPLIT is None else SETTINGS
    refused = _mallopt(_glibc(), settings)
    if refused:
      return status
    _MEASURING = False
    kept = (f"; XLA:CPU allocates temporaries in blocks of at most "
            f"{_xla.HEAP_BYTES // 2**20} MiB, which the arenas of its threads keep"
            if settings is RETENTION else "")
    _STATUS = dataclasses.replace(
        status, applied=True, settings=dict(settings),
        reason=(f"set with mallopt when {who}, before JAX's backend started: CPU training "
                f"gains from reusing its steps' memory{kept}"))
    return _STATUS


def measuring() -> bool:
  """True while `tunedjax.jit` should measure its CPU programs: ``auto`` mode, and
  nothing decided yet, or a decision applied and not yet confirmed in this process."""
  return _MEASURING or _CONFIRMING


class CallProbe:
  """Measures one compiled CPU program's calls in spans: page faults, system and wall time.

  `tunedjax.jit` gives each function one probe while `measuring` is True. The
  first `WARMUP` calls go through untouched (compiling, tuning, the heap
  growing); then ``getrusage`` is read after the calls that end each span of
  `SPANS` (8, then 24, then 96 calls: calls 4-11, 12-35, 36-131), each such
  call run to completion first. At each span's end the totals since the first
  reading, per call, go to `observe`: the process's page faults, system time
  and wall time between the readings (the caller's own work between calls
  included). The probe is `done` once `measuring` turns False (a measurement
  paid) or after the last span; the function's calls then cost nothing more.

  Means over many calls, not the fewest faults of three: XLA:CPU's threads
  fault a step's temporaries in on some calls and not on others (the
  MobileNet-style step of `benchmarks/kernels.py`, in a first process after
  tuning: 47 MiB on 10 of calls 2-60, on none of calls 6-11), so three early
  calls can show nothing where the steady state faults on every other step.

  Example:
    >>> probe = CallProbe("f")
    >>> calls = CallProbe.WARMUP + sum(CallProbe.SPANS)
    >>> [probe.call(lambda: 1, lambda x: x) for _ in range(calls)] == [1] * calls
    True
    >>> probe.done
    True
  """

  WARMUP = 3
  SPANS = (8, 24, 96)

  def __init__(self, program: str):
    self.program = program
    self.calls = 0
    self.done = False
    self._ends = [self.WARMUP + sum(self.SPANS[:i + 1]) for i in range(len(self.SPANS))]
    self._start: tuple[resource.struct_rusage, float] | None = None

  def call(self, run: Callable[[], Any], block: Callable[[Any], Any]) -> Any:
    """Returns ``run()``; run to completion (``block``) where a span starts or ends."""
    self.calls += 1
    at_start = self.calls == self.WARMUP
    if self.done or not (at_start or self.calls in self._ends):
      return run()
    out = block(run())
    now = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if at_start:
      self._start = now
      return out
    (usage0, wall0), (usage1, wall1) = self._start, now
    n = self.calls - self.WARMUP
    paid = observe(self.program, faults=(usage1.ru_minflt - usage0.ru_minflt) / n,
                   system_s=(usage1.ru_stime - usage0.ru_stime) / n, wall_s=(wall1 - wall0) / n)
    self.done = paid or self.calls == self._ends[-1] or not measuring()
    return out


def observe(program: str, *, faults: float, system_s: float, wall_s: float) -> bool:
  """Takes one program's measurement; where the settings pay, sets `RETENTION` in this
  process (where its memory fits: `_retention_fits`) and records the decision.

  Args:
    program: the program's name (for the record and ``tunedjax info``).
    faults: minor page faults per call.
    system_s: system CPU seconds per call.
    wall_s: seconds per call.

  Returns:
    True if this measurement pays and was acted on: `RETENTION` set in this
    process, or the decision recorded for the next import (or both).
  """
  global _MEASURING, _CONFIRMING, _STATUS
  with _LOCK:
    status = configure()
    record = _decisions.record_for(status.workload or _decisions.workload(), faults=faults,
                                   system_s=system_s, wall_s=wall_s, program=program)
    _MEASURED.append(record)
    if _CONFIRMING and wall_s >= CONFIRM_S:
      _CONFIRMING = False  # a large program runs with the settings: the decision stands
    if not (_MEASURING and record["pays"]):
      return False
    _MEASURING = False
    fits = _retention_fits(faults)
    now = _UNSPLIT is None and fits and _mallopt(_glibc(), RETENTION) is None
    stored = not _readonly_cache() and _decisions.store(decisions_folder(), record)
    if now:
      _STATUS = dataclasses.replace(status, applied=True, settings=dict(RETENTION),
                                    decision=record, reason=_retained(record, stored))
    elif stored:
      why = (f"decided after it started; {_UNSPLIT}" if _UNSPLIT is not None else
             "decided after it started" if fits else "one copy of its temporaries per XLA "
             f"thread could take more than {_RETENTION_MEMORY_SHARE:.0%} of this machine's "
             "memory")
      _STATUS = dataclasses.replace(status, decision=record, reason=(
          f"not set in this process ({why}); recorded for the next import of this workload: "
          f"{_describe(record)}"))
    return now or stored


def _retained(record: dict[str, Any], stored: bool) -> str:
  return (f"{', '.join(RETENTION)} set with mallopt in this process as soon as tunedjax.jit "
          f"measured that they pay: {_describe(record)}. XLA:CPU allocates temporaries in "
          f"blocks of at most {_xla.HEAP_BYTES // 2**20} MiB ({_xla.HEAP_FLAG} in $XLA_FLAGS), "
          "which the arenas of XLA's threads keep"
          + ("; recorded for the next import of this workload, which sets all of them (one "
             "arena) at import" if stored else ""))


def _retention_fits(faults: float) -> bool:
  """Whether one copy of a program's temporaries (its faulted pages) per CPU, the most XLA
  threads that may each keep one, fits in `_RETENTION_MEMORY_SHARE` of physical memory."""
  try:
    page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError):  # not reported: assume it fits (as glibc's defaults would)
    return True
  return faults * page * (os.cpu_count() or 1) <= _RETENTION_MEMORY_SHARE * page * pages


def measurements() -> list[dict[str, Any]]:
  """This process's measurements so far (records, paying or not), oldest first."""
  with _LOCK:
    return list(_MEASURED)


def _readonly_cache() -> bool:
  try:
    from tunedjax._config import get_config  # pylint: disable=import-outside-toplevel
    return bool(get_config().cache.readonly)
  except Exception:  # pylint: disable=broad-except  # a bad $TUNEDJAX_CONFIG: write nothing
    return True


def recorded_decisions() -> tuple[pathlib.Path, list[dict[str, Any]]]:
  """The decisions file, and the decisions it holds for this machine (every workload)."""
  folder = decisions_folder()
  here = _decisions.machine()
  return (folder / _decisions.FILE_NAME,
          [r for r in _decisions.load(folder) if r["machine"] == here])


def release_host_memory() -> bool:
  """Returns the heap's free memory to the operating system (glibc's ``malloc_trim``).

  With the host-memory settings applied, memory the process freed stays
  mapped for reuse; call this after a phase that used much more than training
  does (loading a large dataset into memory, say) to shrink the resident size.

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
  """The process's minor page faults so far (``getrusage``)."""
  return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
