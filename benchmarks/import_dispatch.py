"""A tiny jitted call's dispatch with `import tunedjax` and without, each in its own process.

`import tunedjax` decides the host-memory settings (`tunedjax._host_memory`,
auto mode): it must leave a process that makes many tiny calls as fast as one
that never imported tunedjax. This times `jit_overhead.py`'s steady state (its
small MLP train step, 200 calls dispatched without waiting, then one wait; a
run is the median of 5 such batches) in worker processes that differ only in
what they imported and what the tuning cache holds:

- **no tunedjax**: ``import jax`` only, `jax.jit` (the baseline; run twice: A/A);
- **tunedjax imported, first process**: ``import tunedjax`` first (auto mode,
  an empty cache: nothing recorded for this workload), then `jax.jit`, and
  `tunedjax.jit` (which measures its first calls' page faults and would act
  in this process where they paid);
- **tunedjax imported, later process**: `tunedjax.jit` in a process started
  after a first one of the same workload ended on that cache folder;
- **... decision for another workload**: a first process with a recorded "the
  settings pay" decision for another workload (a CNN training script) on this
  machine in the cache, which must not apply here.

Each round asks every worker for one run, in a rotated order, one worker at a
time; ratios are medians of per-round ratios against the baseline.

Run: ``.venv/bin/python benchmarks/run.py import_dispatch [--quick] [--write]``.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time

import harness
from harness import workers

ROOT = pathlib.Path(__file__).resolve().parent.parent
CALLS = 200  # jit_overhead.CALLS_PER_RUN
BATCHES = 5  # a run: the median of 5 batches of CALLS calls
BASE, CONTROL = "jax.jit, no tunedjax", "A/A: jax.jit, no tunedjax"
LATER = "tj.jit, tunedjax imported, later process"
# name: (imports tunedjax, program, the cache folder: "empty", "another workload's decision"
# or "after a first process" of this workload)
VARIANTS = {
    BASE: (False, "jax.jit", "empty"),
    CONTROL: (False, "jax.jit", "empty"),
    "jax.jit, tunedjax imported, first process": (True, "jax.jit", "empty"),
    "tj.jit, tunedjax imported, first process": (True, "tj.jit", "empty"),
    LATER: (True, "tj.jit", "after a first process"),
    "jax.jit, tunedjax imported, decision for another workload": (
        True, "jax.jit", "another workload's decision"),
    "tj.jit, tunedjax imported, decision for another workload": (
        True, "tj.jit", "another workload's decision"),
}


def worker(imports_tunedjax: bool, program: str) -> None:
  if imports_tunedjax:
    import tunedjax as tj  # pylint: disable=import-outside-toplevel  # first, as users do
  import jax  # pylint: disable=import-outside-toplevel
  step, args = workers.mlp_problem()
  fn = tj.jit(step) if program == "tj.jit" else jax.jit(step)

  def run():
    out = None
    for _ in range(CALLS):
      out = fn(*args)
    jax.block_until_ready(out)

  for _ in range(3):
    run()

  def timed():
    times = []
    for _ in range(BATCHES):  # the median batch: one load spike does not move a run
      start = time.perf_counter()
      run()
      times.append((time.perf_counter() - start) / CALLS * 1e6)
    return {"us": statistics.median(times)}

  workers.serve(timed, tj.host_memory_status().to_dict() if imports_tunedjax else None)


def _another_workloads_decision(folder: str) -> None:
  """Records, as a measurement would, that the settings pay for a CNN training script."""
  sys.path.insert(0, str(ROOT / "src"))
  from tunedjax._host_memory import _decisions  # pylint: disable=import-outside-toplevel
  record = _decisions.record_for("script /home/user/train_cnn.py", faults=17_938.0,
                                 system_s=0.0321, wall_s=0.0462, program="train_step")
  assert record["pays"] and _decisions.store(pathlib.Path(folder), record)


def _spawn(name: str, folder: str):
  imports, program, _ = VARIANTS[name]
  return workers.spawn(workers.command(__file__, imports_tunedjax=imports, program=program),
                       workers.user_env(TUNEDJAX_CACHE_DIR=folder))


def measure(quick: bool = False) -> harness.Result:
  """Starts every variant's worker, then asks each for a run per round."""
  rounds = 2 if quick else 40
  procs, statuses = {}, {}
  for name, (_, _, cache) in VARIANTS.items():
    folder = tempfile.mkdtemp(prefix="tunedjax-dispatch-")  # each process its own
    if cache == "another workload's decision":
      _another_workloads_decision(folder)
    elif cache == "after a first process":  # runs, measures, ends: records what it found
      first = _spawn(name, folder)
      first.reply()
      first.close()
    procs[name] = _spawn(name, folder)
    statuses[name] = procs[name].reply()["ready"]
  runs = {n: [r["us"] for r in rs] for n, rs in workers.run_rounds(procs, rounds).items()}
  return harness.Result("import_dispatch", params={"rounds": rounds},
                        figures={"runs": runs, "statuses": statuses})


def render(result: harness.Result) -> str:
  runs, statuses = result.figures["runs"], result.figures["statuses"]
  rounds = result.params["rounds"]
  ratio = {n: [t / b for t, b in zip(runs[n], runs[BASE])] for n in runs}
  lines = [
      "## Dispatch: a tiny jitted call with `import tunedjax` and without",
      "",
      "`benchmarks/run.py import_dispatch`: `jit_overhead.py`'s steady state "
      f"(its MLP train step, {CALLS} calls dispatched without waiting, then one wait; a run "
      f"is the median of {BATCHES} such batches), each variant in "
      "a worker process of its own, started with no `TUNEDJAX_*` or `MALLOC_*` variables "
      f"(auto mode), each on a cache folder of its own (a first process: empty; a later "
      "process: after a first one of this workload ended on it); "
      f"{rounds} rounds in a rotated order, one process at a time; ratio = median "
      "of per-round ratios to the baseline (`jax.jit` without tunedjax). "
      f"{result.load_line()} {result.machine}",
      "",
      "| variant | us per call | ratio | range | host memory in that process |",
      "|---|---:|---:|---:|---|",
  ]
  for name in runs:
    status = statuses[name]
    memory = ("(tunedjax not imported)" if status is None else
              f"{status['mode']}, {'applied' if status['applied'] else 'not applied'}")
    lines.append(f"| {name} | {statistics.median(runs[name]):.1f} | "
                 f"{statistics.median(ratio[name]):.3f} | "
                 f"{min(ratio[name]):.2f}-{max(ratio[name]):.2f} | {memory} |")
  return "\n".join(lines)


if __name__ == "__main__":
  workers.run_worker(worker)
