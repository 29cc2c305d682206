"""The ``native`` batch-norm kernel: per bucket (tuner times) and inside the whole train steps.

For each of the two steps of `benchmarks/vs_pytorch.py` (the MobileNet-style
step, batch 32 at 64x64, and the demo network, batch 128 at 32x32):

1. `tj.jit` with kernel selection tunes the step into a fresh cache; every
   batch-norm bucket's entry holds the tuner's forward+backward timings of
   ``xla``, ``fused`` and ``native`` (the table: each kernel's
   median over the tuner's rounds, and the chosen one).
2. Copies of that cache with every batch-norm winner set: to the kernel the
   tuner would have chosen without ``native`` (the fastest other candidate
   that beat ``xla`` by the tuner's margin, else ``xla``): "current"; to the
   tuner's own choice: "tuned"; to ``native`` everywhere: "native".
3. One process, the three compiled steps (each first checked against
   `jax.jit`: one step's loss and gradients, `vs_pytorch.agreement`), timed
   in interleaved rounds (`_harness.interleaved`, rotated order, "current"
   timed twice as an A/A control); ratios are medians of per-round ratios
   to "current".

Run from the repository root:

  PYTHONPATH=src:benchmarks python benchmarks/bn_native.py [--net demo|mobilenet|both]
      [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
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
import vs_pytorch  # pylint: disable=wrong-import-position

import tunedjax as tj  # pylint: disable=wrong-import-position
from tunedjax import autotune  # pylint: disable=wrong-import-position
from tunedjax.autotune import _tuner  # pylint: disable=wrong-import-position

KERNELS = ("xla", "fused", "native")
NEW = ("native",)


def _without_native(value: dict[str, Any]) -> str:
  """The winner the tuner would have chosen from `value`'s timings without the new kernels."""
  med = {k: statistics.median(v) for k, v in value["timings"].items()
         if k not in NEW and k not in value.get("rejected", {}) and v}
  best = min(med, key=med.get)
  return best if med[best] < med["xla"] / (1 + _tuner.DEFAULT_MARGIN) else "xla"


def bucket_rows(cache_dir: str) -> list[str]:
  rows = []
  for entry in autotune.Cache(cache_dir).entries("batch_norm"):
    value, key = entry.value, entry.key
    med = {k: statistics.median(v) * 1e3 for k, v in value["timings"].items() if v}
    cells = " | ".join(f"{med[k]:.2f}" if k in med else "-" for k in KERNELS)
    before = _without_native(value)
    ratios = " | ".join(f"{med.get(k, float('nan')) / med[before]:.2f}" for k in NEW)
    rows.append(f"| batch_norm {'x'.join(map(str, key['shape']))} | {cells} | "
                f"{value['winner']} | {before} | {ratios} |")
  return rows


def run(net: str, rounds: int, quick: bool) -> None:
  step, args = vs_pytorch.net_problem(net, quick)[:2]

  tmp = tempfile.mkdtemp(prefix="bn_native_")
  tuned = os.path.join(tmp, "tuning")
  # --quick (the smoke run): convolutions pinned to xla, so only batch norm is tuned.
  hints = {"hints": {"conv": "xla"}} if quick else {}
  config = {"kernel": {"enable": True, **hints}, "cache": {"dir": tuned}}
  with tj.config_context(config):
    native_step = tj.jit(step, session=autotune.TuningSession())
    start = time.perf_counter()
    jax.block_until_ready(native_step(*args))
  print(f"{net}: tuned in {time.perf_counter() - start:.1f} s", file=sys.stderr)
  print("| bucket | " + " | ".join(f"{k} (ms)" for k in KERNELS) + " | chosen | current winner | "
        + " | ".join(f"{k} / current" for k in NEW) + " |")
  print("|---|" + "---:|" * len(KERNELS) + "---|---|" + "---:|" * len(NEW))
  print("\n".join(bucket_rows(tuned)))

  # The same cache with every batch-norm winner set: back to the kernel the tuner would
  # have chosen without the new ones ("current"), or to each new kernel.
  steps = {}
  ref = jax.jit(step)(*args)
  for variant in ("current", "tuned", *NEW):
    folder = os.path.join(tmp, variant)
    shutil.copytree(tuned, folder, ignore=shutil.ignore_patterns("native"))
    cache = autotune.Cache(folder)
    for entry in cache.entries("batch_norm"):
      winner = {"current": _without_native(entry.value),
                "tuned": entry.value["winner"]}.get(variant, variant)
      cache.put("batch_norm", entry.key, {**entry.value, "winner": winner})
    conf = {"kernel": {"enable": True, **hints}, "cache": {"dir": folder}}
    with tj.config_context(conf):
      fn = tj.jit(step, session=autotune.TuningSession())
      got = fn(*args)
      chosen = [str(c) for c in fn.report(memory=False).last.kernel_report.of("batch_norm")]
    err = vs_pytorch.agreement(float(got[0]), vs_pytorch.flat_names(got[1]), float(ref[0]),
                               vs_pytorch.flat_names(ref[1]))
    print(f"{net}: {variant}: one step vs jax.jit {err:.1e}; batch norm sites: {chosen}",
          file=sys.stderr)
    steps[variant] = (fn, conf)

  def timed(fn, conf):
    def call():
      with tj.config_context(conf):
        return jax.block_until_ready(fn(*args))
    return call

  load = os.getloadavg()[0]
  t = _harness.interleaved({name: timed(*v) for name, v in steps.items()},
                           baseline="current", rounds=rounds, warmup=1)
  print(f"\n{net} step, {rounds} rounds, load {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after")
  print(_harness.ratio_table(t))
  shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--net", choices=("demo", "mobilenet", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke)")
  args = parser.parse_args(argv)
  if args.quick:
    args.rounds = min(args.rounds, 2)
  print(_harness.machine_line())
  for net in ("mobilenet", "demo") if args.net == "both" else (args.net,):
    run(net, args.rounds, args.quick)
  return 0


if __name__ == "__main__":
  sys.exit(main())
