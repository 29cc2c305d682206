"""The first process: a CPU training step in its first process and its next, against PyTorch.

A person trying tunedjax runs a script once and judges it by that run. This
times the MobileNet-style train step written in plain JAX (`vs_pytorch.py`'s
``mobilenet-plain``: batch norm in primitive ops) under `tj.jit` with kernel
selection, the way a user's script runs it, each variant in a fresh worker
process:

- **PyTorch eager, channels_last** (the baseline) and **NCHW**: the same
  network, weights and batch (`vs_pytorch.py`'s), PyTorch alone in its
  process, 2 threads; and channels_last on 1 thread (on a loaded machine
  PyTorch's two OpenMP threads wait for each other: one can be faster);
- **tunedjax, first process**: host memory ``auto`` (no variable), an empty
  tuning-cache folder: the first call tunes, `tj.jit` measures calls 4 to 11,
  and decides in this process;
- **tunedjax, second process**: the same script started again on that folder
  once the first has decided (the decision applied at import);
- **tunedjax, malloc left alone**: ``TUNEDJAX_HOST_MEMORY=default`` (what a
  first process ran with before it could act in-process);
- **tunedjax, one arena, temporaries in one block**: tunedjax's import-time
  settings given through ``MALLOC_*`` variables, so tunedjax leaves malloc and
  XLA's heaps alone (what a second process ran with before its programs split
  their temporaries);
- **A/A control**: a second PyTorch channels_last process.

Each tunedjax worker makes 8 calls before timing (the first tunes and
compiles). Each round asks every worker, in a rotated order, one at a time,
for 2 untimed steps and then 5 timed back to back (their mean: a training
loop's steady state); 7 rounds. Speed = PyTorch's time over the variant's, the
median of per-round ratios (over 1: faster than PyTorch). Page faults and
system CPU time are the worker's, per timed step (`getrusage`).

Run: ``.venv/bin/python benchmarks/run.py first_process [--quick] [--write]``
(PyTorch from this interpreter, else ``.venv-torch``; without it the tunedjax
rows are timed against each other only).
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time
import types

import harness
from harness import workers

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE, NCHW, CONTROL = "PyTorch eager, channels_last", "PyTorch eager, NCHW", "A/A control"
ONE_THREAD = "PyTorch eager, channels_last, 1 thread"
PYTORCH = (BASE, NCHW, ONE_THREAD)
FIRST, SECOND = "tunedjax, first process", "tunedjax, second process"
LEFT_ALONE = "tunedjax, malloc left alone"
ONE_BLOCK = "tunedjax, one arena, temporaries in one block"
# name: (worker kind, its host-memory mode or layout, shares the first process's folder)
VARIANTS = {BASE: ("torch", "channels_last", False), NCHW: ("torch", "NCHW", False),
            ONE_THREAD: ("torch", "channels_last:1", False),
            FIRST: ("tunedjax", "auto", True), SECOND: ("tunedjax", "auto", True),
            LEFT_ALONE: ("tunedjax", "default", True), ONE_BLOCK: ("tunedjax", "auto", True),
            CONTROL: ("torch", "channels_last", False)}
# tunedjax's import-time settings, set by the environment (tunedjax then leaves them alone).
ENVIRONMENT_SETTINGS = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                        "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
WARM_CALLS = 12  # tunes (call 1); its first measurement (calls 4-11) ends before timing


# -- the workers -----------------------------------------------------------------------------


def _serve(run, untimed: int, steps: int, ready: dict) -> None:
  workers.serve(lambda: workers.per_step(run, steps, untimed), ready)


def worker(kind: str, what: str, quick: bool, untimed: int, steps: int) -> None:
  """The worker process `command` starts: tunedjax's or PyTorch's."""
  if kind == "tunedjax":
    tunedjax_worker(quick, untimed, steps)
  else:
    torch_worker(what, quick, untimed, steps)


def tunedjax_worker(quick: bool, untimed: int, steps: int) -> None:
  """The user's script: `import tunedjax` first, the step under `tj.jit`, kernel selection on."""
  import tunedjax as tj  # pylint: disable=import-outside-toplevel
  sys.modules["torch"] = None  # vs_pytorch's JAX side only: no PyTorch in this process
  import jax  # pylint: disable=import-outside-toplevel
  import vs_pytorch  # pylint: disable=import-outside-toplevel
  step, args = vs_pytorch.net_problem("mobilenet-plain", quick)[:2]
  tj.set_config({"kernel": {"enable": True}})
  fn = tj.jit(step)

  def run():
    return jax.block_until_ready(fn(*args))

  start = time.perf_counter()
  run()
  first_s = time.perf_counter() - start
  warm = workers.per_step(run, WARM_CALLS - 1)
  _serve(run, untimed, steps, {"status": tj.host_memory_status().to_dict(),
                               "first_call_s": first_s, "warm_faults": warm["faults"]})


def torch_worker(what: str, quick: bool, untimed: int, steps: int) -> None:
  """PyTorch eager on the same network, weights and batch; no tunedjax settings.
  `what`: the layout, and ``:threads`` (default 2)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import vs_pytorch  # pylint: disable=import-outside-toplevel
  layout, _, threads = what.partition(":")
  torch = vs_pytorch.torch
  torch.manual_seed(0)
  torch.set_num_threads(int(threads or 2))
  _, full_args, _, _ = vs_pytorch.net_problem("mobilenet-plain", quick)
  params, x, y = full_args[0], full_args[-2], full_args[-1]
  model = vs_pytorch.TorchMobileNet()
  vs_pytorch.load_torch(model, "mobilenet-plain", vs_pytorch.flat_names(params))
  xt = torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())
  if layout == "channels_last":
    model = model.to(memory_format=torch.channels_last)
    xt = xt.contiguous(memory_format=torch.channels_last)
  model.train()
  step = vs_pytorch.torch_step(model, torch.optim.SGD(model.parameters(), lr=vs_pytorch.LR),
                               xt, torch.from_numpy(np.asarray(y).astype(np.int64)))
  for _ in range(3):
    step()
  _serve(step, untimed, steps, {"layout": layout})


# -- the parent ------------------------------------------------------------------------------


def _torch_python() -> str | None:
  """An interpreter with PyTorch: this one, else ``.venv-torch``'s; None without."""
  try:
    import torch  # pylint: disable=import-outside-toplevel,unused-import
    return sys.executable
  except ImportError:
    python = ROOT / ".venv-torch" / "bin" / "python"
    return str(python) if python.exists() else None


def _spawn(name: str, folder: str, p: dict, torch_python: str | None):
  kind, what, _ = VARIANTS[name]
  env = workers.user_env(TUNEDJAX_CACHE_DIR=folder)  # a user's environment
  if kind == "tunedjax":
    env["TUNEDJAX_HOST_MEMORY"] = what
    if name == ONE_BLOCK:
      env.update(ENVIRONMENT_SETTINGS)
  else:  # PyTorch alone: tunedjax (imported by vs_pytorch) leaves malloc as it is
    env["TUNEDJAX_HOST_MEMORY"] = "default"
  return workers.spawn(workers.command(
      __file__, python=torch_python if kind == "torch" else None, kind=kind, what=what,
      quick=p["quick"], untimed=p["untimed"], steps=p["steps"]), env)


def measure(quick: bool = False) -> harness.Result:
  """Starts the workers one at a time (the second after the first decided), then rounds."""
  p = {"quick": quick, "rounds": 2 if quick else 7, "untimed": 1 if quick else 2,
       "steps": 2 if quick else 5}
  torch_python = _torch_python()
  if not torch_python:
    print("torch is not installed here: the tunedjax rows only", file=sys.stderr)
  names = [n for n in VARIANTS if VARIANTS[n][0] == "tunedjax" or torch_python]
  shared = tempfile.mkdtemp(prefix="tunedjax-first-process-")  # empty: the first process's
  procs, ready = {}, {}
  for name in names:  # the later tunedjax ones read the kernels the first process tuned
    folder = shared if VARIANTS[name][2] else tempfile.mkdtemp(prefix="tunedjax-first-")
    procs[name] = _spawn(name, folder, p, torch_python)
    ready[name] = procs[name].reply()["ready"]
  runs = workers.run_rounds(procs, p["rounds"])
  return harness.Result("first_process", params={**p, "torch": bool(torch_python)},
                        figures={"runs": runs, "ready": ready})


def _speed(runs: dict[str, list[dict]], name: str, against: str | None) -> list[float]:
  """Per-round speed: `against`'s time over `name`'s (None: the fastest PyTorch variant)."""
  if against is None:
    base = [min(r["s"] for r in rs)
            for rs in zip(*(runs[n] for n in PYTORCH))]
  else:
    base = [r["s"] for r in runs[against]]
  return [b / r["s"] for r, b in zip(runs[name], base)]


def render(result: harness.Result) -> str:
  runs, ready = result.figures["runs"], result.figures["ready"]
  args = types.SimpleNamespace(**result.params)
  ref = BASE if args.torch else FIRST
  first = ready[FIRST]["status"]
  lines = [
      "## The first process: a CPU training step in its first run, against PyTorch",
      "",
      (f"`benchmarks/run.py first_process`: the MobileNet-style step in "
       "plain JAX (`vs_pytorch.py`'s `mobilenet-plain`, batch "
       f"{'4, 32x32' if args.quick else '32, 64x64'}) under `tj.jit` with kernel selection, "
       "each variant a fresh worker process started as a user's script is (no `TUNEDJAX_*` "
       "or `MALLOC_*` variables but the variant's): **first process** on an empty "
       "tuning-cache folder (it tunes, measures and decides in-process), **second "
       "process** started on that folder after it, **malloc left alone** "
       "(`TUNEDJAX_HOST_MEMORY=default`: the first process before it could act in-process), "
       "**one arena, temporaries in one block** (the import-time settings through `MALLOC_*` "
       "variables, so tunedjax leaves XLA's heaps alone: the second process before its "
       "programs split their temporaries), and PyTorch eager alone in its own processes "
       f"(2 threads; channels_last also on 1). {WARM_CALLS} calls of each tunedjax worker "
       "before timing; a round asks each worker, in a rotated order, for "
       f"{args.untimed} untimed steps and then "
       f"{args.steps} timed back to back (their mean); {args.rounds} rounds; speed = "
       f"{ref}'s time over the variant's (median of per-round ratios; over 1: faster). "
       "Speed vs the fastest PyTorch variant: against the fastest of the three PyTorch "
       "rows in each round. Page faults and system CPU time per timed step (`getrusage`). "
       f"{result.load_line()} {result.machine}"),
      "",
      (f"First process: host memory {'applied' if first['applied'] else 'not applied'} "
       f"({', '.join(f'{k}={v}' for k, v in first['settings'].items()) or 'nothing set'}); "
       f"first call {ready[FIRST]['first_call_s']:.1f} s (tuning and compiling); page faults "
       f"per call over calls 2-{WARM_CALLS}: {ready[FIRST]['warm_faults']:,.0f}. Second "
       f"process: {'applied' if ready[SECOND]['status']['applied'] else 'not applied'} at "
       "import."),
      "",
  ]
  header = "| variant | ms per step | speed vs " + ref + " |"
  rule = "|---|---:|---:|"
  if args.torch:
    header += " speed vs the fastest PyTorch variant (per round) |"
    rule += "---:|"
  lines += [header + " per-round range | page faults per step | system ms per step |",
            rule + "---:|---:|---:|"]
  for name in runs:
    speed = _speed(runs, name, ref)
    row = [name, f"{1e3 * statistics.median(r['s'] for r in runs[name]):.1f}",
           f"{statistics.median(speed):.2f}x"]
    if args.torch:
      row.append(f"{statistics.median(_speed(runs, name, None)):.2f}x")
    row += [f"{min(speed):.2f}-{max(speed):.2f}",
            f"{statistics.median(r['faults'] for r in runs[name]):,.0f}",
            f"{1e3 * statistics.median(r['sys_s'] for r in runs[name]):.1f}"]
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  workers.run_worker(worker)
