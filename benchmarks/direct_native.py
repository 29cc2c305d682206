"""The ``direct_native`` conv kernel: per bucket (tuner times) and inside the whole train steps.

For each of the two steps of `benchmarks/vs_pytorch.py` (the MobileNet-style
step, batch 32 at 64x64, and the demo network, batch 128 at 32x32):

1. `tj.jit` with kernel selection tunes the step into a fresh cache; every
   conv bucket where ``direct_native`` is a candidate holds the tuner's
   timings of it and of ``xla``, ``im2col``, ``window_matmul`` (the table:
   each kernel's median over the tuner's rounds, and the chosen one).
2. Copies of that cache have ``direct_native``'s winners set back to the
   kernel the tuner would have chosen without it (the fastest other candidate
   that beat ``xla`` by the tuner's margin, else ``xla``): in every bucket
   ("current", the family's winners before this kernel), in the
   weight-gradient buckets only ("window form only") or in the window buckets
   only ("weight-gradient form only"); the tuned cache itself is "both forms".
3. One process, the four compiled steps (each checked against `jax.jit` on
   one step first): timed in interleaved rounds (`_harness.interleaved`,
   rotated order, "current" timed twice as an A/A control); each ratio is the
   median of per-round ratios to "current".

Run from the repository root:

  PYTHONPATH=src:benchmarks python benchmarks/direct_native.py [--net demo|mobilenet|both]
      [--rounds N] [--quick]
  PYTHONPATH=src:benchmarks python benchmarks/direct_native.py --buckets [--rounds N]
      (each dense-window bucket of the two steps alone: the kernels' times as
      ratios to xla's, interleaved, xla timed twice as A/A)
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TUNEDJAX_VS_PYTORCH_REEXEC", "1")  # the JAX side only: no torch

import harness as _harness  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import vs_pytorch  # pylint: disable=wrong-import-position

import tunedjax as tj  # pylint: disable=wrong-import-position
from tunedjax import autotune  # pylint: disable=wrong-import-position
from tunedjax.ops.conv import _native_direct as direct  # pylint: disable=wrong-import-position
from tunedjax.autotune import _registry, _tuner  # pylint: disable=wrong-import-position
from tunedjax.ops.conv._spec import ConvSpec  # pylint: disable=wrong-import-position

KERNELS = ("xla", "im2col", "window_matmul", "direct_native")
NEW = "direct_native"


def _without_native(value: dict[str, Any]) -> str:
  """The winner the tuner would have chosen from `value`'s timings without ``direct_native``."""
  med = {k: statistics.median(v) for k, v in value["timings"].items()
         if k != NEW and k not in value.get("rejected", {}) and v}
  best = min(med, key=med.get)
  return best if med[best] < med["xla"] / (1 + _tuner.DEFAULT_MARGIN) else "xla"


def _form(key: dict[str, Any]) -> str:
  spec = ConvSpec.from_dict({k: key[k] for k in ConvSpec.__dataclass_fields__})
  return "window" if direct.is_window_form(spec) else "wgrad"


def bucket_rows(cache_dir: str) -> list[str]:
  rows = []
  for entry in autotune.Cache(cache_dir).entries("conv"):
    value, key = entry.value, entry.key
    if NEW not in value.get("timings", {}):
      continue
    med = {k: statistics.median(v) * 1e3 for k, v in value["timings"].items() if v}
    cells = " | ".join(f"{med[k]:.2f}" if k in med else "-" for k in KERNELS)
    before = _without_native(value)
    ratio = med.get(NEW, float("nan")) / med[before]
    rows.append(f"| {autotune_describe(key)} ({_form(key)}) | {cells} | "
                f"{value['winner']} | {before} | {ratio:.2f} |")
  return rows


def autotune_describe(key: dict[str, Any]) -> str:
  from tunedjax.ops.conv._family import describe_conv  # pylint: disable=import-outside-toplevel
  return describe_conv(key)


_NHWC = ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))      # forward
_DGRAD = ((0, 3, 1, 2), (2, 3, 0, 1), (0, 3, 1, 2))     # input gradient
_WGRAD = ((3, 0, 1, 2), (3, 0, 1, 2), (2, 3, 0, 1))     # weight gradient


def _bucket(lhs, rhs, strides, padding, rhs_dil, dn) -> ConvSpec:
  return ConvSpec(lhs, rhs, "float32", "float32", "float32", strides, padding, (1, 1),
                  rhs_dil, dn, 1, 1, None, None)


# The dense-window convolutions of the two steps (vs_pytorch.py's), as their jaxprs have them.
BUCKETS = {
    "MobileNet stem, forward (32x64x64x3, 3x3x3x32, s2)":
        _bucket((32, 64, 64, 3), (3, 3, 3, 32), (2, 2), ((1, 1), (1, 1)), (1, 1), _NHWC),
    "MobileNet stem, weight gradient":
        _bucket((32, 64, 64, 3), (32, 32, 32, 32), (1, 1), ((1, 0), (1, 0)), (2, 2), _WGRAD),
    "demo stem, forward (128x32x32x3, 3x3x3x32)":
        _bucket((128, 32, 32, 3), (3, 3, 3, 32), (1, 1), ((1, 1), (1, 1)), (1, 1), _NHWC),
    "demo stem, weight gradient":
        _bucket((128, 32, 32, 3), (128, 32, 32, 32), (1, 1), ((1, 1), (1, 1)), (1, 1), _WGRAD),
    "demo bottleneck 3x3, forward (128x8x8x32, 3x3x32x32)":
        _bucket((128, 8, 8, 32), (3, 3, 32, 32), (1, 1), ((1, 1), (1, 1)), (1, 1), _NHWC),
    "demo bottleneck 3x3, input gradient":
        _bucket((128, 8, 8, 32), (3, 3, 32, 32), (1, 1), ((1, 1), (1, 1)), (1, 1), _DGRAD),
    "demo bottleneck 3x3, weight gradient":
        _bucket((128, 8, 8, 32), (128, 8, 8, 32), (1, 1), ((1, 1), (1, 1)), (1, 1), _WGRAD),
}


def run_buckets(rounds: int) -> None:
  """Each bucket's applicable kernels (fft and pallas left out) timed alone, interleaved."""
  rng = np.random.default_rng(0)
  print("| bucket | xla (ms) | im2col | window_matmul | direct_native | A/A | load |\n"
        "|---|---:|---:|---:|---:|---:|---:|")
  for name, spec in BUCKETS.items():
    x = jnp.asarray(rng.normal(size=spec.lhs_shape).astype(np.float32))
    w = jnp.asarray(rng.normal(size=spec.rhs_shape).astype(np.float32))
    variants = {}
    for kernel in _registry.applicable_kernels(spec, "cpu", "conv"):
      if kernel.name in KERNELS:
        fn = jax.jit(lambda a, b, k=kernel, s=spec: k.fn(a, b, s))
        variants[kernel.name] = lambda fn=fn, x=x, w=w: jax.block_until_ready(fn(x, w))
    load = os.getloadavg()[0]
    t = _harness.interleaved(variants, baseline="xla", rounds=rounds, warmup=1)
    cells = [f"{t.ratio(k):.2f}" if k in variants else "-" for k in KERNELS[1:]]
    print(f"| {name} | {t.median('xla') * 1e3:.2f} | {' | '.join(cells)} | "
          f"{t.ratio(_harness.CONTROL):.2f} | {load:.1f} |")


def interleaved_wall_and_cpu(variants, *, baseline: str, rounds: int, warmup: int = 1
                             ) -> tuple[_harness.Timings, _harness.Timings]:
  """`_harness.interleaved`'s rounds (rotated order, the baseline again as the A/A
  control), timing each call by the wall clock and by this process's CPU time.

  On a machine other jobs load, the wall clock also counts the time this
  process waits for a core; its CPU time counts the work it did (spinning
  pool threads included), a second view with less of that noise.
  """
  names = [*variants, _harness.CONTROL]
  fns = {**variants, _harness.CONTROL: variants[baseline]}
  wall: dict[str, list[float]] = {n: [] for n in names}
  cpu: dict[str, list[float]] = {n: [] for n in names}
  for r in range(warmup + rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      gc.collect()
      start, start_cpu = time.perf_counter(), time.process_time()
      fns[name]()
      if r >= warmup:
        wall[name].append(time.perf_counter() - start)
        cpu[name].append(time.process_time() - start_cpu)
  return _harness.Timings(wall, baseline), _harness.Timings(cpu, baseline)


def run(net: str, rounds: int, quick: bool) -> None:
  step, args = vs_pytorch.net_problem(net, quick)[:2]

  tmp = tempfile.mkdtemp(prefix="direct_native_")
  tuned = os.path.join(tmp, "tuned")
  with tj.config_context({"kernel": {"enable": True}, "cache": {"dir": tuned}}):
    start = time.perf_counter()
    jax.block_until_ready(tj.jit(step, session=autotune.TuningSession())(*args))
  print(f"{net}: tuned in {time.perf_counter() - start:.1f} s", file=sys.stderr)
  print("| bucket (form) | xla (ms) | im2col (ms) | window_matmul (ms) | direct_native (ms) | "
        "chosen | current winner | direct_native / current |\n"
        "|---|---:|---:|---:|---:|---|---|---:|")
  print("\n".join(bucket_rows(tuned)))

  # The same tuned cache with direct_native's winners set back to the current
  # winner: in every bucket ("current"), in the weight-gradient buckets only
  # (the window form kept) and in the window buckets only.
  variants = {"current": ("window", "wgrad"), "window form only": ("wgrad",),
              "weight-gradient form only": ("window",), "both forms": ()}
  configs = {}
  for name, revert in variants.items():
    folder = os.path.join(tmp, name.replace(" ", "_"))
    shutil.copytree(tuned, folder, ignore=shutil.ignore_patterns("native"))
    cache = autotune.Cache(folder)
    for entry in cache.entries("conv"):
      if entry.value["winner"] == NEW and _form(entry.key) in revert:
        cache.put("conv", entry.key, {**entry.value, "winner": _without_native(entry.value)})
    configs[name] = {"kernel": {"enable": True}, "cache": {"dir": folder}}

  ref = jax.jit(step)(*args)
  steps = {}
  for name, conf in configs.items():
    with tj.config_context(conf):
      fn = steps[name] = tj.jit(step, session=autotune.TuningSession())
      got = fn(*args)
      chosen = collections.Counter(
          str(c) for c in fn.report(memory=False).last.kernel_report.of("conv"))
    err = vs_pytorch.agreement(float(got[0]), vs_pytorch.flat_names(got[1]), float(ref[0]),
                               vs_pytorch.flat_names(ref[1]))
    print(f"{net}: {name}: one step vs jax.jit {err:.1e}; conv sites: {dict(chosen)}",
          file=sys.stderr)

  def timed(fn, conf):
    def call():
      with tj.config_context(conf):
        return jax.block_until_ready(fn(*args))
    return call

  load = os.getloadavg()[0]
  wall, cpu = interleaved_wall_and_cpu(
      {name: timed(steps[name], configs[name]) for name in variants}, baseline="current",
      rounds=rounds)
  print(f"\n{net} step, {rounds} rounds, load {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; wall time:")
  print(_harness.ratio_table(wall))
  print("\nthis process's CPU time (user + system, every thread) per step:")
  print(_harness.ratio_table(cpu))
  shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--net", choices=("demo", "mobilenet", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke)")
  parser.add_argument("--buckets", action="store_true",
                      help="time the dense-window buckets alone instead of the steps")
  args = parser.parse_args(argv)
  print(_harness.machine_line())
  if args.buckets:
    run_buckets(args.rounds)
    return 0
  for net in ("mobilenet", "demo") if args.net == "both" else (args.net,):
    run(net, args.rounds, args.quick)
  return 0


if __name__ == "__main__":
  sys.exit(main())
