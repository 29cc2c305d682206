"""GPU benchmarks: tunedjax against `jax.jit`, cuDNN and PyTorch, in one command.

Parts (each a few worker processes; see `_gpu_names.PLAN` for their time limits):

a. ``resnet50``: the Flax ImageNet example's ResNet-50 (linen, BatchNorm), batch
   128, 224x224, SGD with momentum: `jax.jit` in float32 and with the example's
   ``dtype=bfloat16``; `tj.jit` with ``set_config(None)``, with
   ``set_config(None)`` plus mixed precision, and with mixed precision and layout
   but no kernel selection; torchvision's ResNet-50, channels_last, float32 and
   AMP bfloat16. First call (s) and images/s.
b. ``attention``: causal self-attention, bfloat16 [8, T, 16, 128], forward and
   backward, T = 2,048 and 8,192: hand-written under `jax.jit`, cuDNN's, `tj.jit`
   over ``tj.attention`` and over the hand-written one, PyTorch's SDPA. ms,
   ratio, TFLOP/s, first call.
c. ``lm``: `tj.Trainer` on a miniGPT (6 blocks, width 512, 8 heads, 1,024
   tokens, batch 16), ``autotune`` off against on, float32 and mixed precision.
d. ``conv_buckets`` (the ``pallas`` kernel against XLA/cuDNN per ResNet-50
   convolution) and ``layout_f16`` (a float16 NCHW ResNet-50 with and without
   the layout pass).

Each worker prints what it measures as it goes and stops itself at its time
limit (the driver kills it a few seconds later); what it printed is kept. The
first-call anatomy (`f.report().last.first_call`) of every tunedjax variant is
printed. ``--out DIR`` gets ``gpu.json`` (every figure), ``gpu.md`` (the
BENCHMARKS.md sections) and ``gpu.log``; ``--write`` rewrites BENCHMARKS.md's
``gpu_*`` sections; ``--render DIR/gpu.json --write`` does that later, from the
JSON of a run on another machine. ``--smoke`` runs every part at tiny sizes on
any backend (Pallas in interpret mode off a GPU): a check that it runs, no figures.

Run: ``python benchmarks/gpu.py [--smoke] [--write] [--out DIR] [--only PART ...]
[--rounds N] [--budget WORKER=SECONDS ...]``; BENCHMARKS.md, "GPU", gives the
device command.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import faulthandler
import json
import os
import pathlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import _gpu_names as names
import _gpu_render as render
import _gpu_run as run

SCRIPT = pathlib.Path(__file__).resolve()
TOTAL_S = 500.0  # all parts together, on a GPU: within the 9-minute device command
# A smoke run's programs are tiny and its figures meaningless: XLA compiles them unoptimised
# (4x faster on a CPU).
SMOKE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", "--quick", dest="smoke", action="store_true",
                 help="tiny sizes on any backend (a check that it runs, no figures)")
  p.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's gpu_* sections")
  p.add_argument("--out", help="folder for gpu.json, gpu.md and gpu.log")
  p.add_argument("--only", nargs="+", choices=names.PARTS, default=list(names.PARTS))
  p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7; smoke 2)")
  p.add_argument("--budget", nargs="+", default=[], metavar="WORKER=SECONDS",
                 help="a worker's time limit instead of the plan's")
  p.add_argument("--total-s", type=float, default=None,
                 help=f"all parts together at most this (default {TOTAL_S:.0f} s on a GPU)")
  p.add_argument("--jobs", type=int, default=None,
                 help="workers at a time, --smoke only (default 2 with --smoke, else 1)")
  p.add_argument("--render", metavar="JSON", help="make the sections from a run's gpu.json")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--until", type=float, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.jobs = args.jobs or (2 if args.smoke else 1)
  if args.jobs > 1 and not args.smoke:
    p.error("--jobs > 1 needs --smoke: on a GPU the workers run one at a time")
  return args


# --- a worker --------------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> int:
  """Runs one worker (``--worker NAME``) until ``--until`` (seconds since the epoch)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import _gpu_measure as measure  # pylint: disable=import-outside-toplevel  # imports JAX
  sizes = measure.SMOKE if args.smoke else measure.FULL
  if args.rounds:
    sizes = dataclasses.replace(sizes, rounds=args.rounds)
  deadline = run.Deadline(args.until - time.time())
  # Where it was, if its time runs out: every thread's stack, just before the driver kills it.
  faulthandler.dump_traceback_later(max(args.until - time.time() + 0.5, 1.0), exit=False)
  part, _, which = args.worker.partition(".")
  run.emit("env", sizes=dataclasses.asdict(sizes))
  if which != "torch":
    measure.env_record()
    backend = measure.jax.default_backend()
    if backend != "gpu" and not args.smoke:
      run.emit("no_gpu", backend=backend)
      run.say(f"gpu.py: no GPU here (backend {backend!r}); use --smoke for a check run.")
      return 2
  _workers(part, which)(sizes, deadline)
  return 0


def _workers(part: str, which: str) -> Any:
  # pylint: disable=import-outside-toplevel  # each worker imports only what it runs
  if which == "torch":
    import _gpu_torch
    return {"resnet50": _gpu_torch.worker_resnet, "attention": _gpu_torch.worker_attention}[part]
  if part == "resnet50":
    import _gpu_resnet
    return _gpu_resnet.WORKERS[which]
  if part == "attention":
    import _gpu_attention
    return _gpu_attention.WORKERS[which]
  if part == "lm":
    import _gpu_lm
    return _gpu_lm.WORKERS[which]
  import _gpu_conv
  return _gpu_conv.WORKERS[part]


# --- the driver ------------------------------------------------------------------------


class Log:
  """Prints (flushed) and keeps every line for ``--out``'s gpu.log; thread-safe."""

  def __init__(self, out: pathlib.Path | None):
    self.file = None if out is None else open(out / "gpu.log", "w", encoding="utf-8")
    self.lock = threading.Lock()

  def __call__(self, line: str) -> None:
    with self.lock:
      print(line, flush=True)
      if self.file is not None:
        self.file.write(line + "\n")
        self.file.flush()


def _budgets(args: argparse.Namespace) -> dict[str, float]:
  out = {}
  for item in args.budget:
    worker, _, seconds = item.partition("=")
    known = [w for plan in names.PLAN.values() for w, _ in plan]
    if worker not in known or not seconds:
      raise SystemExit(f"gpu.py: --budget {item!r}: expected WORKER=SECONDS, WORKER one of "
                       f"{', '.join(known)}")
    out[worker] = float(seconds)
  return out


def _worker_env(cache: str, smoke: bool) -> dict[str, str]:
  env = dict(os.environ, TUNEDJAX_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
  if smoke:  # tiny sizes: the C++ kernels' build and XLA's optimisations would be most of it
    env.setdefault("TUNEDJAX_NATIVE", "0")
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *SMOKE_XLA_FLAGS]).strip()
  return env


def run_worker(worker: str, budget: float, args: argparse.Namespace,
               log: Callable[[str], None]) -> run.WorkerResult:
  """One worker, with a tuning cache of its own (empty: a new user's first call)."""
  log(f"gpu.py: {worker} (at most {budget:.0f} s) ...")
  extra = [*(["--smoke"] if args.smoke else []),
           *(["--rounds", str(args.rounds)] if args.rounds else []),
           "--until", f"{time.time() + budget:.3f}"]
  with tempfile.TemporaryDirectory(prefix="tunedjax-gpu-cache-") as cache:
    result = run.supervise(worker, run.worker_command(str(SCRIPT), worker, extra), budget,
                           env=_worker_env(cache, args.smoke), echo=log)
  log(f"gpu.py: {worker}: {result.status} after {result.seconds:.1f} s "
      f"({result.cpu_s:.1f} s of CPU)")
  return result


def _keep(results: dict[str, Any], part: str, result: run.WorkerResult) -> None:
  entry = results["parts"].setdefault(part, {"seconds": 0.0, "workers": []})
  entry["workers"].append(result.to_dict())
  entry["seconds"] += result.seconds
  for record in result.records:
    if record.get("kind") == "env":
      results["env"].update({k: v for k, v in record.items() if k != "kind"})


def run_part(part: str, args: argparse.Namespace, results: dict[str, Any], log: Log,
             total_end: float, out: pathlib.Path | None) -> None:
  """Runs a part's workers one after another, saving the results after each."""
  budgets = _budgets(args)
  results["parts"][part] = {"seconds": 0.0, "workers": []}
  for worker, planned in names.PLAN[part]:
    limit = budgets.get(worker, names.SMOKE_BUDGET_S if args.smoke else planned)
    budget = min(limit, total_end - time.monotonic())
    if budget < 5:
      why = ("its time limit is under 5 s" if limit < 5 else
             f"the run's {args.total_s or TOTAL_S:.0f} s are spent")
      log(f"gpu.py: {worker}: not run ({why})")
      _keep(results, part, run.WorkerResult(worker, 0.0, status="skipped"))
      continue
    result = run_worker(worker, budget, args, log)
    if any(r.get("kind") == "no_gpu" for r in result.records):
      raise SystemExit(2)
    _keep(results, part, result)
    save(results, out)


def run_parallel(args: argparse.Namespace, results: dict[str, Any], log: Log) -> None:
  """A smoke run's workers, `args.jobs` at a time (a GPU run's are one at a time)."""
  budgets = _budgets(args)
  tasks = [(part, worker) for part in args.only for worker, _ in names.PLAN[part]]
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = [pool.submit(run_worker, worker, budgets.get(worker, names.SMOKE_BUDGET_S), args,
                           lambda line, w=worker: log(f"[{w}] {line}"))
               for _, worker in tasks]
    for (part, _), future in zip(tasks, futures):
      _keep(results, part, future.result())


def save(results: dict[str, Any], out: pathlib.Path | None) -> None:
  """gpu.json and gpu.md in `out` (written again after every worker)."""
  if out is None:
    return
  tmp = out / "gpu.json.tmp"
  tmp.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
  tmp.replace(out / "gpu.json")
  text = "\n\n".join(f"<!-- {n}:start -->\n{body}\n<!-- {n}:end -->"
                     for n, body in render.sections(results).items())
  (out / "gpu.md").write_text(text + "\n", encoding="utf-8")


def problems(results: dict[str, Any]) -> list[str]:
  """Workers that failed and variants that raised (a smoke run must have none)."""
  found = []
  for part_name, part in results["parts"].items():
    for w in part["workers"]:
      if w["status"] in ("failed", "budget"):
        found.append(f"{w['name']}: {w['status']}")
    for key, row in render.merged_rows(part, "tokens", "precision", "bucket", "dtype").items():
      if row.get("error"):
        found.append(f"{part_name} {', '.join(str(k) for k in key if k is not None)}: "
                     f"{row['error']}")
  return found


def publish(results: dict[str, Any], write: bool, log: Log) -> None:
  """Prints every section; with `write`, puts them into BENCHMARKS.md."""
  for name, body in render.sections(results).items():
    log("\n" + body + "\n")
    if write:
      import harness as _harness  # pylint: disable=import-outside-toplevel  # imports JAX
      _harness.write_section(name, body)
      log(f"gpu.py: wrote the {name} section of {_harness.BENCHMARKS_MD}")


def drive(args: argparse.Namespace, argv: Sequence[str]) -> int:
  out = None if args.out is None else pathlib.Path(args.out)
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
  log = Log(out)
  results: dict[str, Any] = {
      "command": "python benchmarks/gpu.py " + " ".join(argv),
      "date": datetime.date.today().isoformat(),
      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "smoke": bool(args.smoke), "env": {}, "parts": {}}
  total_end = time.monotonic() + (args.total_s or (1e9 if args.smoke else TOTAL_S))
  if args.jobs > 1:
    run_parallel(args, results, log)
    save(results, out)
  for part in args.only:
    if args.jobs == 1:
      run_part(part, args, results, log, total_end, out)
    log("\n" + render.RENDER[part](results, results["parts"][part]) + "\n")
  if args.write:
    publish(results, True, lambda line: None if line.startswith("\n") else log(line))
  found = problems(results)
  log(f"gpu.py: done; {'problems: ' + '; '.join(found) if found else 'no problems'}")
  if out is not None:
    log(f"gpu.py: figures in {out / 'gpu.json'}, sections in {out / 'gpu.md'}")
  return 1 if found else 0


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.worker:
    return worker_main(args)
  if args.render:
    results = json.loads(pathlib.Path(args.render).read_text(encoding="utf-8"))
    publish(results, args.write, Log(None))
    return 0
  run.stop_on_sigterm()
  return drive(args, argv)


if __name__ == "__main__":
  raise SystemExit(main())
