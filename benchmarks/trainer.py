"""`tunedjax.Trainer`: its per-step overhead, `steps_per_execution`, logging and autotune.

Each table is timed in interleaved rounds with an A/A control. Section ``trainer``:

1. `Trainer.fit` (``autotune=False``, ``progress=False``, one device) against the loop a
   good JAX user writes by hand (split once, a jitted pure step with donation,
   `device_put` each batch, each loss read one step late: the baseline), on the same Flax
   nnx CNN (Adam) and pre-made NumPy batches, at 16x16 and 32x32; bounded by the loss read
   at once, never read, and no `device_put`. A timed run is ``fit(batches,
   steps=trainer.step + N)``. Target: within 3%.
2. ``steps_per_execution=8`` against 1 on a tiny host-bound MLP. Target: at least 1.5x.
3. `fit` with the `TensorBoard` callback writing every step (and `CSVLogger`) against
   `fit` alone, on the CNN at batch 48, 16x16 (about 2 ms a step). Target: within 3%.

Section ``trainer_autotune``: ``Trainer(autotune=True)`` against ``False`` in steady state
on an MLP, a MobileNet-style CNN, the demo network and a Transformer LM (after
`WARM_STEPS` steps that tune and check; target: at most 1.0x within the A/A control's
noise), and the fixed cost of a fresh Trainer's whole `fit` on a warm tuning cache (the
benchmark's own unless ``TUNEDJAX_CACHE_DIR`` is set): the README's example scaled up
(an MLP, 4096 records, batch 64, 5 epochs; target: within 5% + 0.1 s) and the CNN.

Run: ``.venv/bin/python benchmarks/run.py trainer [--quick] [--write]``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import jax
import numpy as np
import optax
from flax import nnx

import harness
from harness import CONTROL
from tunedjax.callbacks import CSVLogger, TensorBoard
from tunedjax.demo import DemoNet, TransformerLM, lm_data, lm_loss
from tunedjax.trainer import Trainer

HAND = "hand-written jit loop (loss read one step late)"
HAND_SYNC = "hand-written, float(loss) each step"
HAND_NONE = "hand-written, loss never read (lower bound)"
HAND_HOST = "hand-written, NumPy batch to the step (no device_put)"
TRAINER = "Trainer.fit (autotune=False)"
PLAIN = "Trainer.fit, no callbacks"
BOARD = "Trainer.fit + TensorBoard (every step)"
CSV = "Trainer.fit + CSVLogger (every step)"
BATCH, K = 32, 8  # the CNN's batch; steps_per_execution
LOG_BATCH, LOG_IMAGE = 48, 16  # the logging table's CNN step: about 2 ms
WARM_STEPS = 240
OFF, ON = "autotune=False", "autotune=True"
WARM_ON = ON + " (warm cache)"


# --- models and data ------------------------------------------------------------------


class CNN(nnx.Module):
  """Conv-BatchNorm-ReLU, a strided Conv-BatchNorm-ReLU, global mean, Linear."""

  def __init__(self, channels: int = 16, classes: int = 10, *, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.conv1 = nnx.Conv(3, channels, (3, 3), rngs=rngs)
    self.norm1 = nnx.BatchNorm(channels, rngs=rngs)
    self.conv2 = nnx.Conv(channels, 2 * channels, (3, 3), strides=2, rngs=rngs)
    self.norm2 = nnx.BatchNorm(2 * channels, rngs=rngs)
    self.head = nnx.Linear(2 * channels, classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm1(self.conv1(x)))
    x = nnx.relu(self.norm2(self.conv2(x)))
    return self.head(x.mean(axis=(1, 2)))


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


def mlp(features: int = 8) -> nnx.Module:
  """The README's Trainer example's MLP, `features`-32-1 (16: a host-bound step of a few
  microseconds' compute)."""
  return nnx.Sequential(nnx.Linear(features, 32, rngs=nnx.Rngs(0)), nnx.relu,
                        nnx.Linear(32, 1, rngs=nnx.Rngs(1)))


def image_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mlp_loss(model, batch):
  return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()


def image_batches(count: int, batch: int, image: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(batch, image, image, 3)).astype(np.float32),
           "y": rng.integers(0, 10, size=batch).astype(np.int32)} for _ in range(count)]


def regression_batches(count: int, batch: int, features: int = 16
                       ) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  w = rng.normal(size=features).astype(np.float32)
  xs = [rng.normal(size=(batch, features)).astype(np.float32) for _ in range(count)]
  return [{"x": x, "y": (x @ w).astype(np.float32)} for x in xs]


def readme_data(records: int) -> dict[str, np.ndarray]:
  x = np.random.default_rng(0).normal(size=(records, 8)).astype(np.float32)
  return {"x": x, "y": x.sum(axis=1)}


def split(data: dict[str, np.ndarray], batch: int) -> list[dict[str, np.ndarray]]:
  n = len(next(iter(data.values()))) // batch
  return [{k: v[i * batch:(i + 1) * batch] for k, v in data.items()} for i in range(n)]


# --- the loops --------------------------------------------------------------------------


class HandLoop:
  """The loop a good JAX user writes: split once, one jitted pure step, donation."""

  def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
               loss_fn: Callable[..., Any]):
    graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
    self.opt_state = optimizer.init(self.params)
    self.losses: list[float] = []

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_step(params, rest, opt_state, batch):
      def loss_of(params):
        model = nnx.merge(graphdef, params, rest, copy=True)
        return loss_fn(model, batch), nnx.state(model, nnx.Not(nnx.Param))

      (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), rest, opt_state, loss

    self.train_step = train_step

  def run(self, batches: Sequence[Any], read: str, *, put: bool = True) -> None:
    """One pass over `batches`; `read` is "late", "sync" or "never"; `put`:
    `jax.device_put` each batch first (else jit transfers the NumPy arrays)."""
    pending = None
    for batch in batches:
      self.params, self.rest, self.opt_state, loss = self.train_step(
          self.params, self.rest, self.opt_state, jax.device_put(batch) if put else batch)
      if read == "sync":
        self.losses.append(float(loss))
      elif read == "late":
        if pending is not None:
          self.losses.append(float(pending))
        pending = loss
    if pending is not None:
      self.losses.append(float(pending))
    jax.block_until_ready((self.params, self.rest, self.opt_state))


def make_trainer(model: nnx.Module, loss_fn: Callable[..., Any], *, autotune: bool = False,
                 lr: float = 1e-3, **kwargs: Any) -> Trainer:
  """A Trainer on one device (a one-device mesh), ``progress=False``, Adam."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  return Trainer(model, optax.adam(lr), loss_fn, autotune=autotune, progress=False, mesh=mesh,
                 **kwargs)


def fit_more(trainer: Trainer, batches: Sequence[Any],
             callbacks: Sequence[Any] = ()) -> Callable[[], Any]:
  """`len(batches)` more steps of `trainer` (fit counts steps globally)."""

  def run():
    trainer.fit(batches, steps=trainer.step + len(batches), callbacks=list(callbacks))
    jax.block_until_ready(trainer.state)

  return run


def interleaved_with_cpu(variants: dict[str, Callable[[], Any]], baseline: str, rounds: int
                         ) -> tuple[harness.Timings, dict[str, list[float]]]:
  """Compiles, then `harness.interleaved`, recording each timed run's CPU seconds on the
  host thread (dispatch, transfers, bookkeeping: unlike wall time, steady under load)."""
  cpu: dict[str, list[float]] = {name: [] for name in variants}

  def timed(name: str) -> Callable[[], Any]:
    def run():
      start = time.thread_time()
      variants[name]()
      cpu[name].append(time.thread_time() - start)
    return run

  for fn in variants.values():  # compiles
    fn()
  t = harness.interleaved({n: timed(n) for n in variants}, baseline=baseline, rounds=rounds,
                          warmup=1)
  # The warm-up round left out (the baseline ran twice a round: itself and the A/A control).
  return t, {n: v[-rounds * (2 if n == baseline else 1):] for n, v in cpu.items()}


# --- measuring ------------------------------------------------------------------------------


def trainer_vs_hand(rounds: int, steps: int, image: int) -> harness.Timings:
  """Table 1 at one image size."""
  batches = image_batches(steps, BATCH, image)
  hands = {read: HandLoop(CNN(), optax.adam(1e-3), image_loss)
           for read in ("late", "sync", "never", "host")}
  variants = {HAND: lambda: hands["late"].run(batches, "late"),
              TRAINER: fit_more(make_trainer(CNN(), image_loss), batches),
              HAND_SYNC: lambda: hands["sync"].run(batches, "sync"),
              HAND_NONE: lambda: hands["never"].run(batches, "never"),
              HAND_HOST: lambda: hands["host"].run(batches, "late", put=False)}
  return interleaved_with_cpu(variants, HAND, rounds)[0]


def steps_per_execution(rounds: int, steps: int):
  """Table 2: ``steps_per_execution=K`` against 1 (and the hand-written loop) on the MLP."""
  batches = regression_batches(steps, 32)
  one, sunk = "Trainer, steps_per_execution=1", f"Trainer, steps_per_execution={K}"
  hand, hand_host = (HandLoop(mlp(16), optax.adam(1e-3), mlp_loss) for _ in range(2))
  return interleaved_with_cpu({
      one: fit_more(make_trainer(mlp(16), mlp_loss), batches),
      sunk: fit_more(make_trainer(mlp(16), mlp_loss, steps_per_execution=K), batches),
      HAND: lambda: hand.run(batches, "late"),
      HAND_HOST: lambda: hand_host.run(batches, "late", put=False)}, one, rounds)


def logging_overhead(rounds: int, steps: int):
  """Table 3: `fit` with the TensorBoard (and CSV) callback against `fit` alone."""
  batches = image_batches(steps, LOG_BATCH, LOG_IMAGE)
  trainer = make_trainer(CNN(), image_loss)  # one for all: only `fit`'s callbacks differ
  with tempfile.TemporaryDirectory(prefix="tunedjax-bench-logs-") as logs:
    return interleaved_with_cpu({
        PLAIN: fit_more(trainer, batches),
        BOARD: fit_more(trainer, batches, [TensorBoard(os.path.join(logs, "tb"))]),
        CSV: fit_more(trainer, batches, [CSVLogger(os.path.join(logs, "csv"))])},
        PLAIN, rounds)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  model: Callable[[], nnx.Module]
  loss: Callable[..., Any]
  batches: Callable[[int], list[Any]]  # count -> batches
  steps: int  # per timed run


CASES = (
    Case("MLP 8-32-1, batch 64", mlp, mlp_loss,
         lambda n: split(readme_data(64 * n), 64), 400),
    Case("MobileNet-style CNN, 32x32, batch 16", MobileNet, image_loss,
         lambda n: image_batches(n, 16, 32), 12),
    Case("DemoNet (width 16), 32x32, batch 16", lambda: DemoNet(10, width=16), image_loss,
         lambda n: image_batches(n, 16, 32), 8),
    Case("Transformer LM (64 tokens, width 64, 2 layers), batch 8",
         lambda: TransformerLM(tokens=64, width=64, layers=2, heads=4), lm_loss,
         lambda n: split(lm_data(n, 8, 64, seed=1), 8), 12),
)


def steady_state(case: Case, rounds: int, warm: int) -> tuple[harness.Timings, dict]:
  """Both Trainers after `warm` steps, then interleaved rounds of `case.steps` steps;
  the tuned step's whole-program check."""
  pool = case.batches(max(warm, case.steps))
  on, off = (make_trainer(case.model(), case.loss, autotune=a) for a in (True, False))
  history = on.fit(pool[:warm], steps=warm)
  off.fit(pool[:warm], steps=warm)
  timed = pool[:case.steps]
  t = harness.interleaved({OFF: fit_more(off, timed), ON: fit_more(on, timed)},
                          baseline=OFF, rounds=rounds)
  return t, history.tuning.get("verification") or {}


def whole_fit(rounds: int, model: Callable[[], nnx.Module], loss: Callable[..., Any],
              data: dict[str, np.ndarray], batch: int, epochs: int) -> harness.Timings:
  """A fresh Trainer's whole fit, ``autotune=True`` on a warm cache against off."""

  def fit(autotune: bool) -> Callable[[], None]:
    def run():
      trainer = make_trainer(model(), loss, autotune=autotune, lr=1e-2)
      trainer.fit(data, batch_size=batch, epochs=epochs)
      jax.block_until_ready(trainer.state)
    return run

  fit(True)()  # warms the tuning cache (and the loader's)
  return harness.interleaved({OFF: fit(False), WARM_ON: fit(True)}, baseline=OFF, rounds=rounds)


def measure(quick: bool = False) -> harness.Result:
  """The four tables (section ``trainer``) and autotune on against off (``trainer_autotune``)."""
  p = {"quick": quick, "rounds": 2 if quick else 17, "autotune_rounds": 1 if quick else 7,
       # (image size, steps per timed run): a short step (a few ms) and a longer one
       "cnn_sizes": [(16, 8)] if quick else [(16, 100), (32, 30)],
       "mlp_steps": 32 if quick else 400, "log_steps": 8 if quick else 100,
       "warm": 24 if quick else WARM_STEPS, "devices": jax.device_count(),
       # whole fits: (records, epochs) of the README's MLP (batch 64), of the CNN (batch 16)
       "mlp_fit": (1024, 1) if quick else (4096, 5), "cnn_fit": (128, 1) if quick else (384, 2)}
  result = harness.Result("trainer", params=p)
  rounds, t = p["rounds"], result.timings
  for image, steps in p["cnn_sizes"]:
    t[f"cnn {image}"] = trainer_vs_hand(rounds, steps, image)
  cpu = {}
  t["steps_per_execution"], cpu["steps_per_execution"] = steps_per_execution(rounds, p["mlp_steps"])
  t["logging"], cpu["logging"] = logging_overhead(rounds, p["log_steps"])
  result.figures = {"cpu": cpu, "checks": {}, "utc": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                    time.gmtime())}
  cache = os.environ.get("TUNEDJAX_CACHE_DIR") or tempfile.mkdtemp(prefix="tunedjax-bench-")
  with mock.patch.dict(os.environ, {"TUNEDJAX_CACHE_DIR": cache}):
    for case in CASES:
      t[case.name], result.figures["checks"][case.name] = steady_state(
          case, p["autotune_rounds"], p["warm"])
    records, epochs = p["mlp_fit"]
    t["whole fit, MLP"] = whole_fit(p["autotune_rounds"], mlp, mlp_loss,
                                    readme_data(records), 64, epochs)
    records, epochs = p["cnn_fit"]
    t["whole fit, CNN"] = whole_fit(p["autotune_rounds"], MobileNet, image_loss,
                                    image_batches(1, records, 32)[0], 16, epochs)
  return result


# --- rendering ------------------------------------------------------------------------------


def _table(t: harness.Timings, steps: int, cpu: dict[str, list[float]] | None = None) -> str:
  """A ratio table with each variant's time per step (and host CPU per step)."""
  base = t.median(t.baseline) / steps * 1e6
  notes = {}
  for name in t.runs:
    us = t.median(name) / steps * 1e6
    notes[name] = f"{us / 1e3:.3f} ms per step" + ("" if name == t.baseline
                                                    else f"; {us - base:+.0f} us")
    if cpu and cpu.get(name):
      notes[name] += f"; host {statistics.median(cpu[name]) / steps * 1e6:.0f} us CPU"
  return harness.ratio_table(t, notes=notes)


def _host_us(cpu: dict[str, list[float]], steps: int) -> dict[str, float]:
  return {name: statistics.median(v) / steps * 1e6 for name, v in cpu.items()}


def _met(ok: bool) -> str:
  return "met" if ok else "**NOT met**"


def _cnn_lines(result: harness.Result) -> tuple[list[str], list[str], dict[int, dict]]:
  """Table 1 at each size, its target lines, and the figures the reading quotes."""
  tables, targets, stats = [], [], {}
  for image, steps in result.params["cnn_sizes"]:
    t = result.timings[f"cnn {image}"]
    hand_ms, trainer_ms = t.median(HAND) / steps * 1e3, t.median(TRAINER) / steps * 1e3
    s = stats[image] = {
        "ratio": t.ratio(TRAINER), "control": t.ratio(CONTROL), "hand_ms": hand_ms,
        "extra_us": (trainer_ms - hand_ms) * 1e3, "rounds": len(t.runs[HAND]),
        "slower_rounds": sum(a > b for a, b in zip(t.runs[TRAINER], t.runs[HAND]))}
    tables += [f"**CNN, batch {BATCH}, {image}x{image}x3: {hand_ms:.1f} ms per step, {steps} "
               f"steps per timed run**", "", _table(t, steps), ""]
    lo, hi = t.spread(TRAINER)
    targets.append(
        f"- {image}x{image} ({hand_ms:.1f} ms per step): {_met(s['ratio'] <= 1.03)} (ratio "
        f"{s['ratio']:.3f}, {trainer_ms:.2f} ms against {hand_ms:.2f} ms per step, "
        f"{s['extra_us']:+.0f} us; per-round range {lo:.2f}-{hi:.2f}; A/A "
        f"{s['control']:.3f}). Against the synchronous loop {t.ratio_to(TRAINER, HAND_SYNC):.3f}"
        f", against the lower bound {t.ratio_to(TRAINER, HAND_NONE):.3f}, against the "
        f"hand-written loop without `device_put` {t.ratio_to(TRAINER, HAND_HOST):.3f}.")
  return tables, targets, stats


def _logging_lines(result: harness.Result) -> list[str]:
  """Table 3: what was timed, the table, the target."""
  t, steps, rounds = result.timings["logging"], result.params["log_steps"], result.params["rounds"]
  cpu = result.figures["cpu"]["logging"]
  host = _host_us(cpu, steps)
  plain_ms, ratio = t.median(PLAIN) / steps * 1e3, t.ratio(BOARD)
  host_extra = host[BOARD] - host[PLAIN]
  lo, hi = t.spread(BOARD)
  return [
      f"### Logging: the TensorBoard callback ({steps} steps per timed run)", "",
      f"The CNN of the first table at batch {LOG_BATCH}, {LOG_IMAGE}x{LOG_IMAGE}x3 "
      f"({plain_ms:.2f} ms per step without callbacks), Adam; "
      f"`fit(batches, steps=trainer.step + {steps}, callbacks=[...])` on one trainer with "
      f"`tunedjax.callbacks.TensorBoard` writing its per-step figures at every step "
      f"(loss, learning rate, step time, throughput, skips: one event per step, written in "
      f"batches at epoch ends, every 1000 steps or 10 s, and at the end of `fit`), against the "
      f"same `fit` without callbacks; `CSVLogger` (every step) for "
      f"reference. {rounds} interleaved rounds; one event file for all of them (the callback "
      f"keeps it open from one `fit` to the next and flushes it at each `fit`'s end).", "",
      _table(t, steps, cpu), "",
      f"Target: the TensorBoard callback within 3% of a ~2 ms step: {_met(ratio <= 1.03)} "
      f"(ratio {ratio:.3f}, {(t.median(BOARD) - t.median(PLAIN)) / steps * 1e6:+.0f} us per "
      f"step; per-round range {lo:.2f}-{hi:.2f}; CSVLogger {t.ratio(CSV):.3f}; A/A "
      f"{t.ratio(CONTROL):.3f}). The host thread's CPU time, which moves less with the "
      f"machine's load: {host_extra:+.0f} us per step with the callback ({host[PLAIN]:.0f} us "
      f"without), {host_extra / (plain_ms * 1e3) * 100:+.1f}% of the step.",
  ]


def _trainer_section(result: harness.Result) -> str:
  p = result.params
  rounds, steps = p["rounds"], p["mlp_steps"]
  tables, targets, cnn = _cnn_lines(result)
  t = result.timings["steps_per_execution"]
  one, sunk = "Trainer, steps_per_execution=1", f"Trainer, steps_per_execution={K}"
  host = _host_us(result.figures["cpu"]["steps_per_execution"], steps)
  one_us, sunk_us, hand_us = (t.median(n) / steps * 1e6 for n in (one, sunk, HAND))
  speedup = 1 / t.ratio(sunk)
  met = [image for image, s in cnn.items() if s["ratio"] <= 1.03]
  verdict = ("met at every size" if len(met) == len(cnn) else
             f"met at {', '.join(f'{i}x{i}' for i in met)} only" if met else "**NOT met**")
  gaps = " and ".join(f"{s['extra_us']:+.0f} us ({(s['ratio'] - 1) * 100:+.1f}%) per step at "
                      f"{s['hand_ms']:.1f} ms" for s in cnn.values())
  slower = " and ".join(f"{s['slower_rounds']} of {s['rounds']}" for s in cnn.values())
  control = max(abs(s["control"] - 1) for s in cnn.values()) * 100
  return "\n".join([
      "## `tunedjax.Trainer`: per-step overhead and `steps_per_execution`", "",
      f"`benchmarks/run.py trainer{' --quick' if p['quick'] else ''}`: {rounds} interleaved "
      f"rounds after a compiling warm-up; ratios are medians of per-round ratios to the "
      f"baseline (below 1 is faster). One device (`jax.device_count()` = {p['devices']}; "
      f"both loops on a one-device mesh), the same pre-made list of NumPy batches for every "
      f"variant, so data loading is not measured. {result.machine} {result.load_line()}", "",
      "### Trainer against a hand-written `jax.jit` + optax loop", "",
      f"Flax nnx CNN (3x3 conv 16 ch + BatchNorm + ReLU, strided 3x3 conv 32 ch + BatchNorm + "
      f"ReLU, mean, Linear 10), Adam, softmax cross-entropy, float32. The Trainer runs "
      f"`fit(batches, steps=trainer.step + N)` with `autotune=False, progress=False` (its "
      f"fixed per-`fit` costs are included, spread over the N steps). The hand-written loop "
      f"`nnx.split`s the model once and calls a `jax.jit(donate_argnums=(0, 1, 2))` step "
      f"`(params, rest, opt_state, batch)` on `jax.device_put(batch)`; the baseline reads each "
      f"loss with `float` one step late, as the Trainer does.", "",
      *tables,
      "Target: the Trainer within 3% of the hand-written loop:", "",
      *targets, "",
      f"### `steps_per_execution={K}` against 1 ({steps} steps per timed run)", "",
      "Flax nnx MLP 16-32-1, Adam, batch 32, squared error: host-bound (a step's compute is "
      "microseconds; dispatch, the batch's transfer and bookkeeping dominate). \"host ... us "
      "CPU\": the CPU time of the host thread per step (`time.thread_time`: dispatch, "
      "transfers, bookkeeping), which moves less with the machine's load than wall time.", "",
      _table(t, steps, result.figures["cpu"]["steps_per_execution"]), "",
      f"Target: `steps_per_execution={K}` at least 1.5x faster per step: "
      f"{_met(speedup >= 1.5)} ({speedup:.2f}x: {sunk_us:.0f} us against {one_us:.0f} us per "
      f"step; per-round range of the ratio {t.spread(sunk)[0]:.2f}-{t.spread(sunk)[1]:.2f}; "
      f"A/A {t.ratio(CONTROL):.3f}).", "",
      *_logging_lines(result), "",
      f"Reading (load average {result.load[0]:.1f}-{result.load[-1]:.1f} on "
      f"{os.cpu_count()} cores): the 3% target is {verdict}. The Trainer took {gaps} over the "
      f"hand-written loop, and was the slower of the two in {slower} rounds; the A/A control "
      f"moved by {control:.1f}% at most. Both loops run the same model, optimizer and "
      f"batches; the Trainer's step adds a step counter, a PRNG fold-in and a gradient "
      f"finiteness check, and around each step `fit` compares the batch's structure and "
      f"shapes with those already checked, hands a one-device mesh's NumPy batch to the "
      f"jitted step as it is (jit transfers it; the baseline `device_put`s it first), reads "
      f"the loss and finiteness flag one step late and records them. On the host-bound MLP, "
      f"with one step per dispatch, the Trainer takes {t.ratio_to(one, HAND):.2f}x the "
      f"hand-written loop's time per step ({one_us:.0f} us against {hand_us:.0f} us), and its "
      f"host thread {host[one]:.0f} us of CPU per step against {host[HAND]:.0f} us "
      f"({host[HAND_HOST]:.0f} us for the hand-written loop without `device_put`); "
      f"`steps_per_execution={K}` dispatches once per {K} steps and is {speedup:.2f}x "
      f"faster than `steps_per_execution=1` ({hand_us / sunk_us:.2f}x faster than "
      f"the hand-written loop).",
  ])


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


def _within_noise(t: harness.Timings, name: str) -> bool:
  """At most 1.0x within noise: the ratio no further above 1 than the A/A control
  strays from 1 (or 2%, the least the rounds resolve)."""
  return t.ratio(name) <= 1.0 + max(abs(t.ratio(CONTROL) - 1.0), 0.02)


def _fit_table(t: harness.Timings) -> list[str]:
  rows = [f"| {v} | {t.median(v):.3f} | {t.ratio(v):.3f} ({t.spread(v)[0]:.2f}-"
          f"{t.spread(v)[1]:.2f}) |" for v in (OFF, CONTROL, WARM_ON)]
  return ["| variant | median s per fit | ratio (range) |", "|---|---|---|", *rows]


def _autotune_section(result: harness.Result) -> str:
  p = result.params
  out = ["## `Trainer(autotune=True)` against `autotune=False`: never slower, no fixed cost",
         "", f"`benchmarks/run.py trainer{' --quick' if p['quick'] else ''}`. {result.machine} "
         f"({result.figures['utc']}). {result.load_line()} One device, `progress=False`, "
         f"{p['autotune_rounds']} interleaved rounds; ratios are medians of per-round ratios "
         f"to `autotune=False` (below 1 is faster), with the A/A control (`autotune=False` "
         f"timed twice).", "",
         f"### Steady state (after a {p['warm']}-step `fit` that tunes and checks)", "",
         "| model | steps/run | autotune=False ms/step | autotune=True ms/step | ratio "
         "(range) | A/A | at most 1.0x within noise | whole-program check |",
         "|---|---|---|---|---|---|---|---|"]
  for case in CASES:
    t = result.timings[case.name]
    lo, hi = t.spread(ON)
    out.append(
        f"| {case.name} | {case.steps} | {1e3 * t.median(OFF) / case.steps:.2f} | "
        f"{1e3 * t.median(ON) / case.steps:.2f} | {t.ratio(ON):.3f} ({lo:.2f}-{hi:.2f}) | "
        f"{t.ratio(CONTROL):.3f} | {'yes' if _within_noise(t, ON) else '**no**'} | "
        f"{_check_text(result.figures['checks'][case.name])} |")
  t = result.timings["whole fit, MLP"]
  off_s, ratio = t.median(OFF), t.ratio(WARM_ON)
  limit = 1.05 + 0.1 / off_s  # the median per-round ratio, as everywhere here
  (records, epochs), (images, cnn_epochs) = p["mlp_fit"], p["cnn_fit"]
  return "\n".join(out + [
      "", f"### Fixed cost: the README's MLP, a fresh Trainer, a whole fit "
      f"({records // 64 * epochs} steps)", "", *_fit_table(t), "",
      f"Target: `autotune=True` with a warm cache within 5% + 0.1 s of `autotune=False`: "
      f"{_met(ratio <= limit)} (median per-round ratio {ratio:.3f}, limit {limit:.3f} = "
      f"1.05 + 0.1 s / {off_s:.3f} s).", "",
      "### Fixed cost with kernels to tune: the MobileNet-style CNN, a fresh Trainer, "
      f"a whole fit on a warm cache ({images // 16 * cnn_epochs} steps)", "",
      *_fit_table(result.timings["whole fit, CNN"])])


def render(result: harness.Result) -> dict[str, str]:
  return {"trainer": _trainer_section(result), "trainer_autotune": _autotune_section(result)}
