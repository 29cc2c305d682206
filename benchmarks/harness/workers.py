"""Worker processes: a variant per process, talked to a JSON line at a time.

`host_memory.py`, `malloc_settings.py`, `import_dispatch.py` and
`first_process.py` run each variant in a process of its own (its malloc
settings, whether tunedjax is imported at all, or being a machine's first
process are per process). The protocol: the worker prints ``{"ready": ...}``
once it is set up (`serve`), then answers each ``run`` line on its stdin with
one JSON line; the driver starts it with a scrubbed environment (`user_env`,
`spawn`), reads its replies (`reply`) and times the workers in rotated rounds
(`run_rounds`). `mlp_problem` is the small step several of them time. Nothing
here imports tunedjax or JAX at import time, so a worker that must run
without them can use it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .timing import rotated

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What a user's shell would not have set: allocator settings and tunedjax's own.
_SCRUBBED_PREFIXES = ("MALLOC_", "TUNEDJAX_")
_SCRUBBED = ("GLIBC_TUNABLES", "LD_PRELOAD")


def user_env(**settings: str) -> dict[str, str]:
  """This process's environment as a user's would be (no allocator or tunedjax
  settings), tunedjax's src/ and benchmarks/ importable, plus `settings`."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                    env.get("PYTHONPATH")]))
  env.update(settings)
  return env


def spawn(command: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
  """Starts a worker that speaks the protocol (stdin and stdout as text pipes)."""
  return subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=None if env is None else dict(env))


def serve(run: Callable[[], Any], ready: Any = True) -> None:
  """The worker's side: announces `ready`, then prints `run()` for each ``run`` line."""
  print(json.dumps({"ready": ready}), flush=True)
  for line in sys.stdin:
    if line.strip() != "run":
      break
    print(json.dumps(run()), flush=True)


def ask(proc: subprocess.Popen) -> dict:
  """Sends one ``run`` line and returns the worker's reply."""
  proc.stdin.write("run\n")
  proc.stdin.flush()
  return reply(proc)


def run_rounds(procs: Mapping[str, subprocess.Popen], rounds: int) -> dict[str, list[dict]]:
  """Asks every worker once per round, in a rotated order; then ends them."""
  runs: dict[str, list[dict]] = {n: [] for n in procs}
  for r in range(rounds):
    for name in rotated(procs, r):
      runs[name].append(ask(procs[name]))
  for p in procs.values():
    p.communicate("")
  return runs


def reply(proc: subprocess.Popen) -> dict:
  """The worker's next JSON line; exits the benchmark if the worker ended instead."""
  line = proc.stdout.readline()
  if not line:
    raise SystemExit(f"a worker ended early (exit code {proc.wait()})")
  return json.loads(line)


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


def command(script: str, python: str | None = None, **kwargs: Any) -> list[str]:
  """The command line that runs ``worker(**kwargs)`` of the benchmark module at
  `script` (its `run_worker` reads them); `python` defaults to this one."""
  return [python or sys.executable, script, "--worker", json.dumps(kwargs)]


def run_worker(worker: Callable[..., None]) -> None:
  """A benchmark module's ``__main__``: the worker that `command` started."""
  if sys.argv[1:2] != ["--worker"]:
    name = pathlib.Path(sys.argv[0]).stem
    raise SystemExit(f"a worker's entry point; run the benchmark with benchmarks/run.py {name}")
  worker(**json.loads(sys.argv[2]))
