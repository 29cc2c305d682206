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
rotated order, one worker at a time; a run is `--reps` steps of each program
(`jax.jit` and `tj.jit` with kernel selection), with the process's minor page
faults and system CPU time per step. The third step, `jit_overhead.py`'s small
MLP (40x the steps per run), is host-bound: it never faults, so auto mode must
leave it alone. Ratios are medians of per-round ratios against retain.

Run: ``PYTHONPATH=src:benchmarks python benchmarks/host_memory.py [--write]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from harness import workers as _workers

ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = {"retain": {"TUNEDJAX_HOST_MEMORY": "retain"}, "auto, first process": {},
            "auto, next process": {}, "opt-out": {"TUNEDJAX_HOST_MEMORY": "default"},
            "A/A control": {"TUNEDJAX_HOST_MEMORY": "retain"}}
# The two auto processes share a decisions folder (the first records, the next reads).
DECIDING = ("auto, first process", "auto, next process")
PROGRAMS = ("jax.jit", "tj.jit (kernel selection)")
NETS = ("mobilenet", "demo", "mlp")
SECTION = "host_memory"


# -- the worker ------------------------------------------------------------------------------


def worker(net: str, cache_dir: str, quick: bool, reps: int) -> None:
  """Builds `net`'s step under both programs, then answers "run" lines with timings."""
  import resource  # pylint: disable=import-outside-toplevel

  # tunedjax first: the settings are decided before JAX starts its threads, from this
  # worker's environment (vs_pytorch would set TUNEDJAX_HOST_MEMORY=retain where it is
  # unset). The flag keeps vs_pytorch from re-running itself in the torch venv.
  import tunedjax as tj  # pylint: disable=import-outside-toplevel
  os.environ["TUNEDJAX_VS_PYTORCH_REEXEC"] = "1"
  sys.modules["torch"] = None  # vs_pytorch's JAX side only: no PyTorch in this process
  import jax  # pylint: disable=import-outside-toplevel
  import vs_pytorch  # pylint: disable=import-outside-toplevel

  if net == "mlp":  # host-bound: what one arena costs a small step's dispatch, if anything
    step, args = _workers.mlp_problem()
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

  for fn in programs.values():  # tj.jit measures calls 4-6 of its program (auto mode)
    for _ in range(7 if fn is programs["tj.jit (kernel selection)"] else 2):
      run(fn)
  print(json.dumps({"ready": tj.host_memory_status().to_dict()}), flush=True)
  for line in sys.stdin:
    if line.strip() != "run":
      break
    out = {}
    for name, fn in programs.items():
      before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
      for _ in range(reps):
        run(fn)
      wall = time.perf_counter() - start
      after = resource.getrusage(resource.RUSAGE_SELF)
      out[name] = {"s": wall / reps, "faults": (after.ru_minflt - before.ru_minflt) / reps,
                   "sys_s": (after.ru_stime - before.ru_stime) / reps}
    print(json.dumps(out), flush=True)


# -- the parent ------------------------------------------------------------------------------


def _spawn(net: str, cache_dir: str, args: argparse.Namespace, extra_env: dict[str, str],
           decisions: str | None = None) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items()  # no allocator settings but the variant's
         if k not in ("TUNEDJAX_HOST_MEMORY", "TUNEDJAX_CACHE_DIR", "GLIBC_TUNABLES")
         and not k.startswith("MALLOC_")}
  env.update(extra_env)
  # Where host-memory decisions are read and recorded (the kernel choices: `cache_dir`).
  env["TUNEDJAX_CACHE_DIR"] = decisions or tempfile.mkdtemp(prefix="tunedjax-decisions-")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                    env.get("PYTHONPATH")]))
  cmd = [sys.executable, __file__, "--worker", net, "--cache", cache_dir,
         "--reps", str(args.reps)] + (["--quick"] if args.quick else [])
  return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env=env)


def measure(net: str, args: argparse.Namespace) -> dict:
  """Tunes `net` once, then times every variant's worker in rotated rounds."""
  cache_dir = tempfile.mkdtemp(prefix="tunedjax-host-memory-")
  tuner = _spawn(net, cache_dir, args, VARIANTS["retain"])  # tunes into the cache, then exits
  status = _workers.reply(tuner)["ready"]
  tuner.communicate("")
  decisions = tempfile.mkdtemp(prefix="tunedjax-host-memory-decisions-")
  procs, statuses = {}, {}
  for name, env in VARIANTS.items():  # one at a time: the next auto process reads the first's
    procs[name] = _spawn(net, cache_dir, args, env, decisions if name in DECIDING else None)
    statuses[name] = _workers.reply(procs[name])["ready"]
  names = list(procs)
  runs: dict[str, list[dict]] = {n: [] for n in names}
  for r in range(args.rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      procs[name].stdin.write("run\n")
      procs[name].stdin.flush()
      runs[name].append(_workers.reply(procs[name]))
  for p in procs.values():
    p.communicate("")
  return {"net": net, "runs": runs, "statuses": statuses, "tuner": status}


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


def report(results: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> str:
  import harness as _harness  # pylint: disable=import-outside-toplevel
  statuses = results[0]["statuses"]
  lines = [
      "## Host memory: a CPU step with and without tunedjax's malloc settings",
      "",
      (f"`benchmarks/host_memory.py{' --quick' if args.quick else ''}`: the train steps of "
       "`benchmarks/vs_pytorch.py` (one SGD step, same weights and batch) and "
       "`jit_overhead.py`'s small MLP step, each variant in its own worker process: "
       f"**retain** (`TUNEDJAX_HOST_MEMORY=retain`), **auto, first** (no variable, nothing "
       f"decided at import; after its calls 4-6: {statuses['auto, first process']['reason']}), "
       "**auto, next** (no "
       "variable, started after the first recorded its measurement; for the MobileNet step: "
       f"{statuses['auto, next process']['reason']}), **opt-out** "
       "(`TUNEDJAX_HOST_MEMORY=default`) and a second retain process as the A/A control. "
       f"{args.rounds} rounds in a rotated order, one process at a time; a run is "
       f"{args.reps} steps of each program (the MLP: {40 * args.reps}); ratios = the "
       "variant's time over retain's (median of per-round ratios; 1: as fast as with the "
       "settings). Page faults and system CPU time are the worker's, per step (`getrusage`). "
       "The kernel choices come from one tuning run shared by all workers. Load average "
       f"{load[0]:.1f} before, {load[1]:.1f} after. " + _harness.machine_line()),
      "",
      ("| step | program | retain (ms) | auto, first (ms) | auto, next (ms) | opt-out (ms) | "
       "first / retain | next / retain | opt-out / retain | A/A | page faults per step, "
       "retain / first / next / opt-out | system CPU ms per step, same order |"),
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for result in results:
    lines += [_row(result, program) for program in PROGRAMS]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds (smoke)")
  parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--reps", type=int, default=None, help="steps per timed run")
  parser.add_argument("--net", choices=(*NETS, "all"), default=["all"], nargs="+")
  parser.add_argument("--worker", choices=NETS, help=argparse.SUPPRESS)
  parser.add_argument("--cache", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.rounds = args.rounds or (2 if args.quick else 9)
  args.reps = args.reps or (2 if args.quick else 5)
  if args.worker:
    worker(args.worker, args.cache, args.quick, args.reps)
    return 0
  nets = NETS if "all" in args.net else tuple(args.net)
  load0 = os.getloadavg()[0]
  results = [measure(net, args) for net in nets]
  text = report(results, args, (load0, os.getloadavg()[0]))
  print(text)
  if args.write and not args.quick:
    import harness as _harness  # pylint: disable=import-outside-toplevel
    _harness.write_section(SECTION, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
