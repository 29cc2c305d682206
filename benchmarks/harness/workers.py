"""What the benchmarks that time programs in worker processes share.

`host_memory.py`, `malloc_settings.py` and `import_dispatch.py` run each
variant in a process of its own (its malloc settings, or whether tunedjax is
imported at all, are per process) and talk to it a JSON line at a time;
`mlp_problem` is the small step several of them time. Nothing here imports
tunedjax, so a worker that must run without it can use it.
"""

from __future__ import annotations

import json
import subprocess


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
