"""Running test scripts in fresh processes: one alone, or two under `jax.distributed`."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cpu_env() -> dict[str, str]:
  """The environment for a child JAX process on the CPU, without our XLA flags."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  return env


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def last_json(stdout: str) -> Any:
  """The JSON object a script printed on its last line."""
  return json.loads(stdout.strip().splitlines()[-1])


def run_distributed(script: pathlib.Path, extra_args: Sequence[Sequence[str]], *,
                    timeout: float = 240) -> list[Any]:
  """Runs `script port process_id *extra_args[i]` as processes 0 and 1 of one job.

  Each script calls `jax.distributed.initialize` itself with the port and id.

  Returns:
    The JSON each process printed last, in process order.
  """
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(script), str(port), str(i), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cpu_env()) for i, args in enumerate(extra_args)]
  results = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    assert p.returncode == 0, err[-3000:]
    results.append(last_json(out))
  return results
