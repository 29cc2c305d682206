"""How `benchmarks/gpu.py` runs its parts: workers, records, time limits.

Each group of variants runs in a worker process of its own (``gpu.py --worker
NAME``), so that a variant's first call is a fresh process's (XLA keeps its
autotuning results per process) and so that a worker that runs out of time
can be stopped without losing the others. A worker prints what it measures
as it goes: a line for people, and a record (`emit`: ``@gpu.py {json}``) for
the driver, which `supervise` collects. The worker paces itself by its
`Deadline`; the driver kills its process group at the budget plus a grace,
keeping every record it printed before.

No JAX here: the driver imports this module and must not start a backend
(on a GPU, the first process to touch it takes most of its memory).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RECORD = "@gpu.py "
GRACE_S = 3.0  # after a worker's budget, before it is killed


def emit(kind: str, **fields: Any) -> None:
  """Prints one record for the driver (JSON on one line, flushed)."""
  print(RECORD + json.dumps({"kind": kind, **fields}, default=str), flush=True)


def say(text: str) -> None:
  """Prints a line for people, flushed (a killed worker keeps what it printed)."""
  print(text, flush=True)


class Deadline:
  """A worker's time limit: the budget less a reserve, from the process's start."""

  def __init__(self, budget_s: float, *, started: float | None = None, reserve_s: float = 2.0):
    start = time.monotonic() if started is None else started
    self.budget_s = budget_s
    self.end = start + max(budget_s - reserve_s, 0.0)

  def left(self) -> float:
    return self.end - time.monotonic()

  def allows(self, seconds: float) -> bool:
    """Whether `seconds` of work still fit."""
    return self.left() >= seconds


def fit_rounds(per_round_s: float, left_s: float, wanted: int, minimum: int = 2) -> int:
  """Rounds of `per_round_s` (plus one warm-up round) that fit in `left_s`, at most
  `wanted`; 0 when not even `minimum` fit."""
  if per_round_s <= 0:
    return wanted
  fit = int(left_s / per_round_s) - 1
  return 0 if fit < minimum else min(wanted, fit)


@dataclasses.dataclass
class WorkerResult:
  """What a worker left: its records, and how it ended."""

  name: str
  budget_s: float
  seconds: float = 0.0
  cpu_s: float = 0.0  # user + system CPU seconds of the worker and its children
  status: str = "done"  # done | budget | failed | skipped
  returncode: int | None = None
  records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  in_progress: str | None = None  # the last `start` record's `what`, when it did not end

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _reader(stream, lines: queue.Queue) -> None:
  for line in iter(stream.readline, ""):
    lines.put(line)
  lines.put(None)


def _take(result: WorkerResult, line: str, echo: Callable[[str], None]) -> None:
  if not line.startswith(RECORD):
    echo(line.rstrip("\n"))
    return
  try:
    record = json.loads(line[len(RECORD):])
  except ValueError:
    echo(line.rstrip("\n"))
    return
  if record.get("kind") == "start":
    result.in_progress = record.get("what")
  elif record.get("kind") == "end":
    result.in_progress = None
  result.records.append(record)


def _reap(proc: subprocess.Popen) -> float:
  """Waits for the worker; its CPU seconds (user + system, its own children's included)."""
  try:
    _, status, usage = os.wait4(proc.pid, 0)
  except ChildProcessError:  # already reaped
    proc.wait()
    return 0.0
  proc.returncode = os.waitstatus_to_exitcode(status)
  return usage.ru_utime + usage.ru_stime


def _kill(proc: subprocess.Popen) -> None:
  """Kills the worker and everything it started (it leads its own process group)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def stop_on_sigterm() -> None:
  """Turns SIGTERM (``timeout``'s) into SystemExit, so that `supervise` kills its worker."""
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def supervise(name: str, command: Sequence[str], budget_s: float, *,
              env: Mapping[str, str] | None = None,
              echo: Callable[[str], None] = print) -> WorkerResult:
  """Runs a worker for at most `budget_s` (+ `GRACE_S`), relaying its lines as they come.

  Returns:
    Its records and how it ended: ``done`` (exit 0), ``failed`` (another exit
    status) or ``budget`` (killed at its time limit; the records printed
    before are kept, ``in_progress`` names what it was doing).
  """
  result = WorkerResult(name, budget_s)
  start = time.monotonic()
  proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, bufsize=1,
                          env=None if env is None else dict(env), start_new_session=True)
  lines: queue.Queue = queue.Queue()
  reader = threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True)
  reader.start()
  end = start + budget_s + GRACE_S
  try:
    while True:
      try:
        line = lines.get(timeout=max(end - time.monotonic(), 0.0))
      except queue.Empty:
        result.status = "budget"
        break
      if line is None:
        break
      _take(result, line, echo)
  except BaseException:  # the driver is stopped (SIGTERM, Ctrl-C): no worker outlives it
    _kill(proc)
    _reap(proc)
    raise
  if result.status == "budget":
    _kill(proc)
  result.cpu_s = _reap(proc)
  reader.join(timeout=5)
  while not lines.empty():  # what it printed before it was stopped
    line = lines.get_nowait()
    if line is not None:
      _take(result, line, echo)
  result.seconds = time.monotonic() - start
  result.returncode = proc.returncode
  if result.status != "budget":
    result.status = "done" if proc.returncode == 0 else "failed"
  return result


def worker_command(script: str, name: str, extra: Sequence[str]) -> list[str]:
  """The command line of one worker: this Python, the script, its worker name."""
  return [sys.executable, script, "--worker", name, *extra]
