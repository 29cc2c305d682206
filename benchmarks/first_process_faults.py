"""The first process's host-memory decision after tuning: page faults per step, five fresh runs.

A user's first run of a workload tunes (kernel selection) and only then
reaches its steady state. `tj.jit` decides on host memory from its own
measurement in that process (docs/host-memory.md: means over calls 4-11,
12-35 and 36-131; where a span pays, malloc keeps the step's temporaries at
once). This starts `runs` fresh processes per model, each on an empty
tuning-cache folder with a user's environment (no ``TUNEDJAX_*`` or
``MALLOC_*`` variables), and records every step's page faults, system time and
wall time (``getrusage`` after each step, run to completion):

- **CNN**: the MobileNet-style step in plain JAX (`vs_pytorch.py`'s
  ``mobilenet-plain``, batch 32, 64x64) under `tj.jit` with kernel selection,
  200 steps; its steady state is steps 132-200 (after the last span).
- **LM**: the miniGPT of `flash_attention.py` (1,024 tokens, width 256, 4
  blocks, batch 2, AdamW) through ``Trainer(autotune=True)``, 60 steps; its
  steady state is steps 20-60 (after the first two spans).

Each model runs on a quiet machine and with one core busy (a spinning
process beside it for the whole run). The table gives per run: the step at
which the process decided (None: it did not), the mean faults and system
time per step in the steady state, how many of those steps faulted more than
1,000 pages, and the median step time.

Run: ``.venv/bin/python benchmarks/run.py first_process_faults [--quick] [--write]``
(``measure(runs=5, models=("cnn", "lm"), busy=(False, True))``).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import harness
from harness import workers

MODELS = ("cnn", "lm")
STEPS = {"cnn": 200, "lm": 60}
STEADY_FROM = {"cnn": 132, "lm": 20}  # the first step of the steady state
FAULTING = 1000  # a step that faulted more pages than this "faulted"
BUDGET_S = 1800.0  # one fresh process (the LM tunes, then 60 steps of ~0.5 s)


def _record(rows: list[tuple[float, ...]], applied: bool) -> None:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  rows.append((usage.ru_minflt, usage.ru_stime, time.perf_counter(), applied))


def worker(model: str, steps: int, quick: bool) -> None:
  """A fresh process: `steps` steps of `model`; prints its per-step figures as JSON."""
  import tunedjax as tj  # pylint: disable=import-outside-toplevel  (first, as a user's script)
  sys.modules["torch"] = None  # the JAX side only
  import jax  # pylint: disable=import-outside-toplevel
  rows: list[tuple[float, ...]] = []
  if model == "cnn":
    import vs_pytorch  # pylint: disable=import-outside-toplevel
    step, args = vs_pytorch.net_problem("mobilenet-plain", quick)[:2]
    tj.set_config({"kernel": {"enable": True}})
    fn = tj.jit(step)
    _record(rows, False)
    for _ in range(steps):
      jax.block_until_ready(fn(*args))
      _record(rows, tj.host_memory_status().applied)
  else:
    import flash_attention  # pylint: disable=import-outside-toplevel
    trainer = flash_attention.trainer_for(flash_attention.lm_sizes(quick))

    class Record(tj.callbacks.Callback):
      def on_step_end(self, trainer: Any, step: int, logs: Any) -> None:
        jax.block_until_ready(trainer.state)
        _record(rows, tj.host_memory_status().applied)

    _record(rows, False)
    trainer.fit(flash_attention.lm_batches(flash_attention.lm_sizes(quick)), steps=steps,
                callbacks=[Record()])
  workers.emit(
      "steps", faults=[b[0] - a[0] for a, b in zip(rows, rows[1:])],
      system_ms=[1e3 * (b[1] - a[1]) for a, b in zip(rows, rows[1:])],
      step_ms=[1e3 * (b[2] - a[2]) for a, b in zip(rows, rows[1:])],
      decided_at=next((i for i, r in enumerate(rows) if r[3]), None),
      reason=tj.host_memory_status().reason)


def one_run(model: str, steps: int, steady_from: int, quick: bool) -> dict[str, Any]:
  """One fresh process on an empty cache folder; its steady state summarised."""
  env = workers.user_env(TUNEDJAX_CACHE_DIR=tempfile.mkdtemp(prefix="tunedjax-first-faults-"))
  env.pop("XLA_FLAGS", None)
  load = os.getloadavg()[0]
  worker = workers.spawn(workers.command(__file__, model=model, steps=steps, quick=quick), env,
                         name=f"{model} first process", budget_s=BUDGET_S)
  out = worker.reply()
  worker.close()
  steady = slice(steady_from - 1, None)
  faults = out["faults"][steady]
  return {"load": load, "decided_at": out["decided_at"],
          "faults": statistics.mean(faults), "faulting": sum(f > FAULTING for f in faults),
          "steps": len(faults), "system_ms": statistics.mean(out["system_ms"][steady]),
          "step_ms": statistics.median(out["step_ms"][steady]),
          "early_faults": statistics.mean(out["faults"][:steady_from - 1]),
          "reason": out["reason"]}


def measure(quick: bool = False, *, runs: int = 5, models: Sequence[str] = MODELS,
            busy: Sequence[bool] = (False, True)) -> harness.Result:
  if quick:
    runs, busy = 1, (False,)
  result = harness.Result("first_process_faults", params={
      "quick": quick, "runs": runs, "models": list(models), "busy": list(busy)})
  for model in models:
    steps = 20 if quick else STEPS[model]
    steady_from = 12 if quick else STEADY_FROM[model]
    for one_core_busy in busy:
      spinner = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 if one_core_busy else None)
      try:
        rows = [one_run(model, steps, steady_from, quick) for _ in range(runs)]
      finally:
        if spinner is not None:
          spinner.kill()
          spinner.wait()
      result.figures[f"{model}, {'one core busy' if one_core_busy else 'quiet'}"] = rows
  return result.done()


def render(result: harness.Result) -> str:
  lines = ["## The first process's host-memory decision: page faults per step after tuning",
           "", result.machine, result.load_line(),
           "Command: `benchmarks/run.py first_process_faults` (the module's docstring says "
           "what each model runs). Per fresh process: the step at which `tj.jit`'s "
           "measurement decided (none: it did not), and in the steady state (CNN steps "
           "132-200, LM steps 20-60) the mean page faults and system time per step, the "
           f"steps that faulted over {FAULTING:,} pages, and the median step time.", "",
           "| model, machine | run | load | decided at step | faults per step, steady state "
           "| steps faulting | system ms per step | median ms per step | faults per step "
           "before it |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name, rows in result.figures.items():
    for i, r in enumerate(rows, 1):
      lines.append(f"| {name} | {i} | {r['load']:.1f} | {r['decided_at'] or 'none'} | "
                   f"{r['faults']:,.0f} | {r['faulting']} of {r['steps']} | "
                   f"{r['system_ms']:.1f} | {r['step_ms']:.1f} | {r['early_faults']:,.0f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  workers.run_worker(worker)
