"""A train step's first calls after the cores sat idle: XLA:CPU against PyTorch.

On these machines an XLA:CPU program runs its first few calls after a pause
of 0.1 s or more up to 1.6x slower than back to back, with the same CPU time
(its worker threads wait longer for each other), while a PyTorch eager step
barely notices. An interleaved benchmark that times one step per variant per
round, each after the other variants ran, therefore charges XLA for that
pause; a training loop, whose steps follow each other, never sees it. This
script measures it: for each pause, each step's time in the run of steps
after the pause (the median over repetitions), for the MobileNet-style step
in plain JAX under `tj.jit` (kernel selection on), the same under `jax.jit`
for a matmul chain (no tunedjax: XLA alone), and PyTorch eager channels_last
(`vs_pytorch.py`'s step, when torch is installed). The process runs with
tunedjax's host-memory settings (`TUNEDJAX_HOST_MEMORY=retain` unless the
variable is set), so that page faults, a separate matter, stay out of it.

Usage::

    .venv/bin/python benchmarks/run.py after_idle [--quick] [--write]

The PyTorch row needs torch in that interpreter (the bench-torch extra); without
it, the JAX rows only.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TUNEDJAX_HOST_MEMORY", "retain")  # before tunedjax is imported

import vs_pytorch as vp  # the steps; vp.torch is None without torch here (no PyTorch row)

import harness
import jax
import jax.numpy as jnp
import numpy as np

import tunedjax as tj

PAUSES_S = (0.0, 0.02, 0.1, 0.3, 1.0)


def steps_after(run: Callable[[], Any], pause_s: float, *, steps: int, repeats: int
                ) -> list[float]:
  """ms of each of `steps` consecutive calls after a `pause_s` sleep (medians over repeats)."""
  rows = []
  for _ in range(repeats):
    time.sleep(pause_s)
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      run()
      times.append(1e3 * (time.perf_counter() - start))
    rows.append(times)
  return [statistics.median(column) for column in zip(*rows)]


def variants(quick: bool) -> dict[str, Callable[[], Any]]:
  """The steps timed: tunedjax's plain-JAX step, an XLA matmul chain, PyTorch's step."""
  step, args, _, _ = vp.net_problem("mobilenet-plain", quick)
  config = {"kernel": {"enable": True}, "cache": {"dir": tempfile.mkdtemp(prefix="tj-idle-")}}
  with tj.config_context(config):
    tuned = tj.jit(step)
    compiled = tuned.lower(*args).compile()
  n = 128 if quick else 512
  x = jnp.ones((n, n)) / n
  chain = jax.jit(lambda x: [x := jnp.tanh(x @ x) for _ in range(12)][-1])
  out = {"tunedjax (tj.jit), plain-JAX MobileNet step": lambda: jax.block_until_ready(
             compiled(*args)),
         f"jax.jit, 12 matmuls {n}x{n} (no tunedjax)": lambda: jax.block_until_ready(chain(x))}
  if vp.torch is not None:
    torch = vp.torch
    torch.set_num_threads(os.cpu_count() or 1)
    params, xb, yb = args[0], args[-2], args[-1]
    model = vp.TorchMobileNet().to(memory_format=torch.channels_last)
    vp.load_torch(model, "mobilenet-plain", vp.flat_names(params))
    xt = torch.from_numpy(np.asarray(xb).transpose(0, 3, 1, 2).copy()).contiguous(
        memory_format=torch.channels_last)
    yt = torch.from_numpy(np.asarray(yb).astype(np.int64))
    model.train()
    out["PyTorch eager, channels_last"] = vp.torch_step(
        model, torch.optim.SGD(model.parameters(), lr=vp.LR), xt, yt)
  return out


def measure(quick: bool = False) -> harness.Result:
  """Each variant's step times after each pause: ``{name: {pause: [ms per step]}}``."""
  steps, repeats = (3, 2) if quick else (6, 7)
  runs = variants(quick)
  for run in runs.values():  # compiled and warm
    for _ in range(3):
      run()
  ms = {name: {p: steps_after(run, p, steps=steps, repeats=repeats) for p in PAUSES_S}
        for name, run in runs.items()}
  return harness.Result("after_idle", figures={"ms": ms}, params={
      "quick": quick, "steps": steps, "repeats": repeats,
      "host_memory": tj.host_memory_status().mode})


def render(result: harness.Result) -> str:
  p = result.params
  header = "| pause | " + " | ".join(f"step {i + 1}" for i in range(p["steps"])) + " |"
  lines = []
  for name, by_pause in result.figures["ms"].items():
    lines += ["", f"**{name}** (ms per step)", "", header, "|---|" + "---:|" * p["steps"]]
    lines += [f"| {pause:g} s | " + " | ".join(f"{t:.1f}" for t in ms) + " |"
              for pause, ms in by_pause.items()]
  return "\n".join([
      "## After idle: a step's first calls after the cores sat idle",
      "",
      f"`benchmarks/run.py after_idle{' --quick' if p['quick'] else ''}`: after each pause "
      f"(a sleep), {p['steps']} consecutive steps, each step's time the median over "
      f"{p['repeats']} repetitions; host memory `{p['host_memory']}`. {result.load_line()} "
      + result.machine,
      *lines])
