"""Host memory: the same CPU train steps with tunedjax's malloc settings, without, and as decided.

`import tunedjax` sets glibc's malloc so that XLA:CPU's per-step temporary
buffer is reused instead of mapped and faulted in again every step, where a
measurement recorded that this pays (`tunedjax._host_memory`, auto mode, the
default). The settings act per process at import, so each variant runs in its
own worker process:

- **retain**: ``TUNEDJAX_HOST_MEMORY=retain`` (the settings forced);
- **auto, first process**: no variable, nothing decided yet: `tj.jit` measures
  its program's first calls, and where the settings pay sets what can act
  mid-process at once (its programs' temporaries come in blocks of at most
  48 MiB, which XLA's threads' arenas keep) and records the decision;
- **auto, next process**: no variable, started after the first one recorded
  (same workload, same decisions folder): the settings as decided;
- **opt-out**: ``TUNEDJAX_HOST_MEMORY=default`` (glibc's malloc untouched);
- **A/A control**: a second retain process.

The parent tunes each step once into a cache the workers then read, so nothing
is tuned while timing. Each round asks every worker for one timed run, in a
rotated order, one worker at a time; a run is 5 steps of each program
(`jax.jit` and `tj.jit` with kernel selection), with the process's minor page
faults and system CPU time per step. The third step, `jit_overhead.py`'s small
MLP (40x the steps per run), is host-bound: it never faults, so auto mode must
leave it alone. Ratios are medians of per-round ratios against retain.

Run: ``.venv/bin/python benchmarks/run.py host_memory [--quick] [--write]``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile

import harness
from harness import workers

VARIANTS = {"retain": {"TUNEDJAX_HOST_MEMORY": "retain"}, "auto, first process": {},
            "auto, next process": {}, "opt-out": {"TUNEDJAX_HOST_MEMORY": "default"},
            "A/A control": {"TUNEDJAX_HOST_MEMORY": "retain"}}
# The two auto processes share a decisions folder (the first records, the next reads).
DECIDING = ("auto, first process", "auto, next process")
PROGRAMS = ("jax.jit", "tj.jit (kernel selection)")
NETS = ("mobilenet", "demo", "mlp")


# -- the worker ------------------------------------------------------------------------------


def worker(net: str, cache_dir: str, quick: bool, reps: int) -> None:
  """Builds `net`'s step under both programs, then answers "run" lines with timings."""
  # tunedjax first: the settings are decided before JAX starts its threads, from this
  # worker's environment (vs_pytorch would set TUNEDJAX_HOST_MEMORY=retain where it is
  # unset).
  import tunedjax as tj  # pylint: disable=import-outside-toplevel
  sys.modules["torch"] = None  # vs_pytorch's JAX side only: no PyTorch in this process
  import jax  # pylint: disable=import-outside-toplevel
  import vs_pytorch  # pylint: disable=import-outside-toplevel

  if net == "mlp":  # host-bound: what one arena costs a small step's dispatch, if anything
    step, args = workers.mlp_problem()
    reps *= 40
  else:
    step, args = vs_pytorch.net_problem(net, quick)[:2]
  config = {"kernel": {"enable": True}, "cache": {"dir": cache_dir}}
  programs = {"jax.jit": jax.jit(step)}
  with tj.config_context(config):
    programs["tj.jit (kernel selection)"] = tj.jit(step)

  def run(fn):
    with tj.config_context(config):
      return jax.block_until_ready(fn(*args))

  for fn in programs.values():  # tj.jit's first measurement: calls 4-11 (auto mode)
    for _ in range(12 if fn is programs["tj.jit (kernel selection)"] else 2):
      run(fn)

  workers.serve(lambda: {name: workers.per_step(lambda fn=fn: run(fn), reps)
                         for name, fn in programs.items()}, tj.host_memory_status().to_dict())


# -- the parent ------------------------------------------------------------------------------


def _spawn(net: str, cache_dir: str, quick: bool, reps: int, extra_env: dict[str, str],
           decisions: str | None = None):
  # Where host-memory decisions are read and recorded (the kernel choices: `cache_dir`).
  env = workers.user_env(**extra_env, TUNEDJAX_CACHE_DIR=decisions or tempfile.mkdtemp(
      prefix="tunedjax-decisions-"))
  return workers.spawn(workers.command(__file__, net=net, cache_dir=cache_dir, quick=quick,
                                       reps=reps), env)


def _one_net(net: str, quick: bool, rounds: int, reps: int) -> dict:
  """Tunes `net` once, then times every variant's worker in rotated rounds."""
  cache_dir = tempfile.mkdtemp(prefix="tunedjax-host-memory-")
  tuner = _spawn(net, cache_dir, quick, reps, VARIANTS["retain"])  # tunes, then exits
  status = tuner.reply()["ready"]
  tuner.close()
  decisions = tempfile.mkdtemp(prefix="tunedjax-host-memory-decisions-")
  procs, statuses = {}, {}
  for name, env in VARIANTS.items():  # one at a time: the next auto process reads the first's
    procs[name] = _spawn(net, cache_dir, quick, reps, env, decisions if name in DECIDING else None)
    statuses[name] = procs[name].reply()["ready"]
  return {"net": net, "runs": workers.run_rounds(procs, rounds), "statuses": statuses,
          "tuner": status}


def measure(quick: bool = False) -> harness.Result:
  rounds, reps = (2, 2) if quick else (9, 5)
  return harness.Result("host_memory", params={"quick": quick, "rounds": rounds, "reps": reps},
                        figures={"nets": [_one_net(n, quick, rounds, reps) for n in NETS]})


def _ms(seconds: float) -> str:
  """Milliseconds with three significant digits or one decimal: 0.153, 28.1, 1054.0."""
  ms = 1e3 * seconds
  return f"{ms:.3g}" if ms < 10 else f"{ms:.1f}"


def _row(result: dict, program: str) -> str:
  runs = result["runs"]

  def per(name, key):
    return [r[program][key] for r in runs[name]]

  def ratio(name):
    return statistics.median(t / b for t, b in zip(per(name, "s"), per("retain", "s")))

  shown = ("retain", *DECIDING, "opt-out")
  cells = [result["net"], program, *(_ms(statistics.median(per(n, "s"))) for n in shown),
           *(f"{ratio(n):.2f}" for n in (*DECIDING, "opt-out", "A/A control")),
           " / ".join(f"{statistics.median(per(n, 'faults')):,.0f}" for n in shown),
           " / ".join(f"{1e3 * statistics.median(per(n, 'sys_s')):.1f}" for n in shown)]
  return "| " + " | ".join(cells) + " |"


def render(result: harness.Result) -> str:
  results, p = result.figures["nets"], result.params
  statuses = results[0]["statuses"]
  lines = [
      "## Host memory: a CPU step with and without tunedjax's malloc settings",
      "",
      (f"`benchmarks/run.py host_memory{' --quick' if p['quick'] else ''}`: the train steps of "
       "`benchmarks/vs_pytorch.py` (one SGD step, same weights and batch) and "
       "`jit_overhead.py`'s small MLP step, each variant in its own worker process: "
       f"**retain** (`TUNEDJAX_HOST_MEMORY=retain`), **auto, first** (no variable, nothing "
       f"decided at import; after its calls 4-11: {statuses['auto, first process']['reason']}), "
       "**auto, next** (no "
       "variable, started after the first recorded its measurement; for the MobileNet step: "
       f"{statuses['auto, next process']['reason']}), **opt-out** "
       "(`TUNEDJAX_HOST_MEMORY=default`) and a second retain process as the A/A control. "
       f"{p['rounds']} rounds in a rotated order, one process at a time; a run is "
       f"{p['reps']} steps of each program (the MLP: {40 * p['reps']}); ratios = the "
       "variant's time over retain's (median of per-round ratios; 1: as fast as with the "
       "settings). Page faults and system CPU time are the worker's, per step (`getrusage`). "
       "The kernel choices come from one tuning run shared by all workers. "
       f"{result.load_line()} {result.machine}"),
      "",
      ("| step | program | retain (ms) | auto, first (ms) | auto, next (ms) | opt-out (ms) | "
       "first / retain | next / retain | opt-out / retain | A/A | page faults per step, "
       "retain / first / next / opt-out | system CPU ms per step, same order |"),
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for result in results:
    lines += [_row(result, program) for program in PROGRAMS]
  return "\n".join(lines)


if __name__ == "__main__":
  workers.run_worker(worker)
