"""XLA:CPU compiler options, per compiled program: does any beat the defaults?

Each candidate option set that keeps float semantics (no fast math, fast min/max or
flush-to-zero), passed as `lower(*args).compile(compiler_options={...})`, checked
against the default program's outputs and timed against it in interleaved rounds (the
default timed twice: the A/A control), on three train steps: the MobileNet-style step of
`benchmarks/kernels.py` (batch 32, 64x64) and the demo network (`DemoNet`, width 32,
batch 128, 32x32) through `tunedjax.jit` with kernel selection (batch norms through the
family), and the control: `kernels.py`'s ResNet-style step under `jax.jit` (batch 16,
32x32). A fusion-level candidate whose compiled HLO is the default's is reported as "no
effect" and not timed; the others act below the HLO and are always timed.

``--quick``: the smoke run's small steps, one fusion-level and one code-generation
candidate (`QUICK`), 2 rounds of 1 step. Prints its tables; writes no section.

Run: `.venv/bin/python benchmarks/run.py xla_options [--quick]`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import harness
import jax
import kernels as kernels_bench
import numpy as np

import tunedjax as tj
from tunedjax import autotune

BOUND = 1e-4  # largest relative error against the default program (float32 rounding)

# name -> compiler options. The fusion-type lists replace XLA's list; jaxlib 0.10.2's
# default for YNNPACK is individual dots, convolutions and reductions.
YNN_DEFAULT = ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION,"
               "LIBRARY_FUSION_TYPE_REDUCE")
HLO_LEVEL = ("xla_cpu_experimental_ynn_fusion_type", "xla_cpu_experimental_xnn_graph_fusion_mode",
             "xla_cpu_experimental_onednn_fusion_type", "xla_cpu_use_onednn")
CANDIDATES: dict[str, dict[str, Any]] = {
    "YNNPACK as default, spelled out": {"xla_cpu_experimental_ynn_fusion_type": YNN_DEFAULT},
    "YNNPACK + elementwise fusions": {
        "xla_cpu_experimental_ynn_fusion_type": YNN_DEFAULT + ",LIBRARY_FUSION_TYPE_ELTWISE"},
    "YNNPACK + dot fusions": {
        "xla_cpu_experimental_ynn_fusion_type": YNN_DEFAULT + ",LIBRARY_FUSION_TYPE_DOT"},
    "YNNPACK off": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "XNNPACK graph fusion, greedy": {
        "xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY"},
    "oneDNN dot fusions": {
        "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "oneDNN": {"xla_cpu_use_onednn": True},
    "512-bit vectors": {"xla_cpu_prefer_vector_width": 512},
    "opt preset fast runtime": {"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_RUNTIME"},
    "memory-optimized scheduler": {
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
    "concurrency scheduler off": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    "no fusion emitters": {"xla_cpu_use_fusion_emitters": False},
    "Eigen single-threaded": {"xla_cpu_multi_thread_eigen": False},
}
QUICK = ("YNNPACK + elementwise fusions", "512-bit vectors")


def programs(quick: bool, cache_dir: str) -> dict[str, tuple[Any, tuple[Any, ...]]]:
  """name -> (lowered program, args)."""
  rng = np.random.default_rng(0)
  config = {"kernel": {"enable": True}, "cache": {"dir": cache_dir}}
  out = {}

  # MobileNet-style step, tunedjax.
  batch, size = (4, 32) if quick else (32, 64)
  params, loss = kernels_bench.mobilenet(rng, bn=kernels_bench.bn_family)
  step = kernels_bench.sgd_step(loss)
  args = (params, *kernels_bench.images(rng, batch, size))
  with tj.config_context(config):
    f = tj.jit(step, session=autotune.TuningSession())
    jax.block_until_ready(f(*args))  # tunes
    out[f"MobileNet step (tj.jit), batch {batch} at {size}x{size}"] = (f.lower(*args), args)

  # DemoNet step, tunedjax, BatchNorm routed to the family.
  width, batch, size = (8, 8, 16) if quick else (32, 128, 32)
  dparams, stats, demo_step = kernels_bench.demo_step(width)
  args = (dparams, stats, *kernels_bench.images(rng, batch, size))
  with tj.config_context(config):
    f = tj.jit(demo_step, session=autotune.TuningSession())
    jax.block_until_ready(f(*args))
    out[f"demo step (tj.jit), batch {batch} at {size}x{size}"] = (f.lower(*args), args)

  # Control: ResNet-style step, plain jax.jit.
  batch, size = (4, 16) if quick else (16, 32)
  params, loss = kernels_bench.resnet(rng)
  args = (params, *kernels_bench.images(rng, batch, size))
  out[f"control: ResNet-style step (jax.jit), batch {batch} at {size}x{size}"] = (
      jax.jit(kernels_bench.sgd_step(loss)).lower(*args), args)
  return out


def rel_error(got: Any, want: Any) -> float:
  """Largest relative error over leaves; 1e-3 of the largest leaf as the least scale."""
  leaves = [(np.asarray(g, np.float64), np.asarray(w, np.float64))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
  top = max(float(np.max(np.abs(w))) for _, w in leaves)
  return max(float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-3 * top)
             for g, w in leaves)


def _program(lowered: Any, args: tuple[Any, ...], candidates: Mapping[str, dict],
             rounds: int, reps: int) -> tuple[harness.Timings, dict[str, str], list[str]]:
  """The default program and each candidate's, checked, then timed: the timings, a note
  per timed candidate and the candidates not timed (and why)."""
  default = lowered.compile()
  hlo = default.as_text()
  want = jax.block_until_ready(default(*args))
  variants: dict[str, Callable[[], Any]] = {}
  notes: dict[str, str] = {}
  skipped: list[str] = []

  def runner(exe):
    return lambda: jax.block_until_ready(exe(*args))

  variants["default"] = runner(default)
  for cand, options in candidates.items():
    start = time.perf_counter()
    try:
      exe = lowered.compile(compiler_options=options)
    except Exception as e:  # noqa: BLE001  # pylint: disable=broad-except
      skipped.append(f"{cand} (refused: {str(e).splitlines()[0][:80]})")
      continue
    compile_s = time.perf_counter() - start
    if any(k in HLO_LEVEL for k in options) and exe.as_text() == hlo:
      skipped.append(f"{cand} (no effect)")
      continue
    err = rel_error(jax.block_until_ready(exe(*args)), want)
    notes[cand] = f"rel. error {err:.1e}; compiled in {compile_s:.1f} s"
    if not err <= BOUND:
      skipped.append(f"{cand} (rel. error {err:.1e} > {BOUND:g})")
      continue
    variants[cand] = runner(exe)
  t = harness.interleaved(variants, baseline="default", rounds=rounds, warmup=1, burst=reps)
  return t, notes, skipped


def measure(quick: bool = False) -> harness.Result:
  """Every program with every candidate (`QUICK` with `quick`), against its default."""
  rounds, reps = (2, 1) if quick else (9, 3)
  candidates = {k: CANDIDATES[k] for k in QUICK} if quick else CANDIDATES
  result = harness.Result("xla_options", params={"quick": quick, "rounds": rounds,
                                                 "reps": reps, "programs": []})
  with tempfile.TemporaryDirectory(prefix="tunedjax-xla-options-") as cache_dir:
    for name, (lowered, args) in programs(quick, cache_dir).items():
      t, notes, skipped = _program(lowered, args, candidates, rounds, reps)
      result.timings[name] = t
      result.figures[name] = {"notes": notes, "not_timed": skipped}
      result.params["programs"].append(name)
  return result.done()


def render(result: harness.Result) -> str:
  p = result.params
  lines = ["## XLA:CPU compiler options per program", "",
           f"`benchmarks/run.py xla_options{' --quick' * p['quick']}`: each candidate compiled "
           "with `lower(...).compile(compiler_options=...)`, checked against the default "
           f"program (bound {BOUND:g}), timed in {p['rounds']} interleaved rounds"
           + (f" of {p['reps']} steps (their mean)" if p["reps"] > 1 else "")
           + f"; ratio = median of per-round ratios to the default. {result.machine} "
           + result.load_line()]
  for name in p["programs"]:
    fig = result.figures[name]
    lines += ["", f"**{name}**", "",
              harness.ratio_table(result.timings[name], unit="ms per step", notes=fig["notes"])]
    if fig["not_timed"]:
      lines += ["", "Not timed: " + "; ".join(fig["not_timed"]) + "."]
  return "\n".join(lines)
