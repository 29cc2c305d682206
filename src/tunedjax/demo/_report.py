"""The demo's outputs: the side-by-side table, the JSON report and the PNG."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

from tunedjax import _tuning
from tunedjax.autotune import BucketChoice
from tunedjax.demo._run import RunResult


def _ratio(a: float, b: float) -> float:
  return a / b if b > 0 else math.nan


def ratios(baseline: RunResult, tuned: RunResult) -> dict[str, float]:
  """How many times faster the tuned run was: wall time, steady state, step."""
  return {
      "wall": _ratio(baseline.wall_s, tuned.wall_s),
      "steady_throughput": _ratio(tuned.steady_images_per_s, baseline.steady_images_per_s),
      "median_step": _ratio(baseline.median_step_ms, tuned.median_step_ms),
  }


def _loader_cell(run: RunResult) -> str:
  info = run.loader
  chosen = f"{info['worker_count']} workers, {info['read_threads']} threads"
  if info.get("from_cache"):
    return chosen + " (from cache)"
  if info.get("stopped") == "consumer-bound":
    return chosen + f" (the step is the bottleneck, checked in {info['seconds']:.1f} s)"
  if info.get("stopped") == "no payback":
    return chosen + f" (read in series: no trial could pay back, {info['seconds']:.2f} s)"
  if not info.get("trials"):
    return chosen + " (as given)"
  return chosen + f" (measured in {info['seconds']:.1f} s)"


def _tuning_s(run: RunResult) -> float:
  loader = 0.0 if run.loader.get("from_cache") else float(run.loader.get("seconds", 0.0))
  return run.kernel_tuning_s + loader


def summary_rows(baseline: RunResult, tuned: RunResult) -> list[tuple[str, str, str, str]]:
  """(what, baseline, tunedjax, tunedjax's gain) rows of the side-by-side table."""
  r = ratios(baseline, tuned)
  epochs = max(len(baseline.epoch_s), 1)
  per_epoch = (baseline.wall_s / epochs, tuned.wall_s / max(len(tuned.epoch_s), 1))
  return [
      ("time per epoch (compile and tuning included)", f"{per_epoch[0]:.1f} s",
       f"{per_epoch[1]:.1f} s", f"{r['wall']:.2f}x"),
      ("last epoch", f"{baseline.epoch_s[-1]:.1f} s" if baseline.epoch_s else "-",
       f"{tuned.epoch_s[-1]:.1f} s" if tuned.epoch_s else "-",
       f"{_ratio(baseline.epoch_s[-1], tuned.epoch_s[-1]):.2f}x"
       if baseline.epoch_s and tuned.epoch_s else "-"),
      ("throughput, steady state", f"{baseline.steady_images_per_s:.0f} img/s",
       f"{tuned.steady_images_per_s:.0f} img/s", f"{r['steady_throughput']:.2f}x"),
      ("median step", f"{baseline.median_step_ms:.0f} ms", f"{tuned.median_step_ms:.0f} ms",
       f"{r['median_step']:.2f}x"),
      ("loader", _loader_cell(baseline), _loader_cell(tuned), ""),
      ("layout", baseline.layout, tuned.layout, ""),
      ("precision", baseline.precision, tuned.precision, ""),
      ("kernel cache", "-", f"{tuned.kernel_cache_hits} hits, "
       f"{tuned.kernel_cache_misses} misses", ""),
      ("tuning (kernels + loader)", f"{_tuning_s(baseline):.1f} s", f"{_tuning_s(tuned):.1f} s",
       ""),
      ("final accuracy (held out)", f"{100 * baseline.accuracy:.1f}%",
       f"{100 * tuned.accuracy:.1f}%", ""),
  ]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
  lines += [fmt.format(*map(str, row)) for row in rows]
  return "\n".join(line.rstrip() for line in lines)


def loader_trials(run: RunResult) -> str:
  """The loader's measurements: throughput for each (workers, threads) tried."""
  trials = run.loader.get("trials") or []
  if not trials:
    return ""
  best: dict[tuple[int, int], float] = {}
  for t in trials:
    key = (t["worker_count"], t["read_threads"])
    best[key] = max(best.get(key, 0.0), t["batches_per_s"])
  cells = [f"{w}w/{th}t {bps:.2f}" for (w, th), bps in best.items()]
  return "loader trials (workers/threads: steps per s, training step included): " + ", ".join(
      cells)


def _why(row: BucketChoice) -> str:
  """Why a bucket runs its kernel, in a few words."""
  if row.horizon is not None:
    return f"not tuned: cannot pay back in {row.horizon} steps"
  if row.kernel is None:
    return ""
  if row.speedup is None and row.decided == "predicted" and row.compiled is not None:
    return f"predicted: none faster ({row.compiled} of {len(row.candidates)} compiled)"
  if row.speedup is None:
    return "only kernel" if row.kernel == "xla" else ""
  why = "fastest" if row.kernel != "xla" else "xla fastest"
  if row.decided == "predicted" and row.compiled is not None:
    regret = "" if row.regret is None else f", regret {row.regret:.2f}"
    why += f" (predicted: {row.compiled} of {len(row.candidates)} compiled{regret})"
  return why


def kernel_rows(rows: Sequence[BucketChoice]) -> list[tuple[str, ...]]:
  """One row per bucket: bucket, sites, kernel, xla ms, kernel ms, speedup, why."""
  out = []
  for r in rows:
    speedup = None if r.horizon is not None else r.speedup
    out.append((r.bucket.removeprefix("conv "), str(r.count), r.kernel or "(not tuned)",
                "-" if r.xla_ms is None else f"{r.xla_ms:.1f}",
                "-" if r.kernel_ms is None or r.horizon is not None else f"{r.kernel_ms:.1f}",
                "-" if speedup is None else f"{speedup:.2f}x", _why(r)))
  return out


def format_report(report: dict[str, Any], baseline: RunResult, tuned: RunResult,
                  buckets: Sequence[BucketChoice]) -> str:
  """The text the demo prints."""
  parts = [
      f"tunedjax demo: {report['data']['description']}",
      f"machine: {report['machine']['device']}, jax {report['machine']['jax']}",
      "",
      _table(("", "baseline", "tunedjax", "gain"), summary_rows(baseline, tuned)),
      "",
  ]
  trials = loader_trials(tuned)
  if trials:
    parts += [trials, ""]
  parts += [_table(("bucket (conv: lhs * rhs)", "sites", "kernel", "xla ms", "kernel ms",
                    "speedup", "why"), kernel_rows(buckets)), ""]
  first = first_call_rows(baseline, tuned)
  if first:
    parts += [_table(("the step's first call", "baseline", "tunedjax"), first), ""]
  return "\n".join(parts)


def first_call_rows(baseline: RunResult, tuned: RunResult) -> list[tuple[str, str, str]]:
  """Each run's first call of its training step, seconds per stage (`tunedjax.FirstCall`).

  Example:
    >>> import types
    >>> b = types.SimpleNamespace(first_call={"total_s": 1.0, "stages": {"compile": 1.0}})
    >>> t = types.SimpleNamespace(first_call={"total_s": 2.0, "stages": {"trace": 0.5,
    ...                                                                  "compile": 1.5}})
    >>> first_call_rows(b, t)
    [('trace', '-', '0.50 s'), ('compile', '1.00 s', '1.50 s'), ('total', '1.00 s', '2.00 s')]
  """
  runs = [r.first_call for r in (baseline, tuned)]
  if not any(runs):
    return []
  names = list(dict.fromkeys(n for r in runs if r for n in r["stages"]))
  order = {n: i for i, n in enumerate(_tuning.FIRST_CALL_STAGES)}
  names.sort(key=lambda n: order.get(n, len(order)))
  cell = lambda r, n: "-" if not r or n not in r["stages"] else f"{r['stages'][n]:.2f} s"  # pylint: disable=unnecessary-lambda-assignment
  rows = [(n, cell(runs[0], n), cell(runs[1], n)) for n in names]
  return rows + [("total", *("-" if not r else f"{r['total_s']:.2f} s" for r in runs))]


def write_json(path: pathlib.Path, report: dict[str, Any]) -> None:
  """Writes the report (NaN written as JSON's NaN, which Python reads back)."""
  path.write_text(json.dumps(report, indent=2, default=_plain) + "\n")


def _plain(value: Any) -> Any:
  if dataclasses.is_dataclass(value):
    return dataclasses.asdict(value)
  if hasattr(value, "tolist"):
    return value.tolist()
  return str(value)


def plot(path: pathlib.Path, baseline: RunResult, tuned: RunResult) -> bool:
  """Loss curves, median step times and wall-time bars, as a PNG. False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  fig, (ax_loss, ax_step, ax_wall) = plt.subplots(1, 3, figsize=(15, 4.2))
  colors = {"baseline": "tab:gray", "tunedjax": "tab:blue"}
  for run, style in ((baseline, {"lw": 3.5, "alpha": 0.6}), (tuned, {"lw": 1.2, "ls": "--"})):
    ax_loss.plot(range(len(run.losses)), run.losses, label=run.name, color=colors[run.name],
                 **style)
  ax_loss.set(title="Training loss (same batches: the curves overlap)", xlabel="step",
              ylabel="cross-entropy loss")
  ax_loss.legend()
  names = [baseline.name, tuned.name]
  steps = [baseline.median_step_ms, tuned.median_step_ms]
  bars = ax_step.bar(names, steps, color=[colors[n] for n in names])
  ax_step.bar_label(bars, fmt="%.0f ms")
  ax_step.set(title="Median training step", ylabel="milliseconds per step",
              ylim=(0, 1.15 * max(steps)))
  tuning = [_tuning_s(baseline), _tuning_s(tuned)]
  rest = [baseline.wall_s - tuning[0], tuned.wall_s - tuning[1]]
  ax_wall.bar(names, rest, color=[colors[n] for n in names], label="training and compiling")
  ax_wall.bar(names, tuning, bottom=rest, color="tab:orange", label="tuning")
  for i, total in enumerate((baseline.wall_s, tuned.wall_s)):
    ax_wall.text(i, total, f"{total:.0f} s", ha="center", va="bottom")
  ax_wall.set(title="Wall time of the run", ylabel="seconds",
              ylim=(0, 1.15 * max(baseline.wall_s, tuned.wall_s)))
  ax_wall.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True
