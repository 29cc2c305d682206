"""The ``native`` batch-norm kernel: per bucket (tuner times) and inside the whole train steps.

For each of `benchmarks/vs_pytorch.py`'s two steps (MobileNet-style, batch 32 at 64x64;
the demo network, batch 128 at 32x32): `tj.jit` tunes the step into a fresh cache (the
table: each batch-norm bucket's forward+backward timings of ``xla``, ``fused`` and
``native`` from the tuner); copies of that cache set every batch-norm winner to the
kernel the tuner would have chosen without ``native`` ("current"), to its own choice
("tuned") and to ``native``; the three steps (each checked against `jax.jit`) in
interleaved rounds, ratios to "current" (timed twice as A/A).

``--quick``: the smoke run's small steps, convolutions pinned to ``xla`` (only batch
norm is tuned), 2 rounds. Prints its tables; writes no section.

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
