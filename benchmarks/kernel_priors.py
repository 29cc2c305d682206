"""Kernel priors: measure them, ship them, and measure how well they predict.

``collect`` (`measure`): tunes every kernel bucket of three networks exhaustively
(``kernel.predict`` and ``kernel.payback`` off), each into a cache folder of its own: the
demo network (`DemoNet`, batch 128, 32x32, through the `Trainer`, so its batch norms are
sites too), the MobileNet-style step of ``kernels.py`` (batch 32, 64x64) and the ResNet-18
step of ``jit_overhead.py`` (batch 8, 64x64, NCHW, re-laid by the layout pass).
``write_priors``: those measurements as each family's priors for this machine's class
(``src/tunedjax/ops/<family>/priors/<class>.json``, with provenance).
``evaluate`` (`render`: the table): per bucket, the candidates a prediction would compile
(`Prediction.could_win`, 10% margin, no horizon), the kernel the tuner would then choose,
and its time over the exhaustive winner's (the regret); also the predicted best's. Priors
from the *other* networks only (leave one out), plus the network's buckets measured
earlier in the run (as a first run sees them), and from all three (in-sample: flatters).

Run: ``python benchmarks/run.py kernel_priors [--quick] [--write]`` measures and
evaluates (the table; nothing under src/ changes); ``python
benchmarks/kernel_priors.py`` does all three and writes the table to BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

import harness

NETWORKS = ("demo", "mobilenet", "resnet18")
FAMILIES = ("conv", "batch_norm")
MARGIN = 0.10
COMMAND = "python benchmarks/kernel_priors.py"
SETTINGS = ("other networks' priors", "+ this run's earlier buckets",
            "in-sample priors (all networks)")


def _config(cache_dir: str) -> dict[str, Any]:
  return {"kernel": {"enable": True, "payback": False, "predict": False},
          "layout": {"enable": True}, "cache": {"dir": cache_dir}}


def _collect_demo(cache_dir: str, quick: bool) -> None:
  import optax  # pylint: disable=import-outside-toplevel
  from tunedjax import Trainer  # pylint: disable=import-outside-toplevel
  from tunedjax.demo import _model  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  batch, size = (16, 16) if quick else (128, 32)
  batches = [{"image": rng.random((batch, size, size, 3), np.float32),
              "label": rng.integers(0, 10, batch).astype(np.int32)} for _ in range(3)]
  model = _model.DemoNet(10, width=32, seed=0)
  trainer = Trainer(model, optax.adamw(1e-3), _model.loss_fn, autotune=_config(cache_dir),
                    progress=False)
  trainer.fit(batches, steps=3)


def _collect_step(name: str, cache_dir: str, quick: bool) -> None:
  import tunedjax as tj  # pylint: disable=import-outside-toplevel
  import jit_overhead  # pylint: disable=import-outside-toplevel
  image = 16 if quick else 64
  if name == "mobilenet":
    step, args = jit_overhead.mobilenet_problem(image, batch=8 if quick else 32)
  else:
    step, args = jit_overhead.resnet_problem(image, quick=quick)
  with tj.config_context(_config(cache_dir)):
    jax.block_until_ready(tj.jit(step)(*args))


def collect(work: pathlib.Path, networks: tuple[str, ...], quick: bool) -> None:
  """Tunes each network exhaustively into ``work/<network>``."""
  for net in networks:
    folder = work / net
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if net == "demo":
      _collect_demo(str(folder), quick)
    else:
      _collect_step(net, str(folder), quick)
    print(f"collected {net}: {time.perf_counter() - start:.1f} s", file=sys.stderr)


def records(work: pathlib.Path, networks: tuple[str, ...]) -> list[dict[str, Any]]:
  """One record per exhaustively tuned bucket: network, family, label, features, ratios,
  compile times, the candidates and the winner, in the order they were tuned."""
  from tunedjax import autotune  # pylint: disable=import-outside-toplevel
  out = []
  for net in networks:
    cache = autotune.Cache(work / net)
    for op in FAMILIES:
      family = autotune.op_family(op)
      for entry in cache.entries(op):
        value = entry.value
        if not value.get("ratios") or value.get("pruned"):
          continue
        out.append({
            "network": net, "family": op, "label": family.label(entry.key),
            "features": family.features(entry.key),
            "ratios": {k: float(v) for k, v in value["ratios"].items()},
            "compile_s": {k: round(float(v), 4) for k, v in value.get("compile_s", {}).items()},
            "candidates": sorted(entry.key["candidates"]), "winner": value["winner"],
            "failed": sorted({*value.get("errors", {}), *value.get("rejected", {})})})
  return out


def write_priors(recs: list[dict[str, Any]], networks: tuple[str, ...]) -> None:
  """Writes `recs` as each family's priors for this machine's class (under src/)."""
  from tunedjax import _tuning, autotune  # pylint: disable=import-outside-toplevel
  from tunedjax.autotune import _predict  # pylint: disable=import-outside-toplevel
  fp = _tuning.device_fingerprint()
  machine_class = _predict.machine_class(fp)[0]
  for op in FAMILIES:
    family = autotune.op_family(op)
    mine = [{k: v for k, v in r.items() if k != "family"} for r in recs if r["family"] == op]
    if not mine:
      continue
    data = {
        "format": _predict.PRIORS_FORMAT, "version": _predict.PRIORS_VERSION, "family": op,
        "machine_class": machine_class,
        "provenance": {
            **_predict.provenance(
                machine=f"{os.cpu_count()} cores of {fp.cpu_model}, {fp.platform}, ISA "
                        f"{' '.join(fp.cpu_features)}",
                jax_version=jax.__version__, command=COMMAND),
            "networks": list(networks),
            "how": "every applicable candidate compiled and timed (kernel.predict and "
                   "kernel.payback off), 5 timed rounds, 10% margin"},
        "buckets": mine}
    path = pathlib.Path(family.priors) / f"{machine_class}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {path} ({len(mine)} buckets)", file=sys.stderr)


def _choose(ratios: dict[str, float]) -> str:
  from tunedjax.autotune import _tuner  # pylint: disable=import-outside-toplevel
  return _tuner.choose({n: r for n, r in ratios.items() if n != "xla"}, margin=MARGIN)[0]


def _evaluate_bucket(rec: dict[str, Any], points: list[Any]) -> dict[str, Any]:
  from tunedjax.autotune import _predict  # pylint: disable=import-outside-toplevel
  pred = _predict.predict(rec["features"], rec["candidates"], points, default="xla")
  kept, _ = pred.could_win(margin=MARGIN)
  ratios = rec["ratios"]
  best = ratios[_choose(ratios)]
  chosen = _choose({n: r for n, r in ratios.items() if n in kept})
  top = pred.best()
  return {"regret": ratios[chosen] / best,
          "top_regret": ratios[top] / best if top in ratios else None,
          "compiled": len(kept), "candidates": len(rec["candidates"]),
          "two": len(kept) <= 2}


def evaluate(recs: list[dict[str, Any]], networks: tuple[str, ...]) -> list[dict[str, Any]]:
  """Per network and setting: the regrets and how many candidates were compiled."""
  from tunedjax.autotune import _predict  # pylint: disable=import-outside-toplevel

  def points(rs: list[dict[str, Any]], source: str) -> list[Any]:
    return [_predict.Point(r["features"], {"xla": 1.0, **r["ratios"]}, r["compile_s"], source)
            for r in rs]

  rows = []
  for net in networks:
    for setting in SETTINGS:
      results = []
      for op in FAMILIES:
        mine = [r for r in recs if r["network"] == net and r["family"] == op]
        others = [r for r in recs if r["network"] != net and r["family"] == op]
        for i, rec in enumerate(mine):
          if setting.startswith("in-sample"):
            pts = points(others + mine, "prior")
          elif setting.startswith("+"):
            pts = points(others, "prior") + points(mine[:i], "measured")
          else:
            pts = points(others, "prior")
          results.append(_evaluate_bucket(rec, pts))
      if results:
        regrets = [r["regret"] for r in results]
        tops = [r["top_regret"] for r in results if r["top_regret"] is not None]
        rows.append({"network": net, "setting": setting, "buckets": len(results),
                     "regret": (statistics.median(regrets), max(regrets)),
                     "top_regret": (statistics.median(tops), max(tops)),
                     "compiled": sum(r["compiled"] for r in results),
                     "candidates": sum(r["candidates"] for r in results),
                     "two": sum(r["two"] for r in results)})
  return rows


def measure(quick: bool = False, *, work: str | None = None,
            networks: tuple[str, ...] = NETWORKS) -> harness.Result:
  """Collects every network into `work` (a fresh folder by default) and replays the
  measurements: the records and the evaluation's rows."""
  result = harness.Result("kernel_priors", params={"quick": quick, "networks": list(networks)})
  folder = pathlib.Path(work or tempfile.mkdtemp(prefix="tunedjax-kernel-priors-"))
  collect(folder, networks, quick)
  recs = records(folder, networks)
  result.figures.update(records=recs, rows=evaluate(recs, networks))
  return result


def render(result: harness.Result) -> str:
  rows = [f"| {r['network']} | {r['setting']} | {r['buckets']} | {r['regret'][0]:.3f} | "
          f"{r['regret'][1]:.3f} | {r['top_regret'][0]:.3f} / {r['top_regret'][1]:.3f} | "
          f"{r['compiled']} of {r['candidates']} | {r['two']} |" for r in result.figures["rows"]]
  return (
      "## Kernel predictions: quality against exhaustive tuning\n\n"
      f"`benchmarks/run.py kernel_priors{' --quick' if result.params['quick'] else ''}` "
      f"(collect, evaluate; `{COMMAND}` also writes the shipped priors). {result.machine} "
      f"{result.load_line()} Each bucket of each network was tuned exhaustively (every "
      "applicable candidate, 5 rounds); the table replays those measurements: which "
      "candidates a prediction would compile, and the time of the kernel the tuner then "
      "chooses over the exhaustive winner's (regret; 1.000 = the same kernel or one as "
      "fast). The shipped priors are these very "
      "measurements, so the *in-sample* rows flatter; the *other networks' priors* rows "
      "leave the network's own buckets out, as on a machine that has measured nothing "
      "of it, and the *+ earlier buckets* rows add what a first run has measured of the "
      "network by the time it reaches each bucket. The predictor's constants "
      "(`autotune/_predict.py`: 1.5 spreads, a 20% tolerance, bandwidth 2) were "
      "chosen by a sweep over these same leave-one-out rows, so they are fitted to "
      "these three networks too. *Predicted best alone* is the top-ranked "
      "candidate's time over the winner's: what trusting the ranking without timing "
      "would cost (the tuner never does). The replay has no tuning horizon (as "
      "`tj.jit` alone); under the Trainer's horizon, candidates that cannot save "
      "their own compile are ruled out too, so a real first run compiles fewer "
      "(see the demo's section).\n\n"
      "| network | prediction from | buckets | regret, median | regret, worst | "
      "predicted best alone: median / worst | candidates compiled (of exhaustive) | "
      "buckets compiling only 2 |\n|---|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows))


if __name__ == "__main__":  # regenerates the shipped priors and their section of BENCHMARKS.md
  measured = measure()
  write_priors(measured.figures["records"], NETWORKS)
  harness.write_section("kernel_priors", render(measured.done()))
