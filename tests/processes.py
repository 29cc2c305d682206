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

from tests import fast_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]


# The XLA flags a child keeps: it compiles as its parent does (`make test`'s
# parallel phase compiles fast, tests/fast_compile.py), so that a result
# compared bitwise across the two processes came from the same code generation.
INHERITED_XLA_FLAGS = tuple(flag.split("=")[0] for flag in fast_compile.CANDIDATES)


def cpu_env() -> dict[str, str]:
  """The environment for a child JAX process on the CPU: none of our XLA flags
  but the compile-speed ones (`INHERITED_XLA_FLAGS`)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  kept = [f for f in env.pop("XLA_FLAGS", "").split() if f.startswith(INHERITED_XLA_FLAGS)]
  if kept:
    env["XLA_FLAGS"] = " ".join(kept)
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
