"""XLA:CPU's temporaries in blocks a thread's malloc arena can keep, set through ``$XLA_FLAGS``.

XLA:CPU allocates a program's temporaries as one block per execution, on the
thread of its pool that runs it. A glibc thread arena cannot hold a block over
64 MiB (the MobileNet-style step's is 73 MiB), so glibc maps it afresh each
time, whatever ``mallopt`` says once the thread has its arena. XLA's
``xla_multiheap_size_constraint_per_heap`` makes it allocate them in several
blocks of at most `HEAP_BYTES` instead (a single larger buffer still gets a
block of its own), which a thread arena can keep once mapping and trimming
are off: so a process that measured the settings paying can act on them at
once, with JAX's threads long started (`tunedjax._host_memory.RETENTION`).

XLA reads ``$XLA_FLAGS`` once, when JAX's backend starts, and applies it to
every backend's programs; so `split_heaps` adds the flag only before that and
only where JAX will run on the CPU alone (`likely_cpu_only`). Nothing here
imports JAX.

Example:
  >>> HEAP_FLAG
  '--xla_multiheap_size_constraint_per_heap=50331648'
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Under a thread arena's 64 MiB heap, and over glibc's largest dynamic mmap threshold
# (32 MiB): a block this size is mapped afresh until `RETENTION` is set, whatever the
# process allocated before (tuning raises that threshold), so the measurement that
# decides sees its faults. At 32 MiB, a process that had tuned measured none and so
# decided nothing, and then faulted some blocks again now and then.
HEAP_BYTES = 48 * 2**20
HEAP_OPTION = "xla_multiheap_size_constraint_per_heap"
HEAP_FLAG = f"--{HEAP_OPTION}={HEAP_BYTES}"
# A block a thread arena can hold: under its 64 MiB heap, with room for glibc's headers.
_ARENA_BLOCK_BYTES = 60 * 2**20


def jax_plugins_installed() -> bool:
  """Whether an installed distribution declares a ``jax_plugins`` entry point (an
  accelerator's PJRT plugin), read from the ``entry_points.txt`` files on `sys.path`
  (what `importlib.metadata` reads, in a few milliseconds instead of a hundred)."""
  for entry in sys.path:
    folder = entry or "."
    try:
      names = os.listdir(folder)
    except OSError:
      continue
    for name in names:
      if not name.endswith((".dist-info", ".egg-info")):
        continue
      try:
        with open(os.path.join(folder, name, "entry_points.txt"), encoding="utf-8") as f:
          if "[jax_plugins]" in f.read():
            return True
      except OSError:  # most distributions declare no entry points
        continue
  return False


def likely_cpu_only() -> bool:
  """Whether JAX will run on the CPU only: ``$JAX_PLATFORMS`` says so, or no accelerator
  plugin is installed (libtpu, a ``jax_plugins`` entry point or namespace package)."""
  chosen = os.environ.get("JAX_PLATFORMS", "").strip()
  if chosen:
    return chosen.split(",")[0].strip().lower() == "cpu"
  if importlib.util.find_spec("libtpu") is not None or jax_plugins_installed():
    return False
  return importlib.util.find_spec("jax_plugins") is None


def _flag_value(flags: str) -> int | None:
  """The heap size ``$XLA_FLAGS`` already asks for, if any (-1: unparsable)."""
  value = None
  for flag in flags.split():
    name, _, text = flag.lstrip("-").partition("=")
    if name == HEAP_OPTION:
      try:
        value = int(text)
      except ValueError:
        value = -1
  return value


def split_heaps(backend_started: bool) -> str | None:
  """Has XLA:CPU allocate temporaries in blocks of at most `HEAP_BYTES` (`HEAP_FLAG`
  added to ``$XLA_FLAGS``) where it can still act.

  Args:
    backend_started: whether JAX's backend has started (XLA then read its flags).

  Returns:
    None where the blocks are that small (added now, or already asked for in
    ``$XLA_FLAGS``), else why not (a phrase).
  """
  flags = os.environ.get("XLA_FLAGS", "")
  value = _flag_value(flags)
  if value is not None:
    return (None if 0 < value <= _ARENA_BLOCK_BYTES else
            f"$XLA_FLAGS sets {HEAP_OPTION} to {value}")
  if backend_started:
    return "JAX's backend started before tunedjax was imported"
  if not likely_cpu_only():
    return "JAX may run on an accelerator here, which would read the flag too"
  os.environ["XLA_FLAGS"] = f"{flags} {HEAP_FLAG}".strip()
  return None
