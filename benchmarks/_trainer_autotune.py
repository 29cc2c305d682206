"""`benchmarks/trainer.py --only autotune`: `Trainer(autotune=True)` against `autotune=False`.

Two tables (see trainer.py's docstring, table 4):

* steady state: per model, a Trainer of each kind fits `WARM_STEPS` steps
  first (tuning and the whole-program check of the tuned step happen
  there), then rounds of `fit(N more steps)`, interleaved, the
  ``autotune=False`` one timed twice (A/A control);
* fixed cost: the README's Trainer example scaled up (an MLP, 4096
  records, batch 64, 5 epochs = 320 steps), a fresh Trainer and a whole
  `fit` per run, ``autotune=True`` on a warm tuning cache against
  ``autotune=False``.

Every Trainer runs on one device, ``progress=False``, on the benchmark's own
tuning cache (a temporary folder unless ``TUNEDJAX_CACHE_DIR`` is set).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import harness as _harness
from tunedjax.demo import DemoNet, TransformerLM, lm_data, lm_loss
from tunedjax.trainer import Trainer

WARM_STEPS = 240
OFF, ON = "autotune=False", "autotune=True"


class MobileNet(nnx.Module):
  """MobileNet-style: a strided 3x3 stem, depthwise 3x3 + BN + ReLU, 1x1 + BN + ReLU
  blocks (as benchmarks/kernels.py's `mobilenet`, in Flax nnx), mean, Linear."""

  def __init__(self, widths=(16, 32, 32, 64), strides=(1, 2, 1, 2), *, seed: int = 0):
    rngs = nnx.Rngs(seed)
    c = 16
    self.stem = nnx.Conv(3, c, (3, 3), strides=2, rngs=rngs)
    blocks = []
    for cout, s in zip(widths, strides):
      blocks.append(nnx.Sequential(
          nnx.Conv(c, c, (3, 3), strides=s, feature_group_count=c, rngs=rngs),
          nnx.BatchNorm(c, rngs=rngs), nnx.relu,
          nnx.Conv(c, cout, (1, 1), rngs=rngs), nnx.BatchNorm(cout, rngs=rngs), nnx.relu))
      c = cout
    self.blocks = nnx.List(blocks)
    self.head = nnx.Linear(c, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    for block in self.blocks:
      x = block(x)
    return self.head(x.mean(axis=(1, 2)))


def _mlp():
  return nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.relu,
                        nnx.Linear(32, 1, rngs=nnx.Rngs(1)))


def _mlp_loss(model, batch):
  return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()


def _image_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _mlp_data(records: int) -> dict[str, np.ndarray]:
  x = np.random.default_rng(0).normal(size=(records, 8)).astype(np.float32)
  return {"x": x, "y": x.sum(axis=1)}


def _images(count: int, batch: int, size: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(batch, size, size, 3)).astype(np.float32),
           "y": rng.integers(0, 10, size=batch).astype(np.int32)} for _ in range(count)]


def _split(data: dict[str, np.ndarray], batch: int) -> list[dict[str, np.ndarray]]:
  n = len(next(iter(data.values()))) // batch
  return [{k: v[i * batch:(i + 1) * batch] for k, v in data.items()} for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  model: Callable[[], nnx.Module]
  loss: Callable[..., Any]
  batches: Callable[[int], list[Any]]  # count -> batches
  steps: int  # per timed run


CASES = (
    Case("MLP 8-32-1, batch 64", _mlp, _mlp_loss,
         lambda n: _split(_mlp_data(64 * n), 64), 400),
    Case("MobileNet-style CNN, 32x32, batch 16", MobileNet, _image_loss,
         lambda n: _images(n, 16, 32), 12),
    Case("DemoNet (width 16), 32x32, batch 16", lambda: DemoNet(10, width=16), _image_loss,
         lambda n: _images(n, 16, 32), 8),
    Case("Transformer LM (64 tokens, width 64, 2 layers), batch 8",
         lambda: TransformerLM(tokens=64, width=64, layers=2, heads=4), lm_loss,
         lambda n: _split(lm_data(n, 8, 64, seed=1), 8), 12),
)


def _mesh() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


def _trainer(case: Case, autotune: bool) -> Trainer:
  return Trainer(case.model(), optax.adam(1e-3), case.loss, autotune=autotune,
                 progress=False, mesh=_mesh())


def _fit_more(trainer: Trainer, batches: list[Any]) -> Callable[[], None]:
  def run():
    trainer.fit(batches, steps=trainer.step + len(batches))
    jax.block_until_ready(trainer.state)
  return run


def steady_state(case: Case, rounds: int, warm: int) -> dict[str, Any]:
  """Both Trainers after `warm` steps, then interleaved rounds of `case.steps` steps."""
  pool = case.batches(max(warm, case.steps))
  on, off = _trainer(case, True), _trainer(case, False)
  start = time.perf_counter()
  history = on.fit(pool[:warm], steps=warm)
  warm_on_s = time.perf_counter() - start
  off.fit(pool[:warm], steps=warm)
  timed = pool[:case.steps]
  t = _harness.interleaved({OFF: _fit_more(off, timed), ON: _fit_more(on, timed)},
                           baseline=OFF, rounds=rounds)
  check = history.tuning.get("verification") or {}
  return {"t": t, "check": check, "warm_on_s": warm_on_s,
          "tuning_s": history.tuning.get("tuning_s", 0.0)}


def whole_fit(rounds: int, case: str = "mlp") -> _harness.Timings:
  """A fresh Trainer's whole fit on a warm cache: the README example scaled
  (``"mlp"``: 320 steps), or the MobileNet-style CNN (``"cnn"``: 2 epochs of
  24 batches of 16)."""
  if case == "mlp":
    data, model, loss, batch, epochs = _mlp_data(4096), _mlp, _mlp_loss, 64, 5
  else:
    images = _images(1, 16 * 24, 32)[0]
    data, model, loss, batch, epochs = images, MobileNet, _image_loss, 16, 2

  def fit(autotune: bool) -> Callable[[], None]:
    def run():
      trainer = Trainer(model(), optax.adam(1e-2), loss, autotune=autotune,
                        progress=False, mesh=_mesh())
      trainer.fit(data, batch_size=batch, epochs=epochs)
      jax.block_until_ready(trainer.state)
    return run

  fit(True)()  # warms the tuning cache (and the loader's)
  return _harness.interleaved({OFF: fit(False), ON + " (warm cache)": fit(True)},
                              baseline=OFF, rounds=rounds)


def _check_text(check: dict[str, Any]) -> str:
  if not check:
    return "no kernel decision to check"
  ratio = check.get("tuned_over_untuned")
  lost = ", ".join(f"{d['bucket']} ({d['kernel']})" for d in check.get("lost", [])) or "none"
  text = check.get("outcome", "?")
  if ratio is not None:
    text += f" (tuned/untuned {ratio:.3f}; {check.get('runs', 0)} runs, " \
            f"{check.get('compiles', 0)} compiles; lose in context: {lost})"
  return text


def _met(t: _harness.Timings, name: str) -> bool:
  """At most 1.0x within noise: the ratio no further above 1 than the A/A control
  strays from 1 (or 2%, the least the rounds resolve)."""
  noise = max(abs(t.ratio(_harness.CONTROL) - 1.0), 0.02)
  return t.ratio(name) <= 1.0 + noise


def lines_for(results: list[tuple[Case, dict[str, Any]]], fit_t: _harness.Timings,
              rounds: int, load: tuple[float, float], command: str) -> list[str]:
  out = ["## `Trainer(autotune=True)` against `autotune=False`: never slower, no fixed cost",
         "", f"`{command}`. {_harness.machine_line()} "
         f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Load average "
         f"{load[0]:.1f} before, {load[1]:.1f} after. One device, `progress=False`, "
         f"{rounds} interleaved rounds; ratios are medians of per-round ratios to "
         f"`autotune=False` (below 1 is faster), with the A/A control (`autotune=False` "
         f"timed twice).", "",
         f"### Steady state (after a {WARM_STEPS}-step `fit` that tunes and checks)", "",
         "| model | steps/run | autotune=False ms/step | autotune=True ms/step | ratio "
         "(range) | A/A | at most 1.0x within noise | whole-program check |",
         "|---|---|---|---|---|---|---|---|"]
  for case, r in results:
    t = r["t"]
    lo, hi = t.spread(ON)
    out.append(
        f"| {case.name} | {case.steps} | {1e3 * t.median(OFF) / case.steps:.2f} | "
        f"{1e3 * t.median(ON) / case.steps:.2f} | {t.ratio(ON):.3f} ({lo:.2f}-{hi:.2f}) | "
        f"{t.ratio(_harness.CONTROL):.3f} | {'yes' if _met(t, ON) else '**no**'} | "
        f"{_check_text(r['check'])} |")
  name = ON + " (warm cache)"
  off_s, ratio = fit_t.median(OFF), fit_t.ratio(name)
  within = ratio <= 1.05 + 0.1 / off_s  # the median per-round ratio, as everywhere here
  out += ["", "### Fixed cost: the README's MLP, a fresh Trainer, a whole fit (320 steps)", "",
          "| variant | median s per fit | ratio (range) |", "|---|---|---|"]
  for v in (OFF, _harness.CONTROL, name):
    lo, hi = fit_t.spread(v)
    out.append(f"| {v} | {fit_t.median(v):.3f} | {fit_t.ratio(v):.3f} ({lo:.2f}-{hi:.2f}) |")
  out += ["", f"Target: `autotune=True` with a warm cache within 5% + 0.1 s of "
          f"`autotune=False`: {'met' if within else '**NOT met**'} (median per-round ratio "
          f"{ratio:.3f}, limit {1.05 + 0.1 / off_s:.3f} = 1.05 + 0.1 s / {off_s:.3f} s)."]
  return out


def cnn_lines(t: _harness.Timings) -> list[str]:
  name = ON + " (warm cache)"
  out = ["", "### Fixed cost with kernels to tune: the MobileNet-style CNN, a fresh Trainer, "
         "a whole fit on a warm cache (48 steps)", "",
         "| variant | median s per fit | ratio (range) |", "|---|---|---|"]
  for v in (OFF, _harness.CONTROL, name):
    lo, hi = t.spread(v)
    out.append(f"| {v} | {t.median(v):.3f} | {t.ratio(v):.3f} ({lo:.2f}-{hi:.2f}) |")
  return out


def main(args: Any, *, rounds: int) -> int:
  os.environ.setdefault("TUNEDJAX_CACHE_DIR", tempfile.mkdtemp(prefix="tunedjax-bench-"))
  warm = 24 if args.quick else WARM_STEPS
  load_before = os.getloadavg()[0]
  results = []
  for case in CASES:
    r = steady_state(case, rounds, warm)
    print(f"{case.name}: on/off {r['t'].ratio(ON):.3f}, A/A "
          f"{r['t'].ratio(_harness.CONTROL):.3f}; {_check_text(r['check'])}", file=sys.stderr)
    results.append((case, r))
  fit_t = whole_fit(rounds)
  cnn_t = whole_fit(rounds, "cnn")
  command = "benchmarks/trainer.py --only autotune" + (f" --rounds {args.rounds}"
                                                       if args.rounds else "")
  body = "\n".join(lines_for(results, fit_t, rounds, (load_before, os.getloadavg()[0]),
                             command) + cnn_lines(cnn_t))
  print(body)
  if args.write:
    _harness.write_section("trainer_autotune", body)
    print(f"wrote {_harness.BENCHMARKS_MD}", file=sys.stderr)
  return 0
