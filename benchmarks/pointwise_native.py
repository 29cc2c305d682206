"""`matmul_1x1_native` against the kernels it would replace: per bucket and in the whole step.

Two measurements, both in interleaved rounds (`_harness`), medians of
per-round ratios, the old kernel timed twice as an A/A control:

* ``buckets``: each 1x1 convolution of the demo and MobileNet-style steps in
  its three train-step forms (forward, weight gradient, input gradient), each
  kernel jitted alone: ``xla``, ``matmul_1x1`` (forward and input gradient) or
  ``window_matmul`` (weight gradient) and ``matmul_1x1_native``; every kernel
  checked against xla first.
* ``step``: the whole tuned train step (`vs_pytorch.py`'s demo and MobileNet
  steps). One process tunes the step into a fresh cache (``new``: the tuner
  may pick ``matmul_1x1_native``), then copies that cache with each
  ``matmul_1x1_native`` winner set back to the bucket's fastest other kernel
  by the tuner's own ratios (``old``: what the tuner picks without it), so
  every other bucket runs the same kernel in both. Both steps are checked
  against `jax.jit` (loss and every gradient).

Run: ``PYTHONPATH=src:benchmarks python benchmarks/pointwise_native.py
{buckets,step} [--net demo|mobilenet|both] [--rounds N] [--reps N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

import _harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tunedjax as tj
from tunedjax import autotune
from tunedjax.autotune import _registry as reg
from tunedjax.autotune._conv_spec import ConvSpec

NATIVE = "matmul_1x1_native"
# (batch, height = width, in channels, out channels) of each step's 1x1 convolutions.
BUCKETS = {
    "demo": [(128, 32, 32, 32), (128, 16, 32, 64), (128, 16, 64, 64), (128, 8, 128, 32),
             (128, 8, 32, 128), (128, 8, 64, 128)],
    "mobilenet": [(32, 32, 32, 64), (32, 16, 128, 128), (32, 16, 64, 128),
                  (32, 8, 128, 256)],
}


def train_step_specs(n: int, hw: int, ci: int, co: int) -> dict[str, ConvSpec]:
  """The forward, weight-gradient and input-gradient specs of one NHWC 1x1 conv."""
  def loss(x, w):
    return jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "VALID",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((n, hw, hw, ci), (1, 1, ci, co))]
  closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args)
  specs = [ConvSpec.from_equation(e) for e in closed.jaxpr.eqns
           if e.primitive.name == "conv_general_dilated"]
  return dict(zip(("fwd", "wgrad", "igrad"), specs))


def _min_of(fn, reps: int) -> float:
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def buckets(nets: list[str], rounds: int, reps: int) -> None:
  rng = np.random.default_rng(0)
  print("| step | 1x1 conv | form | xla (ms) | old kernel | old (ms) | native (ms) "
        "| native / old, median | range | A/A |")
  print("|---|---|---|---:|---|---:|---:|---:|---:|---:|")
  for net in nets:
    for n, hw, ci, co in BUCKETS[net]:
      for form, spec in train_step_specs(n, hw, ci, co).items():
        old = "window_matmul" if form == "wgrad" else "matmul_1x1"
        a = jnp.asarray(rng.normal(size=spec.lhs_shape), jnp.float32)
        b = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
        fns = {}
        for name in ("xla", old, NATIVE):
          kernel = reg.get_kernel("conv", name)
          assert kernel.applicable(spec, "cpu"), (name, spec)
          jitted = jax.jit(lambda x, y, f=kernel.fn, s=spec: f(x, y, s))
          fns[name] = lambda j=jitted, a=a, b=b: j(a, b)
        want = np.asarray(fns["xla"](), np.float64)
        for name, fn in fns.items():
          err = np.max(np.abs(np.asarray(fn(), np.float64) - want)) / np.max(np.abs(want))
          assert err < 1e-4, (name, err)
        timed = {name: (lambda f=fn: _min_of(f, reps)) for name, fn in fns.items()}
        runs: dict[str, list[float]] = {k: [] for k in (*timed, _harness.CONTROL)}
        order = [*timed, _harness.CONTROL]
        timed[_harness.CONTROL] = timed[old]
        for r in range(rounds + 1):
          for name in order[r % len(order):] + order[:r % len(order)]:
            t = timed[name]()
            if r:
              runs[name].append(t)
        t = _harness.Timings(runs, old)
        lo, hi = t.spread(NATIVE)
        print(f"| {net} | {n}x{hw}x{hw}, {ci}->{co} | {form} | {t.median('xla') * 1e3:.2f} "
              f"| {old} | {t.median(old) * 1e3:.2f} | {t.median(NATIVE) * 1e3:.2f} "
              f"| {t.ratio(NATIVE):.2f} | {lo:.2f}-{hi:.2f} | {t.ratio(_harness.CONTROL):.2f} |",
              flush=True)


def _set_back(value: Any) -> int:
  """Sets every `NATIVE` winner in a cache file's JSON to the fastest other kernel."""
  count = 0
  if isinstance(value, dict):
    if value.get("winner") == NATIVE and "ratios" in value:
      others = {k: r for k, r in value["ratios"].items()
                if k != NATIVE and k not in value.get("rejected", {})}
      value["winner"] = min(others, key=others.get) if others else "xla"
      count += 1
    for v in value.values():
      count += _set_back(v)
  elif isinstance(value, list):
    for v in value:
      count += _set_back(v)
  return count


def step(nets: list[str], rounds: int, reps: int) -> None:
  import vs_pytorch  # pylint: disable=import-outside-toplevel
  for net in nets:
    rng = np.random.default_rng(0)
    if net == "mobilenet":
      params, loss, _ = vs_pytorch.mobilenet_jax(rng)
      fn = vs_pytorch.mobilenet_step(loss)
      state, batch, size = (params,), 32, 64
    else:
      params, stats, fn = vs_pytorch.demo_jax(32)
      state, batch, size = (params, stats), 128, 32
    x = jnp.asarray(rng.normal(size=(batch, size, size, 3)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, size=batch), jnp.int32)
    args = (*state, x, y)
    new_dir = tempfile.mkdtemp(prefix="tj-pw-new-")
    old_dir = tempfile.mkdtemp(prefix="tj-pw-old-")
    steps = {}
    new_cfg = {"kernel": {"enable": True}, "cache": {"dir": new_dir}}
    with tj.config_context(new_cfg):
      steps["new"] = tj.jit(fn, session=autotune.TuningSession())
      start = time.perf_counter()
      jax.block_until_ready(steps["new"](*args))
      print(f"{net}: tuned in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    switched = 0
    for path in pathlib.Path(new_dir).glob("*.json"):
      data = json.loads(path.read_text())
      switched += _set_back(data)
      (pathlib.Path(old_dir) / path.name).write_text(json.dumps(data))
    old_cfg = {"kernel": {"enable": True}, "cache": {"dir": old_dir, "readonly": True}}
    with tj.config_context(old_cfg):
      steps["old"] = tj.jit(fn, session=autotune.TuningSession())
      jax.block_until_ready(steps["old"](*args))
    ref = jax.jit(fn)(*args)
    ref_grads = vs_pytorch.flat_names(ref[1])
    configs = {"new": new_cfg, "old": old_cfg}
    for name, s in steps.items():
      with tj.config_context(configs[name]):
        out = s(*args)
        hlo = s.lower(*args).compile().as_text()
      err = vs_pytorch.agreement(float(out[0]), vs_pytorch.flat_names(out[1]),
                                 float(ref[0]), ref_grads)
      calls = hlo.count("tunedjax_TjPointwise")
      print(f"{net}: {name}: one step vs jax.jit {err:.1e}; pointwise FFI calls in the "
            f"program: {calls}", file=sys.stderr)
    print(f"{net}: {switched} bucket(s) won by {NATIVE} set back in the old cache",
          file=sys.stderr)

    def runner(name, configs=configs, steps=steps, args=args):
      def run():
        with tj.config_context(configs[name]):
          for _ in range(reps):
            out = steps[name](*args)
          return jax.block_until_ready(out)
      return run

    load = os.getloadavg()[0]
    t = _harness.interleaved({"old": runner("old"), "new": runner("new")}, baseline="old",
                             rounds=rounds, warmup=1)
    lo, hi = t.spread("new")
    alo, ahi = t.spread(_harness.CONTROL)
    print(f"| {net} | {rounds} | {reps} | {switched} | {t.median('old') * 1e3 / reps:.1f} "
          f"| {t.median('new') * 1e3 / reps:.1f} | {t.ratio('new'):.2f} | {lo:.2f}-{hi:.2f} "
          f"| {t.ratio(_harness.CONTROL):.2f} ({alo:.2f}-{ahi:.2f}) "
          f"| {load:.1f}-{os.getloadavg()[0]:.1f} |", flush=True)
    shutil.rmtree(new_dir, ignore_errors=True)
    shutil.rmtree(old_dir, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=("buckets", "step"))
  parser.add_argument("--net", choices=("demo", "mobilenet", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--reps", type=int, default=3,
                      help="buckets: calls per timing (the fastest kept); step: steps per timing")
  args = parser.parse_args(argv)
  nets = ["demo", "mobilenet"] if args.net == "both" else [args.net]
  print(f"load {os.getloadavg()[0]:.1f}; {_harness.machine_line()}", file=sys.stderr)
  if args.what == "buckets":
    buckets(nets, args.rounds, args.reps)
  else:
    if args.what == "step":
      print("| step | rounds | steps per timing | buckets switched | old (ms/step) "
            "| new (ms/step) | new / old, median | range | A/A (range) | load |")
      print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    step(nets, args.rounds, args.reps)
  print(f"load {os.getloadavg()[0]:.1f}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
