"""GPU benchmarks: tunedjax against `jax.jit`, cuDNN and PyTorch, in one command.

Parts, each a few worker processes (`_gpu_names.PLAN`: their time limits): the
Flax ImageNet example's ResNet-50 (`jax.jit` float32 and bfloat16, three `tj.jit`
configurations, torchvision's; `_gpu_resnet`), causal self-attention at 2,048 and
8,192 tokens (hand-written, cuDNN's, `tj.jit` over `tj.attention` and over the
hand-written one, PyTorch's SDPA; `_gpu_attention`), `tj.Trainer` on a miniGPT
with ``autotune`` off and on (`_gpu_lm`), ResNet-50's convolution buckets
(``pallas`` against XLA) and a float16 NCHW ResNet-50 with and without the layout
pass (`_gpu_resnet`); the PyTorch rows in `_gpu_torch`.

The workers speak `harness.workers`' protocol: each reports its records as it
measures, paces itself to its time limit, and is killed a few seconds past it
(what it reported is kept, and its stack dump shows where it was). Every
tunedjax variant's first-call anatomy (`f.report().last.first_call`) is
recorded. ``measure(quick=True)`` runs every part at tiny sizes on any backend
(Pallas in interpret mode off a GPU): a check that it runs, no figures.

Run: ``benchmarks/run.py gpu [--quick] [--write] [--json]``; other runs are
`measure`'s keyword arguments (``parts``, ``rounds``, ``budgets``, ``total_s``,
``jobs``). BENCHMARKS.md, "GPU", gives the device command.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import _gpu_names as names
import _gpu_render
import harness
from harness import workers

TOTAL_S = 500.0  # all parts together, on a GPU: within the 9-minute device command
# A smoke run's programs are tiny and its figures meaningless: XLA compiles them unoptimised
# (4x faster on a CPU).
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def worker(name: str, smoke: bool, rounds: int | None) -> int:
  """One worker (``resnet50.jax``, ...): its part's variants, within its time limit."""
  import _gpu_measure as m  # pylint: disable=import-outside-toplevel  # imports JAX
  sizes = m.SMOKE if smoke else m.FULL
  sizes = dataclasses.replace(sizes, rounds=rounds or sizes.rounds)
  part, _, which = name.partition(".")
  workers.emit("env", sizes=dataclasses.asdict(sizes))
  if which != "torch":
    m.env_record()
    if m.jax.default_backend() != "gpu" and not smoke:
      workers.emit("no_gpu", backend=m.jax.default_backend())
      workers.say(f"gpu.py: no GPU here (backend {m.jax.default_backend()!r}); "
                  "run.py gpu --quick is a check run.")
      return 2
  m.part_worker(part, which)(sizes, m.Deadline())
  return 0


def _run(name: str, budget: float, smoke: bool, rounds: int | None,
         log: Callable[[str], None]) -> dict[str, Any]:
  """One worker, with a tuning cache of its own (empty: a new user's first call)."""
  log(f"gpu.py: {name} (at most {budget:.0f} s) ...")
  with tempfile.TemporaryDirectory(prefix="tunedjax-gpu-cache-") as cache:
    env = workers.user_env(TUNEDJAX_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    if smoke:  # tiny sizes: the C++ kernels' build and XLA's optimisations would be most of it
      env["TUNEDJAX_NATIVE"] = "0"
      env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    w = workers.spawn(workers.command(__file__, name=name, smoke=smoke, rounds=rounds), env,
                      name=name, budget_s=budget, echo=log).close()
  log(f"gpu.py: {name}: {w.status} after {w.seconds:.1f} s ({w.cpu_s:.1f} s of CPU)")
  if any(r.get("kind") == "no_gpu" for r in w.records):
    raise SystemExit(2)
  return w.to_dict()


def problems(figures: Mapping[str, Any]) -> list[str]:
  """Workers that failed and variants that raised (a smoke run must have none)."""
  found = []
  for part_name, part in figures["parts"].items():
    found += [f"{w['name']}: {w['status']}" for w in part["workers"]
              if w["status"] in ("failed", "budget")]
    for key, row in _gpu_render.merged_rows(part, *_gpu_render.KEYS).items():
      if row.get("error"):
        found.append(f"{part_name} {', '.join(str(k) for k in key if k is not None)}: "
                     f"{row['error']}")
  return found


def measure(quick: bool = False, *, parts: Sequence[str] = names.PARTS, rounds: int | None = None,
            budgets: Mapping[str, float] | None = None, total_s: float | None = None,
            jobs: int | None = None, echo: Callable[[str], None] | None = None
            ) -> harness.Result:
  """Runs each part's workers (on a GPU one at a time; `quick`: 2 at a time, tiny sizes).

  Args:
    quick: the smoke run: tiny sizes on any backend, no figures.
    parts: some of `_gpu_names.PARTS`.
    rounds: timed rounds (default 7; quick 2).
    budgets: ``{worker: seconds}``, time limits instead of `_gpu_names.PLAN`'s.
    total_s: all workers together at most this (default `TOTAL_S` on a GPU).
    jobs: workers at a time (more than 1 only with `quick`).
    echo: where the workers' lines go (default stderr).
  """
  workers.stop_on_sigterm()
  log = echo or (lambda line: print(line, file=sys.stderr, flush=True))
  jobs = jobs or (2 if quick else 1)
  known = [w for plan in names.PLAN.values() for w, _ in plan]
  if jobs > 1 and not quick or set(budgets or {}) - set(known) or set(parts) - set(names.PARTS):
    raise ValueError(f"jobs > 1 needs quick; budgets' workers: {known}; parts: {names.PARTS}")
  figures: dict[str, Any] = {
      "command": "benchmarks/run.py gpu" + " --quick" * quick,
      "date": datetime.date.today().isoformat(),
      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "smoke": quick, "env": {}, "parts": {p: {"seconds": 0.0, "workers": []} for p in parts}}
  end = time.monotonic() + (total_s or (1e9 if quick else TOTAL_S))

  def one(part: str, name: str, planned: float) -> tuple[str, dict[str, Any]]:
    limit = (budgets or {}).get(name, names.SMOKE_BUDGET_S if quick else planned)
    budget = min(limit, end - time.monotonic())
    if budget >= 5:
      return part, _run(name, budget, quick, rounds,
                        log if jobs == 1 else lambda line: log(f"[{name}] {line}"))
    log(f"gpu.py: {name}: not run (" + ("its time limit is under 5 s)" if limit < 5 else
                                       f"the run's {total_s or TOTAL_S:.0f} s are spent)"))
    return part, {"name": name, "budget_s": 0.0, "seconds": 0.0, "status": "skipped",
                  "records": []}

  plan = [(p, w, s) for p in parts for w, s in names.PLAN[p]]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for part, w in (map if jobs == 1 else pool.map)(lambda t: one(*t), plan):
      figures["parts"][part]["workers"].append(w)
      figures["parts"][part]["seconds"] += w["seconds"]
      for r in w["records"]:
        if r.get("kind") == "env":
          figures["env"].update({k: v for k, v in r.items() if k != "kind"})
  figures["problems"] = problems(figures)
  log("gpu.py: done; " + ("problems: " + "; ".join(figures["problems"]) if figures["problems"]
                          else "no problems"))
  return harness.Result("gpu", params={"quick": quick, "parts": list(parts), "rounds": rounds},
                        figures=figures, machine=figures["env"].get("machine", "")).done()


def render(result: harness.Result) -> dict[str, str]:
  """``{"gpu_<part>": markdown}`` for every part run."""
  return _gpu_render.sections(result.figures)


if __name__ == "__main__":
  workers.run_worker(worker)
