"""The host-memory decisions: which workloads on this machine the malloc settings pay for.

`import tunedjax` must decide before JAX starts its threads, so it cannot read
the tuning cache proper (its files are keyed by a device fingerprint, which
needs JAX's backend). The decisions live in their own small JSON file in the
same folder, ``host-memory.json``, read at import without JAX. Each record is
keyed by:

* **the machine** (`machine`): the CPU model, the number of CPUs, the
  architecture and the C library's version, read without JAX. Another kind of
  machine sharing the folder measures again.
* **the workload** (`workload`): what Python is running. A script
  (``python train.py``, ``python -m package.train``: its file), a notebook
  (``$JPY_SESSION_NAME``, which Jupyter sets to the notebook's path; without
  it, every kernel of that Jupyter is one workload), ``python -c CODE`` (a
  hash of the code), or the interactive interpreter. So a CNN training
  script's decision is never applied to another script full of tiny calls.

A file that cannot be read as decisions is moved aside (``host-memory.json.corrupt``)
with a `HostMemoryWarning`, and a record that is not valid is dropped with one:
the workload is measured again, never a crash.

Example:
  >>> rec = record_for("python -c 0123", faults=18000.0, system_s=0.03, wall_s=0.046,
  ...                  program="step")
  >>> rec["pays"], rec["workload"]
  (True, 'python -c 0123')
"""

from __future__ import annotations

# `import tunedjax` reads this module; what only recording or a present file needs
# (datetime, fcntl, hashlib, json, platform, tempfile) is imported where used.
import contextlib
import functools
import math
import os
import pathlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from tunedjax._errors import HostMemoryWarning
from tunedjax._version import __version__

FILE_NAME = "host-memory.json"
FORMAT = "tunedjax-host-memory"
FORMAT_VERSION = 1
MAX_RECORDS = 256

# A program pays when it faults at least this many pages (16 MiB) per call,
# spending at least this share of its call time in the kernel (zeroing them).
FAULT_PAGES = 4096
SYSTEM_SHARE = 0.1


@functools.cache
def machine() -> dict[str, Any]:
  """What a decision depends on besides the workload, read without JAX (and cached)."""
  import platform  # pylint: disable=import-outside-toplevel
  model = platform.processor() or "unknown"
  try:  # the first CPU's entry is enough: read only the start of the file
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      head = f.read(8192)
    for line in head.splitlines():
      key, sep, value = line.partition(":")
      if sep and key.strip().lower() in ("model name", "cpu model"):
        model = value.strip()
        break
  except OSError:
    pass
  return {"cpu": model, "cpus": os.cpu_count() or 0, "arch": platform.machine(),
          "libc": "-".join(platform.libc_ver()) or "unknown"}


def workload() -> str:
  """What this process runs, as the key its decision is kept under (module docstring)."""
  notebook = os.environ.get("JPY_SESSION_NAME")
  if notebook:
    return f"notebook {notebook}"
  argv0 = sys.argv[0] if sys.argv else ""
  if argv0 == "-c":
    import hashlib  # pylint: disable=import-outside-toplevel
    orig = list(getattr(sys, "orig_argv", ()))
    code = orig[orig.index("-c") + 1] if "-c" in orig[:-1] else ""
    return f"python -c {hashlib.sha256(code.encode()).hexdigest()[:16]}"
  if argv0 in ("", "-"):
    return "interactive"
  return f"script {os.path.realpath(argv0)}"


def record_for(workload_key: str, *, faults: float, system_s: float, wall_s: float,
               program: str) -> dict[str, Any]:
  """One measured program's record: whether the settings pay, and from what."""
  import datetime  # pylint: disable=import-outside-toplevel
  pays = faults >= FAULT_PAGES and system_s >= SYSTEM_SHARE * wall_s
  return {"machine": machine(), "workload": workload_key, "pays": bool(pays),
          "faults_per_call": round(float(faults), 1),
          "system_ms_per_call": round(1e3 * system_s, 3),
          "call_ms": round(1e3 * wall_s, 3), "program": program,
          "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec="seconds"), "tunedjax": __version__}


_FIELDS = {"machine": dict, "workload": str, "pays": bool, "faults_per_call": (int, float),
           "system_ms_per_call": (int, float), "call_ms": (int, float), "program": str,
           "measured_at": str}


def problem(record: Any) -> str | None:
  """Why `record` is not a valid decision record, or None."""
  if not isinstance(record, dict):
    return f"a record is {type(record).__name__}, not an object"
  for name, kind in _FIELDS.items():
    value = record.get(name)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
      return f"its {name!r} is {value!r}"
    if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
      return f"its {name!r} is {value!r}"
  return None


def _warn(message: str) -> None:
  warnings.warn(f"tunedjax: {message}", HostMemoryWarning, stacklevel=5)


def load(folder: pathlib.Path) -> list[dict[str, Any]]:
  """The valid records in `folder`'s file; a corrupt file is moved aside with a warning."""
  path = folder / FILE_NAME
  try:
    raw = path.read_bytes()
  except OSError:  # missing (the usual case) or unreadable: nothing decided
    return []
  import json  # pylint: disable=import-outside-toplevel
  try:
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
      raise ValueError(f"not a {FORMAT} file")
    if data.get("version") != FORMAT_VERSION:
      raise ValueError(f"version {data.get('version')!r}, expected {FORMAT_VERSION}")
    records = data.get("records")
    if not isinstance(records, list):
      raise ValueError("no list of records")
  except ValueError as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
    with contextlib.suppress(OSError):
      path.replace(path.with_name(FILE_NAME + ".corrupt"))
    _warn(f"the host-memory decisions file {str(path)!r} is corrupt ({err}); it was moved "
          f"to {FILE_NAME}.corrupt and each workload is measured again.")
    return []
  good = []
  for record in records:
    why = problem(record)
    if why is None:
      good.append(record)
    else:
      _warn(f"a record in {str(path)!r} is not valid ({why}); it is ignored and its "
            "workload measured again.")
  return good


def lookup(folder: pathlib.Path, workload_key: str) -> dict[str, Any] | None:
  """This machine's record for `workload_key` in `folder`, if any."""
  for record in load(folder):
    if record["workload"] == workload_key and record["machine"] == machine():
      return record
  return None


@contextlib.contextmanager
def _locked(folder: pathlib.Path) -> Iterator[None]:
  import fcntl  # pylint: disable=import-outside-toplevel
  with open(folder / (FILE_NAME + ".lock"), "a+b") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _write(folder: pathlib.Path, records: list[dict[str, Any]]) -> None:
  import json  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  data = {"format": FORMAT, "version": FORMAT_VERSION, "records": records[-MAX_RECORDS:]}
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=FILE_NAME, suffix=".tmp")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, folder / FILE_NAME)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def forget(folder: pathlib.Path, workload_key: str) -> bool:
  """Removes this machine's record for `workload_key`; True if there was one."""
  try:
    with _locked(folder):
      records = load(folder)
      kept = [r for r in records
              if not (r["workload"] == workload_key and r["machine"] == machine())]
      if len(kept) == len(records):
        return False
      _write(folder, kept)
  except OSError:
    return False
  return True


def store(folder: pathlib.Path, record: dict[str, Any]) -> bool:
  """Adds `record`, replacing its machine and workload's; False if the folder cannot be written."""
  import json  # pylint: disable=import-outside-toplevel
  key = (json.dumps(record["machine"], sort_keys=True), record["workload"])
  try:
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
      kept = [r for r in load(folder)
              if (json.dumps(r["machine"], sort_keys=True), r["workload"]) != key]
      _write(folder, [*kept, record])
  except OSError:
    return False
  return True
