"""`tunedjax.jit` against `jax.jit`: per-call overhead, first-call time, end-to-end speed.

Three tables, each timed in interleaved rounds with an A/A control (the
baseline timed twice):

1. Steady state: per-call time of a small MLP train step (host-bound, so the
   dispatch overhead shows), `jax.jit` vs `tj.jit` at O0 and at O1 with every
   tuner on (`set_config(None)`, warm caches; an MLP has no convolutions, so
   the compiled programs are the same and the difference is tunedjax's
   per-call work). Target (issue #7): within 2% or 10 us of `jax.jit`.
2. First call (trace + passes + compile) with a warm tuning cache, for the MLP
   and a ResNet-18 train step written in NCHW (a PyTorch port): a fresh
   function object each round, so both compile from scratch. Target: no more
   than 20% slower than `jax.jit`'s first call.
3. End to end: the ResNet-18 NCHW train step and a MobileNet-style train step
   with each tuner alone and all together, against `jax.jit`.

Run: `.venv/bin/python benchmarks/jit_overhead.py [--quick] [--write] [--rounds N]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import harness as _harness
from harness.workers import mlp_problem
import kernels as kernels_bench
import layout as layout_bench
import tunedjax as tj

CALLS_PER_RUN = 200
TUNERS = {
    "layout only": {"layout": {"enable": True}},
    "kernel selection only": {"kernel": {"enable": True}},
    "mixed bf16 only": {"mixed_precision": {"enable": True}},
    "layout + kernels (set_config(None))": {"layout": {"enable": True},
                                           "kernel": {"enable": True}},
    "every tuner (+ mixed bf16)": {"layout": {"enable": True}, "kernel": {"enable": True},
                                   "mixed_precision": {"enable": True}},
}


def resnet_problem(image: int, batch: int = 8, *, quick: bool = False):
  rng = np.random.default_rng(0)
  if quick:  # a 5-conv NHWC ResNet-style net: a smoke run compiles in seconds
    params, loss = kernels_bench.resnet(rng)
    x = jnp.asarray(rng.normal(size=(batch, image, image, 3)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
    return kernels_bench.sgd_step(loss), (params, x, y)
  params = layout_bench.init_params(rng, classes=10)
  x = jnp.asarray(rng.normal(size=(batch, 3, image, image)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
  return layout_bench.make_train_step(channels_last=False), (params, x, y)


def mobilenet_problem(image: int, batch: int = 32):
  rng = np.random.default_rng(0)
  params, loss = kernels_bench.mobilenet(rng)
  x = jnp.asarray(rng.normal(size=(batch, image, image, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
  return kernels_bench.sgd_step(loss), (params, x, y)


def _fresh(step: Callable[..., Any]) -> Callable[..., Any]:
  """A new function object with `step`'s behaviour: jit caches nothing for it yet."""
  return lambda *args: step(*args)


def _ready(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], Any]:
  return lambda: jax.block_until_ready(fn(*args))


def _many(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> Callable[[], Any]:
  def run():
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
  return run


def steady_state(rounds: int, calls: int) -> tuple[str, dict[str, float]]:
  step, args = mlp_problem()
  plain, o0, o1 = jax.jit(step), tj.jit(step, level="O0"), tj.jit(step, level="O1")
  variants = {"jax.jit": _many(plain, args, calls), "tj.jit O0": _many(o0, args, calls),
              "tj.jit O1 (every tuner on)": _many(o1, args, calls)}
  t = _harness.interleaved(variants, baseline="jax.jit", rounds=rounds, warmup=2)
  per_call = {n: t.median(n) / calls * 1e6 for n in t.runs}
  notes = {n: f"{per_call[n]:.1f} us per call; {per_call[n] - per_call['jax.jit']:+.1f} us"
           for n in t.runs if n != "jax.jit"}
  notes["jax.jit"] = f"{per_call['jax.jit']:.1f} us per call"
  return _harness.ratio_table(t, notes=notes), {
      "ratio": t.ratio("tj.jit O1 (every tuner on)"),
      "extra_us": per_call["tj.jit O1 (every tuner on)"] - per_call["jax.jit"],
      "control": t.ratio(_harness.CONTROL)}


def first_call(name: str, step: Callable[..., Any], args: tuple[Any, ...],
               rounds: int) -> tuple[str, float]:
  """First-call seconds of fresh functions; the tuning cache is warmed first."""
  jax.block_until_ready(tj.jit(_fresh(step))(*args))  # tunes every bucket once
  variants = {"jax.jit": lambda: jax.block_until_ready(jax.jit(_fresh(step))(*args)),
              "tj.jit O1, warm tuning cache":
                  lambda: jax.block_until_ready(tj.jit(_fresh(step))(*args))}
  t = _harness.interleaved(variants, baseline="jax.jit", rounds=rounds, warmup=0)
  return (f"**{name}**\n\n" + _harness.ratio_table(t, unit="s", scale=1.0),
          t.ratio("tj.jit O1, warm tuning cache"))


def first_call_parts(step: Callable[..., Any], args: tuple[Any, ...],
                     rounds: int) -> tuple[str, dict[str, float]]:
  """Where the first call's time goes: trace (with the passes), lowering, compiling.

  Fresh functions each round, `jax.jit` and `tj.jit` interleaved; each is
  traced, lowered and compiled by hand (`.trace`, `.lower`, `.compile`:
  what a first call does before it runs). Compiling is also given in CPU
  seconds of the process (XLA:CPU compiles on several threads), which move
  less with the machine's load than wall time. `tj.jit`'s trace is split
  by its `SignatureReport.trace_s` (tracing the function and running the
  passes) and the share the layout pass and kernel selection spend in their
  own evaluations.
  """
  parts: dict[str, list[float]] = {}

  def add(key: str, value: float) -> None:
    parts.setdefault(key, []).append(value)

  for r in range(rounds):
    for name in (("jax", "tj") if r % 2 == 0 else ("tj", "jax")):
      fn = jax.jit(_fresh(step)) if name == "jax" else tj.jit(_fresh(step))
      t0 = time.perf_counter()
      traced = fn.trace(*args)
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      cpu = time.process_time()
      lowered.compile()
      add(f"{name} compile cpu", time.process_time() - cpu)
      t3 = time.perf_counter()
      add(f"{name} trace", t1 - t0)
      add(f"{name} lower", t2 - t1)
      add(f"{name} compile", t3 - t2)
      add(f"{name} eqns", len(traced.jaxpr.eqns))
  m = {k: statistics.median(v) for k, v in parts.items()}
  rows = ["| part | `jax.jit` (s) | `tj.jit` (s) | difference (s) |", "|---|---:|---:|---:|"]
  for part in ("trace", "lower", "compile", "compile cpu"):
    label = {"trace": "trace (tj: + passes)", "lower": "lower to StableHLO",
             "compile": "XLA compile (wall)", "compile cpu": "XLA compile (process CPU)"}[part]
    rows.append(f"| {label} | {m['jax ' + part]:.3f} | {m['tj ' + part]:.3f} | "
                f"{m['tj ' + part] - m['jax ' + part]:+.3f} |")
  rows.append(f"| top-level equations | {m['jax eqns']:.0f} | {m['tj eqns']:.0f} | "
              f"{m['tj eqns'] - m['jax eqns']:+.0f} |")
  return "\n".join(rows), m


def end_to_end(name: str, step: Callable[..., Any], args: tuple[Any, ...],
               rounds: int) -> tuple[str, dict[str, float]]:
  fns: dict[str, Callable[[], Any]] = {"jax.jit": _ready(jax.jit(step), args)}
  for label, config in TUNERS.items():
    with tj.config_context(config):
      fn = tj.jit(step)
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))  # traces, tunes, compiles
      print(f"  {name} / {label}: first call {time.perf_counter() - start:.1f} s",
            file=sys.stderr)

    def run(fn=fn, config=config):
      with tj.config_context(config):
        jax.block_until_ready(fn(*args))

    fns[label] = run
  t = _harness.interleaved(fns, baseline="jax.jit", rounds=rounds, warmup=1)
  ratios = {label: t.ratio(label) for label in t.runs}
  return f"**{name}**\n\n" + _harness.ratio_table(t), ratios


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (smoke run)")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--image", type=int, default=64, help="ResNet/MobileNet image size")
  parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
  parser.add_argument("--first-call", action="store_true",
                      help="only the first-call tables (and where the time goes); no --write")
  args = parser.parse_args(argv)
  rounds = args.rounds or (2 if args.quick else 7)
  image = 16 if args.quick else args.image
  calls = 20 if args.quick else CALLS_PER_RUN
  load_before = os.getloadavg()[0]
  tj.set_config({"cache": {"dir": tempfile.mkdtemp(prefix="tunedjax-bench-")}})

  tj.set_config({**tj.get_config().to_dict(), "kernel": {"enable": True},
                 "layout": {"enable": True}})
  if args.first_call:
    resnet_step, resnet_args = resnet_problem(image, quick=args.quick)
    first_resnet, r_resnet = first_call(
        f"ResNet-18 NCHW train step, batch 8, {image}x{image}", resnet_step, resnet_args,
        max(3, rounds // 2))
    parts, _ = first_call_parts(resnet_step, resnet_args, max(3, rounds // 2))
    print(f"Load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.\n\n"
          f"{first_resnet}\n\nWhere the time goes (medians):\n\n{parts}\n\n"
          f"ResNet-18 first call: {r_resnet:.3f}x `jax.jit`'s")
    return 0
  steady, s = steady_state(rounds, calls)
  print(steady, file=sys.stderr)
  mlp_step, mlp_args = mlp_problem()
  resnet_step, resnet_args = resnet_problem(image, quick=args.quick)
  first_mlp, r_mlp = first_call("MLP train step", mlp_step, mlp_args, rounds)
  first_resnet, r_resnet = first_call(f"ResNet-18 NCHW train step, batch 8, {image}x{image}",
                                      resnet_step, resnet_args, max(3, rounds // 2))
  print(first_mlp, first_resnet, sep="\n", file=sys.stderr)

  tj.set_config({"cache": tj.get_config().cache.to_dict()})  # tuners off: each variant sets its own
  e2e = []
  e2e_ratios = {}
  for name, (step, step_args) in {
      f"ResNet-18 NCHW train step, batch 8, {image}x{image}": resnet_problem(image,
                                                                            quick=args.quick),
      f"MobileNet-style train step, batch 32, {image}x{image}": mobilenet_problem(image),
  }.items():
    table, ratios = end_to_end(name, step, step_args, rounds)
    print(table, file=sys.stderr)
    e2e.append(table)
    e2e_ratios[name] = ratios

  met_steady = s["ratio"] <= 1.02 or s["extra_us"] <= 10.0
  met_first = max(r_mlp, r_resnet) <= 1.20
  lines = [
      "## `tunedjax.jit`: overhead and end-to-end speed",
      "",
      f"`benchmarks/jit_overhead.py`: {rounds} interleaved rounds; ratios are medians of "
      f"per-round ratios to `jax.jit` (below 1 is faster). {_harness.machine_line()} "
      f"Load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
      "",
      f"### Steady state: per call, MLP train step ({calls} calls per timed run)",
      "",
      steady,
      "",
      f"Target: within 2% or 10 us of `jax.jit`: {'met' if met_steady else 'NOT met'} "
      f"(ratio {s['ratio']:.3f}, {s['extra_us']:+.1f} us per call; A/A {s['control']:.3f}).",
      "",
      "### First call: trace + passes + compile, warm tuning cache, fresh functions",
      "",
      first_mlp,
      "",
      first_resnet,
      "",
      f"Target: at most 1.20x `jax.jit`'s first call: {'met' if met_first else 'NOT met'} "
      f"(MLP {r_mlp:.2f}x, ResNet-18 {r_resnet:.2f}x).",
      "",
      "### End to end: each tuner alone and all together (steady-state step time)",
      "",
      *[part for table in e2e for part in (table, "")],
  ]
  for name, ratios in e2e_ratios.items():
    best = min((r, label) for label, r in ratios.items()
               if label not in ("jax.jit", _harness.CONTROL))
    lines.append(f"- {name}: every tuner {1 / ratios['every tuner (+ mixed bf16)']:.2f}x "
                 f"`jax.jit`'s speed, layout + kernels {1 / ratios['layout + kernels (set_config(None))']:.2f}x; "
                 f"shares: layout {1 / ratios['layout only']:.2f}x, kernels "
                 f"{1 / ratios['kernel selection only']:.2f}x, mixed bf16 "
                 f"{1 / ratios['mixed bf16 only']:.2f}x; best: {best[1]} "
                 f"(A/A {ratios[_harness.CONTROL]:.2f}).")
  body = "\n".join(lines)
  print(body)
  if args.write:
    _harness.write_section("jit_overhead", body)
    print(f"wrote {_harness.BENCHMARKS_MD}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
