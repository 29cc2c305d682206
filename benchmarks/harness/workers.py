"""Worker processes: a variant per process, with a time limit, talked to in JSON lines.

`host_memory.py`, `malloc_settings.py`, `import_dispatch.py`, `first_process.py`
and `gpu.py` run each variant in a process of its own (malloc settings, whether
tunedjax is imported, a first call are per process). One protocol for all:

- A worker's stdout carries records, a JSON object a line (`emit`; `serve`
  prints ``{"ready": ...}``, then answers each ``run`` line on its stdin with
  one record); its stderr is for people (`say`) and is relayed as it comes.
- The driver starts it (`spawn`: a user's environment from `user_env`, the
  module's ``worker(**kwargs)`` by `command`/`run_worker`) with a time limit:
  at the limit plus `GRACE_S` its process group is killed, and what it
  reported before is kept (`Worker.records`, `Worker.in_progress`).
- A worker with a time limit dumps every thread's stack (`faulthandler`)
  half a second past it, so a hung worker shows where it hung
  (`Worker.stack`).

`run_rounds` asks each worker once per round, in a rotated order. Nothing here
imports tunedjax or JAX at import time: a driver must not start a backend.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .timing import rotated

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRACE_S = 3.0  # past a worker's time limit, before its process group is killed
DEFAULT_BUDGET_S = 3600.0  # a CPU benchmark's worker: a hang ends the run, with its stack
UNTIL = "BENCH_WORKER_UNTIL"  # the worker's deadline (seconds since the epoch), in its env
# What a user's shell would not have set: allocator settings and tunedjax's own.
_SCRUBBED_PREFIXES = ("MALLOC_", "TUNEDJAX_")
_SCRUBBED = ("GLIBC_TUNABLES", "LD_PRELOAD")


# --- the worker's side ------------------------------------------------------------------


def emit(kind: str, **fields: Any) -> None:
  """Reports one record to the driver (a JSON line on stdout, flushed)."""
  print(json.dumps({"kind": kind, **fields}, default=str), flush=True)


def say(text: str) -> None:
  """A line for people (stderr, flushed: a killed worker keeps what it said)."""
  print(text, file=sys.stderr, flush=True)


def seconds_left() -> float:
  """This worker's time left (infinite without a limit)."""
  until = os.environ.get(UNTIL)
  return float("inf") if not until else float(until) - time.time()


def arm() -> None:
  """Dumps every thread's stack to stderr half a second past the time limit."""
  left = seconds_left()
  if left != float("inf"):
    faulthandler.dump_traceback_later(max(left + 0.5, 1.0), exit=False)


def serve(run: Callable[[], Any], ready: Any = True) -> None:
  """Announces `ready`, then reports `run()` for each ``run`` line."""
  print(json.dumps({"ready": ready}), flush=True)
  for line in sys.stdin:
    if line.strip() != "run":
      break
    print(json.dumps(run()), flush=True)


def command(script: str, python: str | None = None, **kwargs: Any) -> list[str]:
  """The command line that runs ``worker(**kwargs)`` of the benchmark module at
  `script` (its `run_worker` reads them); `python` defaults to this one."""
  return [python or sys.executable, script, "--worker", json.dumps(kwargs)]


def run_worker(worker: Callable[..., Any]) -> None:
  """A benchmark module's ``__main__``: the worker that `command` started."""
  if sys.argv[1:2] != ["--worker"]:
    name = pathlib.Path(sys.argv[0]).stem
    raise SystemExit(f"a worker's entry point; run the benchmark with benchmarks/run.py {name}")
  arm()
  raise SystemExit(worker(**json.loads(sys.argv[2])))


# --- the driver's side ------------------------------------------------------------------


def user_env(**settings: str) -> dict[str, str]:
  """This process's environment as a user's would be (no allocator or tunedjax
  settings), tunedjax's src/ and benchmarks/ importable, plus `settings`."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                    env.get("PYTHONPATH")]))
  env.update(settings)
  return env


class Worker:
  """A running worker: its records as they come, its stderr relayed, its time limit.

  Attributes:
    records: every record it reported, in order (kept when it is killed).
    in_progress: the last ``start`` record's ``what`` that no ``end`` followed.
    stack: its stack dump (`arm`), when it hung past its time limit.
    status: ``running``, then ``done`` (exit 0), ``failed`` or ``budget`` (killed).
  """

  def __init__(self, command: Sequence[str], env: Mapping[str, str] | None = None, *,
               name: str = "worker", budget_s: float | None = DEFAULT_BUDGET_S,
               echo: Callable[[str], None] | None = None):
    self.name, self.budget_s = name, budget_s
    self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    self.records: list[dict[str, Any]] = []
    self.in_progress: str | None = None
    self.stack: list[str] = []
    self.status, self.returncode, self.seconds, self.cpu_s = "running", None, 0.0, 0.0
    self.start = time.monotonic()
    self.end = float("inf") if budget_s is None else self.start + budget_s + GRACE_S
    env = dict(os.environ if env is None else env)
    if budget_s is not None:
      env[UNTIL] = f"{time.time() + budget_s:.3f}"
    self.proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
                                 start_new_session=True)
    self.lines: queue.Queue = queue.Queue()
    self.threads = [threading.Thread(target=self._read_out, daemon=True),
                    threading.Thread(target=self._read_err, daemon=True)]
    for t in self.threads:
      t.start()

  def _read_out(self) -> None:
    for line in iter(self.proc.stdout.readline, ""):
      self.lines.put(line)
    self.lines.put(None)

  def _read_err(self) -> None:
    for line in iter(self.proc.stderr.readline, ""):
      if line.startswith("Timeout (") or self.stack:  # faulthandler's dump
        self.stack.append(line.rstrip("\n"))
      self.echo(line.rstrip("\n"))

  def _take(self, line: str) -> dict | None:
    try:
      record = json.loads(line)
    except ValueError:
      record = None
    if not isinstance(record, dict):  # something printed to stdout: a line for people
      self.echo(line.rstrip("\n"))
      return None
    if record.get("kind") == "start":
      self.in_progress = record.get("what")
    elif record.get("kind") == "end":
      self.in_progress = None
    self.records.append(record)
    return record

  def next(self) -> dict | None:
    """Its next record; None once it ended, or was killed at its time limit (what it
    reported before is still read)."""
    while True:
      try:
        line = self.lines.get(timeout=None if self.end == float("inf")
                              else max(self.end - time.monotonic(), 0.0))
      except queue.Empty:
        if self.status == "budget":  # killed, and its pipe still open: give up on it
          return None
        self.status, self.end = "budget", time.monotonic() + 5
        self.kill()
        continue
      except BaseException:  # the driver is stopped (SIGTERM, Ctrl-C): no worker outlives it
        self.kill()
        raise
      if line is None:
        self.lines.put(None)  # the end, for the next call too
        return None
      record = self._take(line)
      if record is not None:
        return record

  def reply(self) -> dict:
    """Its next record; ends the benchmark if the worker ended instead."""
    record = self.next()
    if record is None:
      self.close()
      raise SystemExit(f"{self.name} ended early ({self.status}, exit code {self.returncode})"
                       + "".join("\n" + line for line in self.stack))
    return record

  def ask(self) -> dict:
    """Sends one ``run`` line; its reply."""
    self.proc.stdin.write("run\n")
    self.proc.stdin.flush()
    return self.reply()

  def kill(self) -> None:
    """Kills it and everything it started (it leads its own process group)."""
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass

  def close(self) -> "Worker":
    """Ends its stdin, keeps its records until it exits (or its time is up), reaps it."""
    try:
      self.proc.stdin.close()
    except OSError:
      pass
    while self.next() is not None:
      pass
    try:  # its CPU seconds: user + system, its own children's included
      _, status, usage = os.wait4(self.proc.pid, 0)
      self.proc.returncode = os.waitstatus_to_exitcode(status)
      self.cpu_s = usage.ru_utime + usage.ru_stime
    except ChildProcessError:  # already reaped
      self.proc.wait()
    for t in self.threads:
      t.join(timeout=5)
    self.returncode, self.seconds = self.proc.returncode, time.monotonic() - self.start
    if self.status == "running":
      self.status = "done" if self.returncode == 0 else "failed"
    return self

  def to_dict(self) -> dict[str, Any]:
    return {k: getattr(self, k) for k in ("name", "budget_s", "seconds", "cpu_s", "status",
                                          "returncode", "records", "in_progress", "stack")}


spawn = Worker  # starts one: ``spawn(command, env, name=, budget_s=, echo=)``


def run_rounds(procs: Mapping[str, Worker], rounds: int) -> dict[str, list[dict]]:
  """Asks every worker once per round, in a rotated order; then ends them."""
  runs: dict[str, list[dict]] = {n: [] for n in procs}
  for r in range(rounds):
    for name in rotated(procs, r):
      runs[name].append(procs[name].ask())
  for p in procs.values():
    p.close()
  return runs


def stop_on_sigterm() -> None:
  """Turns SIGTERM (``timeout``'s) into SystemExit, so that a waiting driver kills its worker."""
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def per_step(run: Callable[[], Any], steps: int, untimed: int = 0) -> dict[str, float]:
  """`run`'s seconds, minor page faults and system CPU seconds per call, over `steps`
  calls (after `untimed` more), from this process's `getrusage`."""
  import resource  # pylint: disable=import-outside-toplevel  # POSIX only
  for _ in range(untimed):
    run()
  before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  for _ in range(steps):
    run()
  wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
  return {"s": wall / steps, "faults": (after.ru_minflt - before.ru_minflt) / steps,
          "sys_s": (after.ru_stime - before.ru_stime) / steps}


def mlp_problem(width: int = 64, batch: int = 32):
  """A small MLP's SGD train step and its arguments: ``(step, (params, x, y))``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  params = {"w1": jnp.asarray(rng.normal(size=(width, width)) * 0.1, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(width, 1)) * 0.1, jnp.float32)}
  x = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(batch, 1)), jnp.float32)

  def loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

  return step, (params, x, y)
