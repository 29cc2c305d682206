"""``depthwise_native`` against ``depthwise`` and ``xla``: per bucket, then in whole train steps.

Buckets: every depthwise convolution (forward, input and weight gradients) of the demo
step (`DemoNet`, width 32, batch 128, 32x32) and the MobileNet-style step
(`benchmarks/kernels.py`, batch 32, 64x64), each kernel jitted alone, in interleaved
rounds (``depthwise`` timed twice: the A/A control).

Whole steps under `tunedjax.jit` (tuned once into a fresh cache): every depthwise site
pinned by a hint to ``depthwise_native``, to ``depthwise`` (the baseline), or to a
benchmark-only kernel running one for one form and the other for the other (`SPLITS`),
and the tuned step as it is, in interleaved rounds.

``--quick``: the demo step at the smoke run's small sizes, 2 rounds. Prints its tables;
writes no section.

Run: `.venv/bin/python benchmarks/run.py depthwise_native [--quick]`.
"""

from __future__ import annotations

import tempfile
from typing import Any

import _native_bench as nb
import harness
import jax
import numpy as np

from tunedjax import autotune
from tunedjax.autotune import _registry as reg
from tunedjax.ops.conv import _native_depthwise as _conv_native
from tunedjax.ops.conv._family import conv_key, describe_conv
from tunedjax.ops.conv._spec import ConvSpec

KERNELS = ("depthwise", "depthwise_native", "xla")
SPLITS = {  # benchmark-only kernels: (weight-gradient form's kernel, channel form's kernel)
    "native_wgrad_only": ("depthwise_native", "depthwise"),
    "native_channel_only": ("depthwise", "depthwise_native"),
}


def _eqns(jaxpr: Any):
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def depthwise_specs(step: Any, args: tuple[Any, ...]) -> list[ConvSpec]:
  """The step's convolutions `depthwise_native` supports, once each."""
  specs = {}
  for eqn in _eqns(jax.make_jaxpr(step)(*args).jaxpr):
    if eqn.primitive.name == "conv_general_dilated":
      spec = ConvSpec.from_equation(eqn)
      if _conv_native.supports(spec):
        specs[spec] = None
  return list(specs)


def _form(spec: ConvSpec) -> str:
  if spec.batch_group_count > 1:
    return "weight gradient"
  return "input gradient" if spec.dimension_numbers[1] != (3, 2, 0, 1) else "forward"


def _by_form(wgrad: str, channel: str) -> Any:
  """A kernel running the weight-gradient form on `wgrad` and the channel form on `channel`."""
  fns = {name: reg.get_kernel("conv", name).fn for name in (wgrad, channel)}

  def fn(lhs, rhs, spec):
    return fns[wgrad if spec.batch_group_count > 1 else channel](lhs, rhs, spec)

  return fn


def _register_splits() -> None:
  def both(spec, platform):
    return all(reg.get_kernel("conv", k).applicable(spec, platform) for k in KERNELS[:2])

  for name, (wgrad, channel) in SPLITS.items():
    reg.register_kernel("conv", name, _by_form(wgrad, channel), applicable=both, replace=True)


def _hint(kernel: str) -> dict[str, Any]:
  return {"kernel": {"enable": True, "hints": {"conv": kernel}}}


def _steps(step: Any, args: tuple[Any, ...], rounds: int, cache_dir: str) -> tuple[Any, dict]:
  """The tuned step and the hinted ones, timed against the ``depthwise`` hint."""
  session, cache = autotune.TuningSession(), {"dir": cache_dir}
  steps = nb.compile_steps(step, args, {"tuned": {"kernel": {"enable": True}, "cache": cache}},
                           op="conv", session=session)
  _register_splits()  # after the tuned step: the tuner never times them
  try:
    steps.update(nb.compile_steps(step, args, {
        f"hint {k}": {**_hint(k), "cache": cache}
        for k in ("depthwise", "depthwise_native", *SPLITS)}, op="conv", session=session))
    t = nb.time_steps(steps, args, baseline="hint depthwise", rounds=rounds)
  finally:
    for name in SPLITS:
      reg.unregister_kernel("conv", name)
  return t, nb.checks(steps)


def measure(quick: bool = False) -> harness.Result:
  """Each net's depthwise buckets alone, then its whole steps."""
  rounds = 2 if quick else 7
  nets = ("demo",) if quick else ("demo", "mobilenet")
  result = harness.Result("depthwise_native", params={"quick": quick, "rounds": rounds,
                                                      "nets": nets})
  rng = np.random.default_rng(1)
  for net in nets:
    step, args = nb.net_step(net, quick)
    buckets = []
    for spec in depthwise_specs(step, args):
      label = f"{describe_conv(conv_key(spec))} ({_form(spec)})"
      result.timings[f"{net}: {label}"], errors = nb.time_kernels(
          spec, KERNELS, baseline="depthwise", rounds=rounds, rng=rng)
      buckets.append([label, errors["depthwise_native"]])
    with tempfile.TemporaryDirectory(prefix="depthwise_native_") as tmp:
      result.timings[net], found = _steps(step, args, rounds, tmp)
    result.figures[net] = {"buckets": buckets, "checks": found}
  return result.done()


def render(result: harness.Result) -> str:
  p = result.params
  lines = ["## Native depthwise convolutions (`benchmarks/depthwise_native.py`)", "",
           f"`benchmarks/run.py depthwise_native{' --quick' * p['quick']}`, {p['rounds']} "
           f"interleaved rounds. {result.machine} {result.load_line()}", "",
           "Each depthwise bucket alone:", "",
           "| step | bucket | xla ms | depthwise ms | depthwise_native ms | native / depthwise | "
           "A/A | rel. err vs xla |", "|---|---|---:|---:|---:|---:|---:|---:|"]
  for net in p["nets"]:
    for label, err in result.figures[net]["buckets"]:
      t = result.timings[f"{net}: {label}"]
      ms = {n: t.median(n) * 1e3 for n in KERNELS}
      lines.append(f"| {net} | {label} | {ms['xla']:.2f} | {ms['depthwise']:.2f} | "
                   f"{ms['depthwise_native']:.2f} | {t.ratio('depthwise_native'):.3f} | "
                   f"{t.ratio(harness.CONTROL):.3f} | {err:.1e} |")
  for net in p["nets"]:
    lines += ["", f"{net}: the whole step, every depthwise site pinned by a hint (the tuned "
              "step as it is), ratios to the `depthwise` hint:", "",
              harness.ratio_table(result.timings[net]), "",
              *nb.checks_lines(net, result.figures[net]["checks"])]
  return "\n".join(lines)
