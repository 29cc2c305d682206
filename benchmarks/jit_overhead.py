"""`tunedjax.jit` against `jax.jit`: per-call overhead, first-call time, end-to-end speed.

Three tables, in interleaved rounds with an A/A control:

1. Steady state: per call, a small host-bound MLP train step, `jax.jit` vs `tj.jit` at
   O0 and at O1 with every tuner on (warm caches; no convolutions, so the programs are
   the same and the difference is tunedjax's per-call work). Target (issue #7): within 2%
   or 10 us.
2. First call (trace + passes + compile), warm tuning cache, fresh functions: the MLP and
   a ResNet-18 train step written in NCHW. Target: at most 20% slower. Then where the
   ResNet's first call goes: trace (with the passes), lowering, compiling.
3. End to end: the ResNet-18 NCHW and a MobileNet-style train step with each tuner alone
   and all together, against `jax.jit`.

Run: `.venv/bin/python benchmarks/run.py jit_overhead [--quick] [--write]`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import harness
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
O1 = "tj.jit O1 (every tuner on)"
WARM = "tj.jit O1, warm tuning cache"


def resnet_problem(image: int, batch: int = 8, *, quick: bool = False):
  rng = np.random.default_rng(0)
  if quick:  # a 5-conv NHWC ResNet-style net: a smoke run compiles in seconds
    params, loss = kernels_bench.resnet(rng)
    return kernels_bench.sgd_step(loss), (params, *kernels_bench.images(rng, batch, image))
  params = layout_bench.init_params(rng, classes=10)
  return (layout_bench.make_train_step(channels_last=False),
          (params, *kernels_bench.images(rng, batch, image, nchw=True)))


def mobilenet_problem(image: int, batch: int = 32):
  rng = np.random.default_rng(0)
  params, loss = kernels_bench.mobilenet(rng)
  return kernels_bench.sgd_step(loss), (params, *kernels_bench.images(rng, batch, image))


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


def steady_state(rounds: int, calls: int) -> harness.Timings:
  step, args = mlp_problem()
  plain, o0, o1 = jax.jit(step), tj.jit(step, level="O0"), tj.jit(step, level="O1")
  variants = {"jax.jit": _many(plain, args, calls), "tj.jit O0": _many(o0, args, calls),
              O1: _many(o1, args, calls)}
  return harness.interleaved(variants, baseline="jax.jit", rounds=rounds, warmup=2)


def first_call(step: Callable[..., Any], args: tuple[Any, ...], rounds: int) -> harness.Timings:
  """First-call seconds of fresh functions; the tuning cache is warmed first."""
  jax.block_until_ready(tj.jit(_fresh(step))(*args))  # tunes every bucket once
  variants = {"jax.jit": lambda: jax.block_until_ready(jax.jit(_fresh(step))(*args)),
              WARM: lambda: jax.block_until_ready(tj.jit(_fresh(step))(*args))}
  return harness.interleaved(variants, baseline="jax.jit", rounds=rounds, warmup=0)


def first_call_parts(step: Callable[..., Any], args: tuple[Any, ...],
                     rounds: int) -> dict[str, float]:
  """Where the first call's time goes: fresh functions each round, `jax.jit` and `tj.jit`
  interleaved, each traced (with the passes), lowered and compiled by hand; compiling also
  in the process's CPU seconds (XLA:CPU compiles on several threads), which move less with
  the machine's load than wall time."""
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
  return {k: statistics.median(v) for k, v in parts.items()}


def end_to_end(name: str, step: Callable[..., Any], args: tuple[Any, ...],
               rounds: int) -> harness.Timings:
  fns: dict[str, Callable[[], Any]] = {"jax.jit": _ready(jax.jit(step), args)}
  for label, config in TUNERS.items():
    with tj.config_context(config):
      fn = tj.jit(step)
      seconds = harness.first_call(lambda fn=fn: jax.block_until_ready(fn(*args)))  # tunes
      print(f"  {name} / {label}: first call {seconds:.1f} s", file=sys.stderr)

    def run(fn=fn, config=config):
      with tj.config_context(config):
        jax.block_until_ready(fn(*args))

    fns[label] = run
  return harness.interleaved(fns, baseline="jax.jit", rounds=rounds, warmup=1)


def measure(quick: bool = False, *, rounds: int = 7, image: int = 64) -> harness.Result:
  """The steady state and the first calls with the kernel and layout tuners on (a fresh
  tuning cache), then each tuner alone and all together, end to end."""
  if quick:
    rounds, image = 2, 16
  calls = 20 if quick else CALLS_PER_RUN
  first_rounds = max(3, rounds // 2)
  resnet = f"ResNet-18 NCHW train step, batch 8, {image}x{image}"
  result = harness.Result("jit_overhead", params={
      "quick": quick, "rounds": rounds, "image": image, "calls": calls,
      "first_rounds": first_rounds, "resnet": resnet})
  with tj.config_context({"cache": {"dir": tempfile.mkdtemp(prefix="tunedjax-bench-")}}):
    with tj.config_context({"kernel": {"enable": True}, "layout": {"enable": True}}):
      result.timings["steady state"] = steady_state(rounds, calls)
      resnet_step, resnet_args = resnet_problem(image, quick=quick)
      result.timings["first call: MLP train step"] = first_call(*mlp_problem(), rounds)
      result.timings[f"first call: {resnet}"] = first_call(resnet_step, resnet_args, first_rounds)
      result.figures["first call parts"] = first_call_parts(resnet_step, resnet_args, first_rounds)
    # The tuners off: each variant sets its own.
    for name, (step, args) in {
        resnet: resnet_problem(image, quick=quick),
        f"MobileNet-style train step, batch 32, {image}x{image}": mobilenet_problem(image),
    }.items():
      result.timings[f"end to end: {name}"] = end_to_end(name, step, args, rounds)
  return result


def _steady_table(t: harness.Timings, calls: int) -> str:
  per_call = {n: t.median(n) / calls * 1e6 for n in t.runs}
  notes = {n: f"{per_call[n]:.1f} us per call; {per_call[n] - per_call['jax.jit']:+.1f} us"
           for n in t.runs if n != "jax.jit"}
  notes["jax.jit"] = f"{per_call['jax.jit']:.1f} us per call"
  return harness.ratio_table(t, notes=notes)


def _parts_table(m: dict[str, float]) -> str:
  rows = ["| part | `jax.jit` (s) | `tj.jit` (s) | difference (s) |", "|---|---:|---:|---:|"]
  for part, label in (("trace", "trace (tj: + passes)"), ("lower", "lower to StableHLO"),
                      ("compile", "XLA compile (wall)"),
                      ("compile cpu", "XLA compile (process CPU)")):
    rows.append(f"| {label} | {m['jax ' + part]:.3f} | {m['tj ' + part]:.3f} | "
                f"{m['tj ' + part] - m['jax ' + part]:+.3f} |")
  rows.append(f"| top-level equations | {m['jax eqns']:.0f} | {m['tj eqns']:.0f} | "
              f"{m['tj eqns'] - m['jax eqns']:+.0f} |")
  return "\n".join(rows)


def _e2e_line(name: str, t: harness.Timings) -> str:
  speed = {label: 1 / t.ratio(label) for label in t.runs}
  best = min((t.ratio(label), label) for label in t.runs
             if label not in ("jax.jit", harness.CONTROL))[1]
  return (f"- {name}: every tuner {speed['every tuner (+ mixed bf16)']:.2f}x `jax.jit`'s "
          f"speed, layout + kernels {speed['layout + kernels (set_config(None))']:.2f}x; "
          f"shares: layout {speed['layout only']:.2f}x, kernels "
          f"{speed['kernel selection only']:.2f}x, mixed bf16 {speed['mixed bf16 only']:.2f}x; "
          f"best: {best} (A/A {t.ratio(harness.CONTROL):.2f}).")


def render(result: harness.Result) -> str:
  p, t = result.params, result.timings
  steady = t["steady state"]
  ratio = steady.ratio(O1)
  extra_us = (steady.median(O1) - steady.median("jax.jit")) / p["calls"] * 1e6
  firsts = {k.removeprefix("first call: "): v for k, v in t.items()
            if k.startswith("first call: ")}
  r_mlp, r_resnet = (firsts[k].ratio(WARM) for k in ("MLP train step", p["resnet"]))
  e2e = {k.removeprefix("end to end: "): v for k, v in t.items() if k.startswith("end to end: ")}
  return "\n".join([
      "## `tunedjax.jit`: overhead and end-to-end speed", "",
      f"`benchmarks/run.py jit_overhead{' --quick' if p['quick'] else ''}`: {p['rounds']} "
      "interleaved rounds; ratios are medians of per-round ratios to `jax.jit` (below 1 is "
      f"faster). {result.machine} {result.load_line()}", "",
      f"### Steady state: per call, MLP train step ({p['calls']} calls per timed run)", "",
      _steady_table(steady, p["calls"]), "",
      f"Target: within 2% or 10 us of `jax.jit`: "
      f"{'met' if ratio <= 1.02 or extra_us <= 10.0 else 'NOT met'} "
      f"(ratio {ratio:.3f}, {extra_us:+.1f} us per call; A/A {steady.ratio(harness.CONTROL):.3f}).",
      "",
      "### First call: trace + passes + compile, warm tuning cache, fresh functions", "",
      *[f"**{name}**\n\n{harness.ratio_table(ft, unit='s', scale=1.0)}\n"
        for name, ft in firsts.items()],
      f"Target: at most 1.20x `jax.jit`'s first call: "
      f"{'met' if max(r_mlp, r_resnet) <= 1.20 else 'NOT met'} "
      f"(MLP {r_mlp:.2f}x, ResNet-18 {r_resnet:.2f}x).", "",
      f"Where the ResNet-18 first call's time goes ({p['first_rounds']} more interleaved "
      "rounds of fresh functions traced, lowered and compiled by hand, medians; compiling "
      "also in CPU seconds of the process, which move less with the load):", "",
      _parts_table(result.figures["first call parts"]), "",
      "### End to end: each tuner alone and all together (steady-state step time)", "",
      *[f"**{name}**\n\n{harness.ratio_table(et)}\n" for name, et in e2e.items()],
      *[_e2e_line(name, et) for name, et in e2e.items()],
  ])
