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

    .venv-torch/bin/python benchmarks/after_idle.py [--quick] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TUNEDJAX_HOST_MEMORY", "retain")  # before tunedjax is imported

import vs_pytorch as vp  # re-runs this script under .venv-torch when torch is missing here

import harness as _harness
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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (smoke)")
  parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
  args = parser.parse_args(argv)
  steps, repeats = (3, 2) if args.quick else (6, 7)
  runs = variants(args.quick)
  for run in runs.values():  # compiled and warm
    for _ in range(3):
      run()
  load = os.getloadavg()[0]
  header = "| pause | " + " | ".join(f"step {i + 1}" for i in range(steps)) + " |"
  lines = []
  for name, run in runs.items():
    lines += ["", f"**{name}** (ms per step)", "", header,
              "|---|" + "---:|" * steps]
    for pause in PAUSES_S:
      ms = steps_after(run, pause, steps=steps, repeats=repeats)
      lines.append(f"| {pause:g} s | " + " | ".join(f"{t:.1f}" for t in ms) + " |")
  body = "\n".join([
      "## After idle: a step's first calls after the cores sat idle",
      "",
      f"`benchmarks/after_idle.py{' --quick' if args.quick else ''}`: after each pause "
      f"(a sleep), {steps} consecutive steps, each step's time the median over {repeats} "
      f"repetitions; host memory `{tj.host_memory_status().mode}`. Load average "
      f"{load:.1f} before, {os.getloadavg()[0]:.1f} after. "
      + _harness.machine_line(),
      *lines])
  print(body)
  if args.write:
    _harness.write_section("after_idle", body)
  return 0


if __name__ == "__main__":
  sys.exit(main())
