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
{buckets,step} [--net demo|mobilenet|both] [--rounds N] [--reps N] [--profile N]``
(``--quick``: tiny buckets, the smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

import harness as _harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tunedjax as tj
from tunedjax import autotune
from tunedjax.ops.conv import _native_1x1 as _conv_native_1x1
from tunedjax.autotune import _registry as reg
from tunedjax.ops.conv._spec import ConvSpec

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


QUICK_BUCKETS = {"demo": [(2, 8, 8, 24)], "mobilenet": [(2, 8, 16, 8)]}


def buckets(nets: list[str], rounds: int, reps: int, table=None) -> None:
  rng = np.random.default_rng(0)
  print("| step | 1x1 conv | form | xla (ms) | old kernel | old (ms) | native (ms) "
        "| native / old, median | range | A/A |")
  print("|---|---|---|---:|---|---:|---:|---:|---:|---:|")
  for net in nets:
    for n, hw, ci, co in (table or BUCKETS)[net]:
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


def _spec_of(key: dict[str, Any]) -> ConvSpec | None:
  try:
    return ConvSpec(**{f.name: key[f.name] for f in dataclasses.fields(ConvSpec)})
  except (KeyError, TypeError):
    return None


def _set_back(value: Any, keep=lambda spec: False) -> int:
  """Sets `NATIVE` winners in a cache file's JSON to the fastest other kernel.

  Entries whose spec `keep` accepts keep `NATIVE`. Returns how many were set back.
  """
  count = 0
  if isinstance(value, dict):
    inner = value.get("value")
    if (isinstance(inner, dict) and inner.get("winner") == NATIVE and "ratios" in inner
        and not keep(_spec_of(value.get("key", {})))):
      others = {k: r for k, r in inner["ratios"].items()
                if k != NATIVE and k not in inner.get("rejected", {})}
      inner["winner"] = min(others, key=others.get) if others else "xla"
      return 1
    for v in value.values():
      count += _set_back(v, keep)
  elif isinstance(value, list):
    for v in value:
      count += _set_back(v, keep)
  return count


def step(nets: list[str], rounds: int, reps: int, profile: int = 0) -> None:
  import vs_pytorch  # pylint: disable=import-outside-toplevel
  for net in nets:
    fn, args = vs_pytorch.net_problem(net)[:2]
    new_dir = tempfile.mkdtemp(prefix="tj-pw-new-")
    old_dir = tempfile.mkdtemp(prefix="tj-pw-old-")
    steps = {}
    new_cfg = {"kernel": {"enable": True}, "cache": {"dir": new_dir}}
    with tj.config_context(new_cfg):
      steps["new"] = tj.jit(fn, session=autotune.TuningSession())
      start = time.perf_counter()
      jax.block_until_ready(steps["new"](*args))
      print(f"{net}: tuned in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    wgrad_dir = tempfile.mkdtemp(prefix="tj-pw-wgrad-")
    switched = kept = 0
    for path in pathlib.Path(new_dir).glob("*.json"):
      data = json.loads(path.read_text())
      switched += _set_back(data)
      (pathlib.Path(old_dir) / path.name).write_text(json.dumps(data))
      data = json.loads(path.read_text())
      kept -= _set_back(data, keep=lambda s: s is not None and
                        _conv_native_1x1.is_weight_grad_form(s))
      (pathlib.Path(wgrad_dir) / path.name).write_text(json.dumps(data))
    kept += switched
    configs = {"new": new_cfg}
    for name, folder in (("old", old_dir), ("wgrad only", wgrad_dir)):
      configs[name] = {"kernel": {"enable": True}, "cache": {"dir": folder, "readonly": True}}
      with tj.config_context(configs[name]):
        steps[name] = tj.jit(fn, session=autotune.TuningSession())
        jax.block_until_ready(steps[name](*args))
    ref = jax.jit(fn)(*args)
    ref_grads = vs_pytorch.flat_names(ref[1])
    for name, s in steps.items():
      with tj.config_context(configs[name]):
        out = s(*args)
        hlo = s.lower(*args).compile().as_text()
      err = vs_pytorch.agreement(float(out[0]), vs_pytorch.flat_names(out[1]),
                                 float(ref[0]), ref_grads)
      calls = hlo.count("tunedjax_TjPointwise")
      print(f"{net}: {name}: one step vs jax.jit {err:.1e}; pointwise FFI calls in the "
            f"program: {calls}", file=sys.stderr)
    print(f"{net}: {switched} bucket(s) won by {NATIVE} set back in the old cache; "
          f"{kept} weight-gradient bucket(s) keep it in the wgrad-only cache", file=sys.stderr)

    def runner(name, configs=configs, steps=steps, args=args):
      def run():
        with tj.config_context(configs[name]):
          for _ in range(reps):
            out = steps[name](*args)
          return jax.block_until_ready(out)
      return run

    for r in range(profile):  # thunk time per step, summed over threads, by group
      for name, jitted in steps.items():
        with tj.config_context(configs[name]):
          hlo = jitted.lower(*args).compile().as_text()
          groups, top = vs_pytorch.jax_profile(jitted, args, hlo, 3)
        print(f"{net}: profile {r} {name}: total {sum(groups.values()):.1f} ms; "
              + "; ".join(f"{g} {ms:.1f}" for g, ms in sorted(groups.items()))
              + " | top: " + "; ".join(f"{n} ({k}) {ms:.1f}" for n, k, ms in top[:6]),
              file=sys.stderr)
    load = os.getloadavg()[0]
    t = _harness.interleaved({name: runner(name) for name in steps}, baseline="old",
                             rounds=rounds, warmup=1)
    load = f"{load:.1f}-{os.getloadavg()[0]:.1f}"
    for name in ("new", "wgrad only", _harness.CONTROL):
      lo, hi = t.spread(name)
      print(f"| {net} | {name} | {rounds} | {reps} | {switched if name == 'new' else kept} "
            f"| {t.median('old') * 1e3 / reps:.1f} | {t.median(name) * 1e3 / reps:.1f} "
            f"| {t.ratio(name):.2f} | {lo:.2f}-{hi:.2f} | {load} |", flush=True)
    for folder in (new_dir, old_dir, wgrad_dir):
      shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=("buckets", "step"), nargs="?", default="buckets")
  parser.add_argument("--quick", action="store_true",
                      help="tiny buckets, one round (smoke); the step is not run")
  parser.add_argument("--net", choices=("demo", "mobilenet", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--reps", type=int, default=3,
                      help="buckets: calls per timing (the fastest kept); step: steps per timing")
  parser.add_argument("--profile", type=int, default=0,
                      help="step: profiled runs of each variant (thunk time by group) first")
  args = parser.parse_args(argv)
  nets = ["demo", "mobilenet"] if args.net == "both" else [args.net]
  print(f"load {os.getloadavg()[0]:.1f}; {_harness.machine_line()}", file=sys.stderr)
  if args.quick:
    buckets(nets, 1, 1, QUICK_BUCKETS)
  elif args.what == "buckets":
    buckets(nets, args.rounds, args.reps)
  else:
    if args.what == "step":
      print("| step | variant | rounds | steps per timing | buckets on native | old (ms/step) "
            "| variant (ms/step) | variant / old, median | range | load |")
      print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    step(nets, args.rounds, args.reps, args.profile)
  print(f"load {os.getloadavg()[0]:.1f}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
