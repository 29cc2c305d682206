"""The ``direct_native`` conv kernel: per bucket (tuner times) and inside the whole train steps.

For each of the two steps of `benchmarks/vs_pytorch.py` (the MobileNet-style
step, batch 32 at 64x64, and the demo network, batch 128 at 32x32):

1. `tj.jit` with kernel selection tunes the step into a fresh cache; every
   conv bucket where ``direct_native`` is a candidate holds the tuner's
   timings of it and of ``xla``, ``im2col``, ``window_matmul`` (the table:
   each kernel's median over the tuner's rounds, and the chosen one).
2. A copy of that cache has each ``direct_native`` winner set back to the
   kernel the tuner would have chosen without it (the fastest other candidate
   that beat ``xla`` by the tuner's margin, else ``xla``): the family's
   current winner. With ``--only window`` (or ``wgrad``) only that form's
   winners are set back, so the two forms are measured apart.
3. One process, both compiled steps (after a check of one step against
   `jax.jit`): timed in interleaved rounds (`_harness.interleaved`, rotated
   order, the baseline timed twice as an A/A control); the ratio is the
   median of per-round ratios ``direct_native / current``.

Run from the repository root:

  PYTHONPATH=src:benchmarks python benchmarks/direct_native.py [--net demo|mobilenet|both]
      [--rounds N] [--quick] [--only window|wgrad]
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

import _harness  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import vs_pytorch  # pylint: disable=wrong-import-position

import tunedjax as tj  # pylint: disable=wrong-import-position
from tunedjax import autotune  # pylint: disable=wrong-import-position
from tunedjax.autotune import _conv_native_direct as direct  # pylint: disable=wrong-import-position
from tunedjax.autotune import _tuner  # pylint: disable=wrong-import-position
from tunedjax.autotune._conv_spec import ConvSpec  # pylint: disable=wrong-import-position

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
  from tunedjax.autotune._conv_family import describe_conv  # pylint: disable=import-outside-toplevel
  return describe_conv(key)


def run(net: str, rounds: int, quick: bool, only: str | None = None) -> None:
  rng = np.random.default_rng(0)
  if net == "mobilenet":
    batch, size = (4, 32) if quick else (32, 64)
    params, loss, _ = vs_pytorch.mobilenet_jax(rng)
    step = vs_pytorch.mobilenet_step(loss)
    jax_args: tuple[Any, ...] = (params,)
  else:
    width, batch, size = (8, 8, 16) if quick else (32, 128, 32)
    params, stats, step = vs_pytorch.demo_jax(width)
    jax_args = (params, stats)
  x = jnp.asarray(rng.normal(size=(batch, size, size, 3)).astype(np.float32))
  y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
  args = (*jax_args, x, y)

  tmp = tempfile.mkdtemp(prefix="direct_native_")
  tuned, before = os.path.join(tmp, "tuned"), os.path.join(tmp, "before")
  config = {"kernel": {"enable": True}, "cache": {"dir": tuned}}
  with tj.config_context(config):
    native_step = tj.jit(step, session=autotune.TuningSession())
    start = time.perf_counter()
    jax.block_until_ready(native_step(*args))
  print(f"{net}: tuned in {time.perf_counter() - start:.1f} s", file=sys.stderr)
  print("| bucket (form) | xla (ms) | im2col (ms) | window_matmul (ms) | direct_native (ms) | "
        "chosen | current winner | direct_native / current |\n"
        "|---|---:|---:|---:|---:|---|---|---:|")
  print("\n".join(bucket_rows(tuned)))

  shutil.copytree(tuned, before, ignore=shutil.ignore_patterns("native"))
  cache = autotune.Cache(before)
  for entry in cache.entries("conv"):
    if entry.value["winner"] == NEW and only is not None and _form(entry.key) != only:
      continue  # --only FORM: the other form keeps direct_native in both steps
    if entry.value["winner"] == NEW:
      cache.put("conv", entry.key,
                {**entry.value, "winner": _without_native(entry.value)})
  before_config = {"kernel": {"enable": True}, "cache": {"dir": before}}
  with tj.config_context(before_config):
    before_step = tj.jit(step, session=autotune.TuningSession())
    jax.block_until_ready(before_step(*args))

  ref = jax.jit(step)(*args)
  for name, fn, conf in ((NEW, native_step, config),
                         ("current", before_step, before_config)):
    with tj.config_context(conf):
      got = fn(*args)
      chosen = [str(c) for c in fn.report(memory=False).last.kernel_report.of("conv")
                 if NEW in str(c) or "window_matmul" in str(c)]
    err = vs_pytorch.agreement(float(got[0]), vs_pytorch.flat_names(got[1]), float(ref[0]),
                               vs_pytorch.flat_names(ref[1]))
    print(f"{net}: {name}: one step vs jax.jit {err:.1e}; conv sites: {chosen}",
          file=sys.stderr)

  def timed(fn, conf):
    def call():
      with tj.config_context(conf):
        return jax.block_until_ready(fn(*args))
    return call

  load = os.getloadavg()[0]
  t = _harness.interleaved({"current": timed(before_step, before_config),
                            NEW: timed(native_step, config)},
                           baseline="current", rounds=rounds, warmup=1)
  print(f"\n{net} step ({only or 'both'} forms), {rounds} rounds, load {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after")
  print(_harness.ratio_table(t))
  shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--net", choices=("demo", "mobilenet", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke)")
  parser.add_argument("--only", choices=("window", "wgrad"), default=None,
                      help="measure one form: the other form's winners stay direct_native")
  args = parser.parse_args(argv)
  print(_harness.machine_line())
  for net in ("mobilenet", "demo") if args.net == "both" else (args.net,):
    run(net, args.rounds, args.quick, args.only)
  return 0


if __name__ == "__main__":
  sys.exit(main())
