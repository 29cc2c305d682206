"""The ``native`` batch-norm kernel: per bucket (tuner times) and inside the whole train steps.

For each of the two steps of `benchmarks/vs_pytorch.py` (the MobileNet-style
step, batch 32 at 64x64, and the demo network, batch 128 at 32x32):

1. `tj.jit` with kernel selection tunes the step into a fresh cache; every
   batch-norm bucket's entry holds the tuner's forward+backward timings of
   ``xla``, ``fused`` and ``native`` (the table: each kernel's median over
   the tuner's rounds, and the chosen one).
2. Copies of that cache with every batch-norm winner set: to the kernel the
   tuner would have chosen without ``native`` (its own rule on the other
   kernels' ratios): "current"; to the tuner's own choice: "tuned"; to
   ``native`` everywhere: "native".
3. The three compiled steps (each first checked against `jax.jit`: one
   step's loss and gradients, `vs_pytorch.agreement`), timed in interleaved
   rounds ("current" timed twice as an A/A control); ratios are medians of
   per-round ratios to "current".

``--quick``: the smoke run's small steps, convolutions pinned to ``xla`` (only
batch norm is tuned), 2 rounds. Prints its tables; writes no section.

Run: `.venv/bin/python benchmarks/run.py bn_native [--quick]`.
"""

from __future__ import annotations

import tempfile

import _native_bench as nb
import harness

KERNELS = ("xla", "fused", "native")
NEW = ("native",)


def measure(quick: bool = False) -> harness.Result:
  """Both steps: the tuner's batch-norm buckets, then the three steps timed."""
  rounds = 2 if quick else 9
  # --quick: convolutions pinned to xla, so only batch norm is tuned.
  kernel = {"enable": True, **({"hints": {"conv": "xla"}} if quick else {})}
  result = harness.Result("bn_native", params={"quick": quick, "rounds": rounds})
  for net in nb.NETS:
    step, args = nb.net_step(net, quick)
    with tempfile.TemporaryDirectory(prefix="bn_native_") as tmp:
      tuned = f"{tmp}/tuned"
      _, tuning_s = nb.tune(step, args, {"kernel": kernel, "cache": {"dir": tuned}})
      rows = nb.tuner_rows(tuned, "batch_norm", NEW)
      configs = nb.cache_variants(tuned, tmp, "batch_norm", {
          "current": lambda e: nb.without(e.value, NEW),
          "tuned": lambda e: None,
          "native": lambda e: "native"}, config={"kernel": kernel})
      steps = nb.compile_steps(step, args, configs, op="batch_norm")
      result.timings[net] = nb.time_steps(steps, args, baseline="current", rounds=rounds)
    result.figures[net] = {"tuning_s": tuning_s, "buckets": rows, "checks": nb.checks(steps)}
  return result.done()


def render(result: harness.Result) -> str:
  lines = ["## Native batch norm (`benchmarks/bn_native.py`)", "",
           f"`benchmarks/run.py bn_native{' --quick' * result.params['quick']}`. "
           f"{result.machine} {result.load_line()}"]
  for net in nb.NETS:
    fig = result.figures[net]
    lines += ["", f"**{net}**: tuned in {fig['tuning_s']:.1f} s; the tuner's timings "
              "(forward+backward, median of its rounds):", "",
              nb.tuner_table(fig["buckets"], KERNELS, NEW,
                             lambda key: "batch_norm " + "x".join(map(str, key["shape"]))),
              "", f"{net} step, {result.params['rounds']} interleaved rounds:", "",
              harness.ratio_table(result.timings[net]), "", *nb.checks_lines(net, fig["checks"])]
  return "\n".join(lines)
