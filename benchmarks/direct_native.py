"""The ``direct_native`` conv kernel: per bucket and inside the whole train steps.

For each of `benchmarks/vs_pytorch.py`'s two steps (MobileNet-style, batch 32 at 64x64;
the demo network, batch 128 at 32x32): `tj.jit` tunes the step into a fresh cache (the
table: the tuner's timings of each bucket where ``direct_native`` is a candidate); copies
of that cache set ``direct_native``'s winners back to the kernel the tuner would have
chosen without it in every bucket ("current"), in the weight-gradient buckets ("window
form only") or in the window buckets ("weight-gradient form only"); the tuned cache is
"both forms". The four steps (each checked against `jax.jit`) in interleaved rounds
("current" twice as A/A), by the wall clock and by this process's CPU time.

Then each dense-window bucket alone (`BUCKETS`): the applicable kernels (``fft`` and
``pallas`` left out) in interleaved rounds, ratios to ``xla``'s.

``--quick``: the smoke run's small steps, 2 rounds, one bucket alone. Prints its tables;
writes no section.

Run: `.venv/bin/python benchmarks/run.py direct_native [--quick]`.
"""

from __future__ import annotations

import tempfile
from typing import Any

import _native_bench as nb
import harness
import numpy as np

from tunedjax.autotune import _registry
from tunedjax.ops.conv import _native_direct as direct
from tunedjax.ops.conv._family import describe_conv
from tunedjax.ops.conv._spec import ConvSpec

KERNELS = ("xla", "im2col", "window_matmul", "direct_native")
NEW = "direct_native"
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
QUICK_BUCKETS = ("demo bottleneck 3x3, forward (128x8x8x32, 3x3x32x32)",)
# Which buckets keep direct_native in each variant's cache (by form); the others are set back.
VARIANTS = {"current": (), "window form only": ("window",),
            "weight-gradient form only": ("wgrad",), "both forms": ("window", "wgrad")}


def _form(key: dict[str, Any]) -> str:
  return "window" if direct.is_window_form(nb.conv_spec(key)) else "wgrad"


def _set_back(keep: tuple[str, ...]):
  def winner(entry):
    if entry.value["winner"] == NEW and _form(entry.key) not in keep:
      return nb.without(entry.value, (NEW,))
    return None
  return winner


def measure(quick: bool = False) -> harness.Result:
  """Both steps (tuner buckets, the four steps timed), then the buckets alone."""
  rounds = 2 if quick else 9
  result = harness.Result("direct_native", params={"quick": quick, "rounds": rounds})
  for net in nb.NETS:
    step, args = nb.net_step(net, quick)
    with tempfile.TemporaryDirectory(prefix="direct_native_") as tmp:
      tuned = f"{tmp}/tuned"
      _, tuning_s = nb.tune(step, args, {"kernel": {"enable": True}, "cache": {"dir": tuned}})
      rows = nb.tuner_rows(tuned, "conv", (NEW,), keep=lambda e: NEW in e.value["timings"])
      configs = nb.cache_variants(tuned, tmp, "conv",
                                  {name: _set_back(keep) for name, keep in VARIANTS.items()})
      steps = nb.compile_steps(step, args, configs, op="conv")
      t = nb.time_steps(steps, args, baseline="current", rounds=rounds, cpu_time=True)
    result.timings[net] = t
    result.timings[f"{net}, CPU time"] = t.cpu_time()
    result.figures[net] = {"tuning_s": tuning_s, "buckets": rows, "checks": nb.checks(steps)}
  rng = np.random.default_rng(0)
  alone = []
  for name in QUICK_BUCKETS if quick else BUCKETS:
    spec = BUCKETS[name]
    kernels = [k.name for k in _registry.applicable_kernels(spec, "cpu", "conv")
               if k.name in KERNELS]
    result.timings[name], _ = nb.time_kernels(spec, kernels, baseline="xla", rounds=rounds, rng=rng)
    alone.append(name)
  result.figures["alone"] = alone
  return result.done()


def render(result: harness.Result) -> str:
  p = result.params
  lines = ["## Native direct convolutions (`benchmarks/direct_native.py`)", "",
           f"`benchmarks/run.py direct_native{' --quick' * p['quick']}`. "
           f"{result.machine} {result.load_line()}"]
  for net in nb.NETS:
    fig = result.figures[net]
    lines += ["", f"**{net}**: tuned in {fig['tuning_s']:.1f} s; the tuner's timings of the "
              f"buckets where `{NEW}` is a candidate (median of its rounds):", "",
              nb.tuner_table(fig["buckets"], KERNELS, (NEW,),
                             lambda key: f"{describe_conv(key)} ({_form(key)})"),
              "", f"{net} step, {p['rounds']} interleaved rounds; wall time:", "",
              harness.ratio_table(result.timings[net]), "",
              "this process's CPU time (user + system, every thread) per step:", "",
              harness.ratio_table(result.timings[f"{net}, CPU time"]), "",
              *nb.checks_lines(net, fig["checks"])]
  lines += ["", f"Each dense-window bucket alone: time over `xla`'s, {p['rounds']} interleaved "
            "rounds (`fft` and `pallas` left out; `-`: not applicable):", "",
            "| bucket | xla (ms) | im2col | window_matmul | direct_native | A/A |",
            "|---|---:|---:|---:|---:|---:|"]
  for name in result.figures["alone"]:
    t = result.timings[name]
    cells = [f"{t.ratio(k):.2f}" if k in t.runs else "-" for k in KERNELS[1:]]
    lines.append(f"| {name} | {t.median('xla') * 1e3:.2f} | {' | '.join(cells)} | "
                 f"{t.ratio(harness.CONTROL):.2f} |")
  return "\n".join(lines)
