"""`tunedjax.Trainer` against a hand-written `jax.jit` + optax loop, and `steps_per_execution`.

Three tables, each timed in interleaved rounds with an A/A control (the
baseline timed twice):

1. Per-step time of `Trainer.fit` against the loop a good JAX user writes by
   hand, on the same Flax nnx CNN (Conv-BatchNorm-ReLU x2, Adam) and the same
   pre-made list of NumPy batches (data loading is not measured), at two
   image sizes: a step of a few ms (16x16) and a longer one (32x32). The
   Trainer runs with ``autotune=False`` so both run the same program (the
   tuners are measured by the other benchmarks), ``progress=False`` and one
   device. The
   hand-written loop splits the model once (``nnx.split``), jits a pure step
   ``(params, rest, opt_state, batch) -> ...`` with donation, `device_put`s
   each batch, and reads each step's loss with ``float`` one step late (after
   the next step was dispatched), as the Trainer does: that is the baseline.
   Three more hand-written variants bound it: reading the loss right away
   (synchronous), never reading it (a lower bound: no loop records fewer
   figures), and passing the NumPy batch to the jitted step without a
   `device_put` (jit's own C++ transfer, which the Trainer uses on a
   one-device mesh). Each timed run is `N` steps; for the Trainer it is
   ``fit(batches, steps=trainer.step + N)`` (`fit` counts steps from the start
   of training), so each run's fixed `fit` costs (the data stream, the
   end-of-run history and model write-back) are charged to its `N` steps.
   Target (the Trainer issue): within 3% of the hand-written loop.
2. ``steps_per_execution=8`` against 1 on a tiny host-bound MLP (batch 32),
   where dispatching a step costs more than computing it: 8 steps in one
   compiled `lax.scan` per dispatch. The hand-written loop of table 1 on the
   same MLP is shown for reference. Target: at least 1.5x faster per step.
3. Logging: `Trainer.fit` with the `tunedjax.callbacks.TensorBoard` callback
   writing every step (and a `CSVLogger`, for reference) against the same
   `fit` without callbacks, on the CNN of table 1 at batch 48, 16x16 (a step
   of about 2 ms on 2 quiet cores). Each timed run is one `fit` of N steps,
   so the callback's per-`fit` cost (flushing its event file at the end) is
   charged to them. Target (the callbacks issue): the TensorBoard callback
   within 3%.

4. (``--only autotune``, its own section) ``Trainer(autotune=True)`` against
   ``autotune=False`` in steady state, on an MLP, a MobileNet-style CNN, the
   demo network (`tunedjax.demo.DemoNet`) and the Transformer LM: each pair
   of Trainers first fits `WARM_STEPS` steps (the tuning, and the
   whole-program check of the tuned step, happen there: the horizon is that
   fit's), then each timed run is `fit` of N more steps. Target (never
   slower): at most 1.0x within noise (the A/A control). And the fixed cost
   where nothing can be gained: the README's Trainer example scaled up (an
   MLP, 4096 records, batch 64, 5 epochs: 320 steps), a fresh Trainer and a
   whole `fit` per run, ``autotune=True`` with a warm tuning cache against
   ``autotune=False``. Target: within 5% + 0.1 s.

Run: `.venv/bin/python benchmarks/trainer.py [--quick] [--write] [--rounds N]
[--only logging|autotune]` (``--only logging``: table 3 alone, printed, never
written; ``--only autotune``: table 4 alone, written with ``--write`` to its own
section).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import harness as _harness
import _trainer_autotune as _autotune
from tunedjax.callbacks import CSVLogger, TensorBoard
from tunedjax.trainer import Trainer

HAND = "hand-written jit loop (loss read one step late)"
HAND_SYNC = "hand-written, float(loss) each step"
HAND_NONE = "hand-written, loss never read (lower bound)"
HAND_HOST = "hand-written, NumPy batch to the step (no device_put)"
TRAINER = "Trainer.fit (autotune=False)"
PLAIN = "Trainer.fit, no callbacks"
LOG_BATCH, LOG_IMAGE = 48, 16  # the logging table's CNN step: about 2 ms
BOARD = "Trainer.fit + TensorBoard (every step)"
CSV = "Trainer.fit + CSVLogger (every step)"


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


class TinyMLP(nnx.Module):
  """Two small Linear layers: a step's compute is a few microseconds."""

  def __init__(self, features: int = 16, hidden: int = 32, *, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.fc1 = nnx.Linear(features, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, 1, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.relu(self.fc1(x)))[:, 0]


def cnn_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mlp_loss(model, batch):
  return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def image_batches(count: int, batch: int, image: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(batch, image, image, 3)).astype(np.float32),
           "y": rng.integers(0, 10, size=batch).astype(np.int32)} for _ in range(count)]


def regression_batches(count: int, batch: int, features: int = 16
                       ) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  w = rng.normal(size=features).astype(np.float32)
  out = []
  for _ in range(count):
    x = rng.normal(size=(batch, features)).astype(np.float32)
    out.append({"x": x, "y": (x @ w).astype(np.float32)})
  return out


def one_device_mesh() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


# --- the two loops ----------------------------------------------------------------------


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

  def _step(self, batch: Any, put: bool) -> jax.Array:
    self.params, self.rest, self.opt_state, loss = self.train_step(
        self.params, self.rest, self.opt_state, jax.device_put(batch) if put else batch)
    return loss

  def run(self, batches: Sequence[Any], read: str, *, put: bool = True) -> None:
    """One pass over `batches`; `read` is "late", "sync" or "never"; `put`:
    `jax.device_put` each batch first (else jit transfers the NumPy arrays)."""
    pending = None
    for batch in batches:
      loss = self._step(batch, put)
      if read == "sync":
        self.losses.append(float(loss))
      elif read == "late":
        if pending is not None:
          self.losses.append(float(pending))
        pending = loss
    if pending is not None:
      self.losses.append(float(pending))
    jax.block_until_ready((self.params, self.rest, self.opt_state))


def trainer_run(trainer: Trainer, batches: Sequence[Any],
                callbacks: Sequence[Any] = ()) -> Callable[[], Any]:
  """`len(batches)` more steps of `trainer` (fit counts steps globally)."""

  def run():
    trainer.fit(batches, steps=trainer.step + len(batches), callbacks=list(callbacks))
    jax.block_until_ready(trainer.state)

  return run


def make_trainer(model: nnx.Module, loss_fn: Callable[..., Any], **kwargs: Any) -> Trainer:
  return Trainer(model, optax.adam(1e-3), loss_fn, autotune=False, progress=False,
                 mesh=one_device_mesh(), **kwargs)


def _per_step_notes(t: _harness.Timings, steps: int,
                    cpu: dict[str, list[float]] | None = None) -> dict[str, str]:
  base = t.median(t.baseline) / steps * 1e6
  notes = {}
  for name in t.runs:
    us = t.median(name) / steps * 1e6
    notes[name] = f"{us / 1e3:.3f} ms per step" + ("" if name == t.baseline
                                                    else f"; {us - base:+.0f} us")
    if cpu is not None and cpu.get(name):
      notes[name] += f"; host {statistics.median(cpu[name]) / steps * 1e6:.0f} us CPU"
  return notes


def _host_cpu(fn: Callable[[], Any], store: list[float]) -> Callable[[], Any]:
  """`fn`, recording the CPU seconds of the calling (host) thread of each run.

  The host's work per step (dispatch, transfers, bookkeeping) in CPU time:
  unlike wall time, it does not move with the load of the machine.
  """

  def run():
    start = time.thread_time()
    fn()
    store.append(time.thread_time() - start)

  return run


def _ratio_to(t: _harness.Timings, name: str, baseline: str) -> float:
  return _harness.Timings(t.runs, baseline).ratio(name)


# --- the tables --------------------------------------------------------------------------


def trainer_vs_hand(rounds: int, steps: int, batch: int, image: int
                    ) -> tuple[str, dict[str, float]]:
  batches = image_batches(steps, batch, image)
  hands = {read: HandLoop(CNN(), optax.adam(1e-3), cnn_loss) for read in ("late", "sync",
                                                                          "never", "host")}
  trainer = make_trainer(CNN(), cnn_loss)
  variants = {HAND: lambda: hands["late"].run(batches, "late"),
              TRAINER: trainer_run(trainer, batches),
              HAND_SYNC: lambda: hands["sync"].run(batches, "sync"),
              HAND_NONE: lambda: hands["never"].run(batches, "never"),
              HAND_HOST: lambda: hands["host"].run(batches, "late", put=False)}
  for fn in variants.values():  # compiles
    fn()
  t = _harness.interleaved(variants, baseline=HAND, rounds=rounds, warmup=1)
  return _harness.ratio_table(t, notes=_per_step_notes(t, steps)), {
      "ratio": t.ratio(TRAINER), "control": t.ratio(_harness.CONTROL),
      "vs_sync": _ratio_to(t, TRAINER, HAND_SYNC), "vs_none": _ratio_to(t, TRAINER, HAND_NONE),
      "vs_host": _ratio_to(t, TRAINER, HAND_HOST),
      "spread": t.spread(TRAINER), "hand_ms": t.median(HAND) / steps * 1e3,
      "trainer_ms": t.median(TRAINER) / steps * 1e3,
      "extra_us": (t.median(TRAINER) - t.median(HAND)) / steps * 1e6,
      "slower_rounds": sum(a > b for a, b in zip(t.runs[TRAINER], t.runs[HAND])),
      "rounds": len(t.runs[HAND])}


def steps_per_execution(rounds: int, steps: int, k: int = 8,
                        batch: int = 32) -> tuple[str, dict[str, float]]:
  batches = regression_batches(steps, batch)
  one, sunk = "Trainer, steps_per_execution=1", f"Trainer, steps_per_execution={k}"
  hand = HandLoop(TinyMLP(), optax.adam(1e-3), mlp_loss)
  hand_host = HandLoop(TinyMLP(), optax.adam(1e-3), mlp_loss)
  variants = {one: trainer_run(make_trainer(TinyMLP(), mlp_loss), batches),
              sunk: trainer_run(make_trainer(TinyMLP(), mlp_loss, steps_per_execution=k),
                                batches),
              HAND: lambda: hand.run(batches, "late"),
              HAND_HOST: lambda: hand_host.run(batches, "late", put=False)}
  for fn in variants.values():
    fn()
  cpu: dict[str, list[float]] = {name: [] for name in variants}
  variants = {name: _host_cpu(fn, cpu[name]) for name, fn in variants.items()}
  t = _harness.interleaved(variants, baseline=one, rounds=rounds, warmup=1)
  # The warm-up round left out (the baseline ran twice a round: itself and the A/A control).
  cpu = {name: v[-rounds * (2 if name == one else 1):] for name, v in cpu.items()}
  host_us = {name: statistics.median(v) / steps * 1e6 for name, v in cpu.items()}
  return _harness.ratio_table(t, notes=_per_step_notes(t, steps, cpu)), {
      "host_us": host_us, "one": one,
      "speedup": 1 / t.ratio(sunk), "control": t.ratio(_harness.CONTROL),
      "spread": t.spread(sunk), "one_us": t.median(one) / steps * 1e6,
      "sunk_us": t.median(sunk) / steps * 1e6, "hand_us": t.median(HAND) / steps * 1e6,
      "one_vs_hand": _ratio_to(t, one, HAND)}


def logging_overhead(rounds: int, steps: int, batch: int, image: int
                     ) -> tuple[str, dict[str, float]]:
  """Table 3: `fit` with the TensorBoard (and CSV) callback against `fit` alone."""
  batches = image_batches(steps, batch, image)
  # One trainer for every variant: they differ by the callbacks given to `fit` only.
  trainer = make_trainer(CNN(), cnn_loss)
  with tempfile.TemporaryDirectory(prefix="tunedjax-bench-logs-") as logs:
    variants = {
        PLAIN: trainer_run(trainer, batches),
        BOARD: trainer_run(trainer, batches, [TensorBoard(os.path.join(logs, "tb"))]),
        CSV: trainer_run(trainer, batches, [CSVLogger(os.path.join(logs, "csv"))]),
    }
    for fn in variants.values():  # compiles
      fn()
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    variants = {name: _host_cpu(fn, cpu[name]) for name, fn in variants.items()}
    t = _harness.interleaved(variants, baseline=PLAIN, rounds=rounds, warmup=1)
  # The warm-up round left out (the baseline ran twice a round: itself and the A/A control).
  cpu = {name: v[-rounds * (2 if name == PLAIN else 1):] for name, v in cpu.items()}
  host_us = {name: statistics.median(v) / steps * 1e6 for name, v in cpu.items()}
  return _harness.ratio_table(t, notes=_per_step_notes(t, steps, cpu)), {
      "ratio": t.ratio(BOARD), "csv": t.ratio(CSV), "control": t.ratio(_harness.CONTROL),
      "spread": t.spread(BOARD), "plain_ms": t.median(PLAIN) / steps * 1e3,
      "extra_us": (t.median(BOARD) - t.median(PLAIN)) / steps * 1e6,
      "host_extra_us": host_us[BOARD] - host_us[PLAIN], "host_us": host_us[PLAIN]}


def logging_lines(table: str, s: dict[str, float], rounds: int, steps: int, batch: int,
                  image: int) -> list[str]:
  """Table 3's section: what was timed, the table, the target."""
  lo, hi = s["spread"]
  return [
      f"### Logging: the TensorBoard callback ({steps} steps per timed run)",
      "",
      f"The CNN of the first table at batch {batch}, {image}x{image}x3 "
      f"({s['plain_ms']:.2f} ms per step without callbacks), Adam; "
      f"`fit(batches, steps=trainer.step + {steps}, callbacks=[...])` on one trainer with "
      f"`tunedjax.callbacks.TensorBoard` writing its per-step figures at every step "
      f"(loss, learning rate, step time, throughput, skips: one event per step, written in "
      f"batches at epoch ends, every 1000 steps or 10 s, and at the end of `fit`), against the "
      f"same `fit` without callbacks; `CSVLogger` (every step) for "
      f"reference. {rounds} interleaved rounds; one event file for all of them (the callback "
      f"keeps it open from one `fit` to the next and flushes it at each `fit`'s end).",
      "",
      table,
      "",
      f"Target: the TensorBoard callback within 3% of a ~2 ms step: "
      f"{'met' if s['ratio'] <= 1.03 else '**NOT met**'} (ratio {s['ratio']:.3f}, "
      f"{s['extra_us']:+.0f} us per step; per-round range {lo:.2f}-{hi:.2f}; CSVLogger "
      f"{s['csv']:.3f}; A/A {s['control']:.3f}). The host thread's CPU time, which moves "
      f"less with the machine's load: {s['host_extra_us']:+.0f} us per step with the "
      f"callback ({s['host_us']:.0f} us without), "
      f"{s['host_extra_us'] / (s['plain_ms'] * 1e3) * 100:+.1f}% of the step.",
  ]


def reading(cnn: dict[int, dict[str, float]], p: dict[str, float], k: int,
            load_before: float, load_after: float) -> str:
  """The "Reading" paragraph, from the figures of this run."""
  met = [image for image, s in cnn.items() if s["ratio"] <= 1.03]
  verdict = ("met at every size" if len(met) == len(cnn) else
             f"met at {', '.join(f'{i}x{i}' for i in met)} only" if met else "**NOT met**")
  gaps = " and ".join(f"{s['extra_us']:+.0f} us ({(s['ratio'] - 1) * 100:+.1f}%) per step at "
                      f"{s['hand_ms']:.1f} ms" for s in cnn.values())
  rounds = " and ".join(f"{s['slower_rounds']} of {s['rounds']}" for s in cnn.values())
  control = max(abs(s["control"] - 1) for s in cnn.values()) * 100
  host = p["host_us"]
  return (
      f"Reading (load average {load_before:.1f}-{load_after:.1f} on "
      f"{os.cpu_count()} cores): the 3% target is {verdict}. The Trainer took {gaps} over the "
      f"hand-written loop, and was the slower of the two in {rounds} rounds; the A/A control "
      f"moved by {control:.1f}% at most. Both loops run the same model, optimizer and "
      f"batches; the Trainer's step adds a step counter, a PRNG fold-in and a gradient "
      f"finiteness check, and around each step `fit` compares the batch's structure and "
      f"shapes with those already checked, hands a one-device mesh's NumPy batch to the "
      f"jitted step as it is (jit transfers it; the baseline `device_put`s it first), reads "
      f"the loss and finiteness flag one step late and records them. On the host-bound MLP, "
      f"with one step per dispatch, the Trainer takes {p['one_vs_hand']:.2f}x the "
      f"hand-written loop's time per step ({p['one_us']:.0f} us against {p['hand_us']:.0f} "
      f"us), and its host thread {host[p['one']]:.0f} us of CPU per step against "
      f"{host[HAND]:.0f} us ({host[HAND_HOST]:.0f} us for the hand-written loop without "
      f"`device_put`); "
      f"`steps_per_execution={k}` dispatches once per {k} steps and is {p['speedup']:.2f}x "
      f"faster than `steps_per_execution=1` ({p['hand_us'] / p['sunk_us']:.2f}x faster than "
      f"the hand-written loop).")


def cnn_tables_and_stats(rounds: int, sizes: Sequence[tuple[int, int]], batch: int
                         ) -> tuple[list[str], dict[int, dict[str, float]]]:
  """Table 1 at each (image size, steps per timed run): its markdown and figures."""
  tables, stats = [], {}
  for image, steps in sizes:
    table, s = trainer_vs_hand(rounds, steps, batch, image)
    title = (f"**CNN, batch {batch}, {image}x{image}x3: {s['hand_ms']:.1f} ms per "
             f"step, {steps} steps per timed run**")
    print(title, table, sep="\n", file=sys.stderr)
    tables.append(f"{title}\n\n{table}")
    stats[image] = s
  return tables, stats


def cnn_target_lines(stats: dict[int, dict[str, float]]) -> list[str]:
  """Table 1's target, one line per image size."""
  lines = []
  for image, s in stats.items():
    lo, hi = s["spread"]
    lines.append(
        f"- {image}x{image} ({s['hand_ms']:.1f} ms per step): "
        f"{'met' if s['ratio'] <= 1.03 else '**NOT met**'} (ratio {s['ratio']:.3f}, "
        f"{s['trainer_ms']:.2f} ms against {s['hand_ms']:.2f} ms per step, "
        f"{s['extra_us']:+.0f} us; per-round range {lo:.2f}-{hi:.2f}; A/A "
        f"{s['control']:.3f}). Against the synchronous loop {s['vs_sync']:.3f}, against the "
        f"lower bound {s['vs_none']:.3f}, against the hand-written loop without `device_put` "
        f"{s['vs_host']:.3f}.")
  return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="few steps, 2 rounds (smoke run)")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--batch", type=int, default=32, help="CNN batch size")
  parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
  parser.add_argument("--only", choices=("all", "logging", "autotune"), default="all",
                      help="'logging': the logging table alone (printed, not written); "
                           "'autotune': autotune on against off (its own section)")
  args = parser.parse_args(argv)
  if args.only == "logging" and args.write:
    parser.error("--write needs every table: drop --only logging")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  rounds = args.rounds or (2 if args.quick else 17)
  log_steps = 8 if args.quick else 100
  if args.only == "autotune":
    return _autotune.main(args, rounds=args.rounds or (2 if args.quick else 7))
  if args.only == "logging":
    table3, s3 = logging_overhead(rounds, log_steps, LOG_BATCH, LOG_IMAGE)
    print(f"{_harness.machine_line()} Load average {os.getloadavg()[0]:.1f} after.\n")
    print("\n".join(logging_lines(table3, s3, rounds, log_steps, LOG_BATCH, LOG_IMAGE)))
    return 0
  # (image size, steps per timed run): a short step (a few ms) and a longer one.
  cnn_sizes = [(16, 8)] if args.quick else [(16, 100), (32, 30)]
  mlp_steps = 32 if args.quick else 400
  k = 8
  load_before = os.getloadavg()[0]
  devices = jax.device_count()

  cnn_tables, cnn_stats = cnn_tables_and_stats(rounds, cnn_sizes, args.batch)
  table2, p = steps_per_execution(rounds, mlp_steps, k)
  print(table2, file=sys.stderr)
  table3, s3 = logging_overhead(rounds, log_steps, LOG_BATCH, LOG_IMAGE)
  print(table3, file=sys.stderr)

  target_lines = cnn_target_lines(cnn_stats)
  met_sunk = p["speedup"] >= 1.5
  lines = [
      "## `tunedjax.Trainer`: per-step overhead and `steps_per_execution`",
      "",
      f"`benchmarks/trainer.py`: {rounds} interleaved rounds after a compiling warm-up; ratios "
      f"are medians of per-round ratios to the baseline (below 1 is faster). One device "
      f"(`jax.device_count()` = {devices}; both loops on a one-device mesh), the same "
      f"pre-made list of NumPy batches for every variant, so data loading is not measured. "
      f"{_harness.machine_line()} Load average {load_before:.1f} before, "
      f"{os.getloadavg()[0]:.1f} after.",
      "",
      "### Trainer against a hand-written `jax.jit` + optax loop",
      "",
      f"Flax nnx CNN (3x3 conv 16 ch + BatchNorm + ReLU, strided 3x3 conv 32 ch + BatchNorm + "
      f"ReLU, mean, Linear 10), Adam, softmax cross-entropy, float32. The Trainer runs "
      f"`fit(batches, steps=trainer.step + N)` with `autotune=False, progress=False` (its "
      f"fixed per-`fit` costs are included, spread over the N steps). The hand-written loop "
      f"`nnx.split`s the model once and calls a `jax.jit(donate_argnums=(0, 1, 2))` step "
      f"`(params, rest, opt_state, batch)` on `jax.device_put(batch)`; the baseline reads each "
      f"loss with `float` one step late, as the Trainer does.",
      "",
      *[part for table in cnn_tables for part in (table, "")],
      "Target: the Trainer within 3% of the hand-written loop:",
      "",
      *target_lines,
      "",
      f"### `steps_per_execution={k}` against 1 ({mlp_steps} steps per timed run)",
      "",
      "Flax nnx MLP 16-32-1, Adam, batch 32, squared error: host-bound (a step's compute is "
      "microseconds; dispatch, the batch's transfer and bookkeeping dominate). \"host ... us "
      "CPU\": the CPU time of the host thread per step (`time.thread_time`: dispatch, "
      "transfers, bookkeeping), which moves less with the machine's load than wall time.",
      "",
      table2,
      "",
      f"Target: `steps_per_execution={k}` at least 1.5x faster per step: "
      f"{'met' if met_sunk else '**NOT met**'} ({p['speedup']:.2f}x: {p['sunk_us']:.0f} us "
      f"against {p['one_us']:.0f} us per step; per-round range of the ratio "
      f"{p['spread'][0]:.2f}-{p['spread'][1]:.2f}; A/A {p['control']:.3f}).",
      "",
      *logging_lines(table3, s3, rounds, log_steps, LOG_BATCH, LOG_IMAGE),
      "",
      reading(cnn_stats, p, k, load_before, os.getloadavg()[0]),
  ]
  body = "\n".join(lines)
  print(body)
  if args.write:
    _harness.write_section("trainer", body)
    print(f"wrote {_harness.BENCHMARKS_MD}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
