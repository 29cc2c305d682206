"""`matmul_1x1_native` against the kernels it would replace: per bucket and in the whole step.

In interleaved rounds, the old kernel timed twice as an A/A control:

* buckets: each 1x1 convolution of the demo and MobileNet-style steps in its three forms
  (forward, weight and input gradients), each kernel jitted alone (``xla``,
  ``matmul_1x1`` or ``window_matmul``, ``matmul_1x1_native``), checked against xla first;
* the step (`vs_pytorch.py`'s), tuned into a fresh cache, then compiled from copies of
  it: ``new`` (the tuner's choice), ``old`` (``matmul_1x1_native``'s winners set back to
  what the tuner would have chosen without it) and ``wgrad only`` (set back but in the
  weight-gradient buckets), each checked against `jax.jit`.

``--quick`` (`make test`'s smoke run): tiny buckets, 2 rounds; the step is not run.
Prints its tables; writes no section.

Run: `.venv/bin/python benchmarks/run.py pointwise_native [--quick]`.
"""

from __future__ import annotations

import tempfile

import _native_bench as nb
import harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunedjax import autotune
from tunedjax.ops.conv import _native_1x1 as _conv_native_1x1
from tunedjax.ops.conv._spec import ConvSpec

NATIVE = "matmul_1x1_native"
# (batch, height = width, in channels, out channels) of each step's 1x1 convolutions.
BUCKETS = {
    "demo": [(128, 32, 32, 32), (128, 16, 32, 64), (128, 16, 64, 64), (128, 8, 128, 32),
             (128, 8, 32, 128), (128, 8, 64, 128)],
    "mobilenet": [(32, 32, 32, 64), (32, 16, 128, 128), (32, 16, 64, 128),
                  (32, 8, 128, 256)],
}
QUICK_BUCKETS = {"demo": [(2, 8, 8, 24)], "mobilenet": [(2, 8, 16, 8)]}
NETS = ("demo", "mobilenet")
STEP_BASELINE = "old"


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


def _old(form: str) -> str:
  return "window_matmul" if form == "wgrad" else "matmul_1x1"


def _buckets(result: harness.Result, table: dict, rounds: int, reps: int) -> list[list]:
  rng = np.random.default_rng(0)
  rows = []
  for net in NETS:
    for n, hw, ci, co in table[net]:
      for form, spec in train_step_specs(n, hw, ci, co).items():
        t, errors = nb.time_kernels(spec, ("xla", _old(form), NATIVE), baseline=_old(form),
                                    rounds=rounds, rng=rng, burst=reps)
        assert max(errors.values()) < 1e-4, errors
        rows.append([net, f"{n}x{hw}x{hw}, {ci}->{co}", form])
        result.timings[" ".join(rows[-1])] = t
  return rows


def _set_back(keep_wgrad: bool):
  def winner(entry):
    if entry.value["winner"] != NATIVE:
      return None
    if keep_wgrad and _conv_native_1x1.is_weight_grad_form(nb.conv_spec(entry.key)):
      return None
    return nb.without(entry.value, (NATIVE,))
  return winner


def _step(result: harness.Result, net: str, rounds: int, reps: int) -> None:
  step, args = nb.net_step(net, False)
  with tempfile.TemporaryDirectory(prefix="pointwise_native_") as tmp:
    tuned = f"{tmp}/tuned"
    _, tuning_s = nb.tune(step, args, {"kernel": {"enable": True}, "cache": {"dir": tuned}})
    winners = {"new": lambda e: None, "old": _set_back(False), "wgrad only": _set_back(True)}
    configs = nb.cache_variants(tuned, tmp, "conv", winners)
    steps = nb.compile_steps(step, args, configs, op="conv")
    on_native = {name: sum(e.value["winner"] == NATIVE for e in
                           autotune.Cache(c["cache"]["dir"]).entries("conv"))
                 for name, c in configs.items()}
    ffi = {}
    for name, s in steps.items():
      hlo = nb.in_config(s.config, lambda s=s: s.fn.lower(*args).compile().as_text())
      ffi[name] = hlo.count("tunedjax_TjPointwise")
    result.timings[net] = nb.time_steps(steps, args, baseline=STEP_BASELINE, rounds=rounds,
                                        burst=reps)
  result.figures[net] = {"tuning_s": tuning_s, "checks": nb.checks(steps),
                         "buckets_on_native": on_native, "ffi_calls": ffi}


def measure(quick: bool = False) -> harness.Result:
  """The buckets alone, then (not with `quick`) both whole steps."""
  rounds, reps = (2, 1) if quick else (7, 3)
  result = harness.Result("pointwise_native", params={"quick": quick, "rounds": rounds,
                                                      "reps": reps})
  result.figures["buckets"] = _buckets(result, QUICK_BUCKETS if quick else BUCKETS, rounds, reps)
  for net in () if quick else NETS:
    _step(result, net, rounds, reps)
  return result.done()


def render(result: harness.Result) -> str:
  p = result.params
  lines = ["## Native 1x1 convolutions (`benchmarks/pointwise_native.py`)", "",
           f"`benchmarks/run.py pointwise_native{' --quick' * p['quick']}`: {p['rounds']} "
           "interleaved rounds" + (f" of {p['reps']} consecutive calls each (their mean)"
                                   if p["reps"] > 1 else "")
           + f". {result.machine} {result.load_line()}", "",
           "| step | 1x1 conv | form | xla (ms) | old kernel | old (ms) | native (ms) "
           "| native / old, median | range | A/A |",
           "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
  for net, conv, form in result.figures["buckets"]:
    t, old = result.timings[f"{net} {conv} {form}"], _old(form)
    lo, hi = t.spread(NATIVE)
    lines.append(f"| {net} | {conv} | {form} | {t.median('xla') * 1e3:.2f} | {old} | "
                 f"{t.median(old) * 1e3:.2f} | {t.median(NATIVE) * 1e3:.2f} | "
                 f"{t.ratio(NATIVE):.2f} | {lo:.2f}-{hi:.2f} | {t.ratio(harness.CONTROL):.2f} |")
  if p["quick"]:
    lines += ["", "(`--quick`: the whole steps are not run.)"]
  for net in () if p["quick"] else NETS:
    fig = result.figures[net]
    notes = {name: f"{n} bucket(s) on {NATIVE}; {fig['ffi_calls'][name]} pointwise FFI calls"
             for name, n in fig["buckets_on_native"].items()}
    lines += ["", f"**{net}** step (tuned in {fig['tuning_s']:.0f} s), {p['reps']} steps per "
              f"timing, ratios to `{STEP_BASELINE}`:", "",
              harness.ratio_table(result.timings[net], unit="ms per step", notes=notes), "",
              *nb.checks_lines(net, fig["checks"])]
  return "\n".join(lines)
