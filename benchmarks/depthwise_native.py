"""``depthwise_native`` against ``depthwise`` and ``xla``: per bucket, then in whole train steps.

Buckets: every depthwise convolution (forward, input gradient, weight gradient)
of the demo network's train step (`DemoNet`, width 32, batch 128, 32x32) and of
the MobileNet-style step (`benchmarks/kernels.py`, batch 32, 64x64), each
kernel jitted alone on random operands, in interleaved rounds (the baseline,
``depthwise``, timed twice as an A/A control).

Whole steps: the step under `tunedjax.jit` (kernel selection on, tuned once
into a fresh cache), then the same step with every depthwise site pinned by a
hint to ``depthwise_native`` or to ``depthwise`` (the other convolutions and
batch norm keep their tuned kernels from the same session and cache), and the
tuned step as it is, in interleaved rounds with the ``depthwise`` hint as the
baseline and its A/A control.

Run: `PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/depthwise_native.py
[--part buckets|steps|both] [--net demo|mobilenet|both] [--rounds N]`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import warnings
from typing import Any

# vs_pytorch re-runs a script under .venv-torch when torch is missing; only its JAX side
# is used here.
os.environ.setdefault("TUNEDJAX_VS_PYTORCH_REEXEC", "1")

import harness as _harness
import jax
import jax.numpy as jnp
import numpy as np
import vs_pytorch

import tunedjax as tj
from tunedjax import autotune
from tunedjax.ops.conv import _native_depthwise as _conv_native
from tunedjax.autotune import _registry as reg
from tunedjax.ops.conv._family import conv_key, describe_conv
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.autotune._hints import HintWarning

KERNELS = ("depthwise", "depthwise_native", "xla")


QUICK = False  # --quick: vs_pytorch's --quick sizes


def net_step(net: str) -> tuple[Any, tuple[Any, ...]]:
  """The step function and its arguments, as `vs_pytorch.run_net` builds them."""
  return vs_pytorch.net_problem(net, QUICK)[:2]


def _eqns(jaxpr: Any):
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def depthwise_specs(net: str) -> list[ConvSpec]:
  """The step's convolutions `depthwise_native` supports, once each."""
  step, args = net_step(net)
  closed = jax.make_jaxpr(step)(*args)
  specs = {}
  for eqn in _eqns(closed.jaxpr):
    if eqn.primitive.name == "conv_general_dilated":
      spec = ConvSpec.from_equation(eqn)
      if _conv_native.supports(spec):
        specs[spec] = None
  return list(specs)


def _form(spec: ConvSpec) -> str:
  if spec.batch_group_count > 1:
    return "weight gradient"
  return "input gradient" if spec.dimension_numbers[1] != (3, 2, 0, 1) else "forward"


def _run_kernel(fn: Any, lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  return jax.block_until_ready(fn(lhs, rhs, spec))


def time_buckets(net: str, rounds: int) -> list[str]:
  rows = []
  rng = np.random.default_rng(1)
  for spec in depthwise_specs(net):
    lhs = jnp.asarray(rng.normal(size=spec.lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=spec.rhs_shape), jnp.float32)
    variants, outs = {}, {}
    for name in KERNELS:
      fn = jax.jit(reg.get_kernel("conv", name).fn, static_argnums=2)
      outs[name] = np.asarray(fn(lhs, rhs, spec))
      variants[name] = functools.partial(_run_kernel, fn, lhs, rhs, spec)
    scale = float(np.max(np.abs(outs["xla"])))
    err = float(np.max(np.abs(outs["depthwise_native"] - outs["xla"]))) / scale
    t = _harness.interleaved(variants, baseline="depthwise", rounds=rounds, warmup=1)
    ms = {n: t.median(n) * 1e3 for n in KERNELS}
    label = describe_conv(conv_key(spec))
    rows.append(f"| {net} | {label} ({_form(spec)}) | {ms['xla']:.2f} | {ms['depthwise']:.2f} | "
                f"{ms['depthwise_native']:.2f} | {t.ratio('depthwise_native'):.3f} | "
                f"{t.ratio(_harness.CONTROL):.3f} | {err:.1e} |")
    print(rows[-1], flush=True)
  return rows


def _by_form(wgrad: str, channel: str) -> Any:
  """A kernel running the weight-gradient form on `wgrad` and the channel form on `channel`."""
  fns = {name: reg.get_kernel("conv", name).fn for name in (wgrad, channel)}

  def fn(lhs, rhs, spec):
    return fns[wgrad if spec.batch_group_count > 1 else channel](lhs, rhs, spec)

  return fn


SPLITS = {  # benchmark-only kernels: depthwise_native for one form, depthwise for the other
    "native_wgrad_only": ("depthwise_native", "depthwise"),
    "native_channel_only": ("depthwise", "depthwise_native"),
}


def register_splits() -> None:
  def both(spec, platform):
    return all(reg.get_kernel("conv", k).applicable(spec, platform) for k in KERNELS[:2])

  for name, (wgrad, channel) in SPLITS.items():
    reg.register_kernel("conv", name, _by_form(wgrad, channel), applicable=both, replace=True)


def time_steps(net: str, rounds: int, cache_dir: str, split: bool = False) -> list[str]:
  step, args = net_step(net)
  session = autotune.TuningSession()
  cache = {"dir": cache_dir}
  variants: dict[str, Any] = {}
  outs = {}
  configs = {
      "hint depthwise": {"kernel": {"enable": True, "hints": {"conv": "depthwise"}}},
      "hint depthwise_native": {"kernel": {"enable": True,
                                           "hints": {"conv": "depthwise_native"}}},
      "tuned": {"kernel": {"enable": True}},
  }
  for split_name in SPLITS if split else ():
    configs[f"hint {split_name}"] = {"kernel": {"enable": True, "hints": {"conv": split_name}}}
  for name in ("tuned", *(n for n in configs if n != "tuned")):
    config = {**configs[name], "cache": cache}
    with tj.config_context(config), warnings.catch_warnings():
      warnings.simplefilter("ignore", HintWarning)
      fn = tj.jit(step, session=session)
      outs[name] = jax.block_until_ready(fn(*args))
      kernels = fn.report(memory=False).last.kernels
    print(f"{net} {name}: {dict(sorted(kernels.items()))}", file=sys.stderr, flush=True)

    def run(fn=fn, config=config):
      with tj.config_context(config), warnings.catch_warnings():
        warnings.simplefilter("ignore", HintWarning)
        return jax.block_until_ready(fn(*args))

    variants[name] = run
    if name == "tuned" and split:
      register_splits()  # after the tuned step: the tuner never times them
  ref = jax.tree.leaves(outs["hint depthwise"])
  for name, out in outs.items():
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
              for a, b in zip(jax.tree.leaves(out), ref))
    print(f"{net} {name} vs hint depthwise: max relative error {err:.1e}", file=sys.stderr)
  t = _harness.interleaved(variants, baseline="hint depthwise", rounds=rounds, warmup=1)
  for split_name in SPLITS if split else ():
    reg.unregister_kernel("conv", split_name)
  rows = []
  for name in (*variants, _harness.CONTROL):
    lo, hi = t.spread(name)
    rows.append(f"| {net} | {name} | {rounds} | {t.median(name) * 1e3:.1f} | "
                f"{t.ratio(name):.3f} | {lo:.2f}-{hi:.2f} |")
    print(rows[-1], flush=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("buckets", "steps", "both"), default="both")
  parser.add_argument("--net", choices=("demo", "mobilenet", "both"), default="both")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--cache-dir", default=None, help="tuning cache (default: a fresh one)")
  parser.add_argument("--split", action="store_true",
                      help="also pin depthwise_native for one form only (each way round)")
  parser.add_argument("--quick", action="store_true", help="tiny shapes, one round (smoke)")
  args = parser.parse_args(argv)
  if args.quick:
    global QUICK
    QUICK, args.rounds, args.net = True, 1, "demo"
  nets = ("demo", "mobilenet") if args.net == "both" else (args.net,)
  print(f"load average {os.getloadavg()}", flush=True)
  if args.part in ("buckets", "both"):
    print("| step | bucket | xla ms | depthwise ms | depthwise_native ms | "
          "native / depthwise | A/A | rel. err vs xla |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for net in nets:
      time_buckets(net, args.rounds)
  if args.part in ("steps", "both"):
    print("| step | variant | rounds | median ms | ratio to hint depthwise | per-round range |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
      for net in nets:
        time_steps(net, args.rounds, args.cache_dir or tmp, split=args.split)
  print(f"load average {os.getloadavg()}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
