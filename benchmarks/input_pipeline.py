"""Input-pipeline throughput: grain's defaults, Paddle's rule, tunedjax's tuner, the oracle.

Three pipelines, batch 16, through `tunedjax.input_pipeline`'s grain recipe: light (a
64-float record, scaled: the reading overhead dominates), decode (a PNG-like decode of a
112x112x3 image: zlib inflate, which releases the GIL, an un-filter pass and NumPy
normalisation; about 3 ms a record) and python (a pure-Python word count and hash: holds
the GIL). For each, four `LoaderSettings` (worker processes, read threads, prefetch
buffer): grain's defaults (16 threads, 500-element buffer, no workers); Paddle's rule
(the same hill climb over worker processes only); tuned (`tune_worker_count` over all
three knobs, horizon `expected_batches` 1,000 and 10,000); the oracle (the best setting
of a full sweep). Then timed in interleaved rounds: each round starts every setting's
iterator afresh, skips its warm-up and times a window of batches (at least 40 and
`MIN_WINDOW_S`); ratios to grain's defaults, timed twice as the A/A control. The tuning
time is compared with a 1,000-step epoch at the tuned throughput.

Run: `.venv/bin/python benchmarks/run.py input_pipeline [--quick] [--write]`.
"""

from __future__ import annotations

import os
import time
import zlib

import grain
import numpy as np

import harness
from tunedjax.input_pipeline import LoaderSettings
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline import _tuner

BATCH = 16
SIDE = 112
MIN_WINDOW_S = 0.25
HORIZONS = (1000, 10_000)  # expected_batches: one 1,000-step epoch, ten


def light(record):
  return record * 2.0 + 1.0


def decode(blob):
  a = np.frombuffer(zlib.decompress(blob), np.uint8).reshape(SIDE, SIDE, 3)
  a = np.cumsum(a.astype(np.int32), axis=1).astype(np.uint8)  # undo a PNG "Sub" filter
  x = a.astype(np.float32) / 255.0
  return (x - x.mean((0, 1))) / (x.std((0, 1)) + 1e-6)


def python_heavy(text):
  counts = {}
  for word in text.split():
    counts[word] = counts.get(word, 0) + 1
  h = 0
  for c in text:
    h = (h * 31 + ord(c)) & 0xFFFFFFFF
  return np.array([h, len(counts)], np.int64)


def make_sources(n: int) -> dict[str, tuple[object, list]]:
  rng = np.random.default_rng(0)
  ramp = np.add.outer(np.arange(SIDE), np.arange(SIDE))[..., None]
  images = [(ramp + rng.integers(0, 40, (SIDE, SIDE, 3))).astype(np.uint8)
            for _ in range(min(n, 256))]
  blobs = [zlib.compress(np.diff(im, axis=1, prepend=np.uint8(0)).astype(np.uint8).tobytes(), 6)
           for im in images]
  words = "the quick brown fox jumps over the lazy dog".split()
  texts = [" ".join(rng.choice(words, 400)) for _ in range(min(n, 256))]
  return {
      "light": (rng.normal(size=(n, 64)).astype(np.float32), [light]),
      "decode": ([blobs[i % len(blobs)] for i in range(n)], [decode]),
      "python": ([texts[i % len(texts)] for i in range(n)], [python_heavy]),
  }


def window_s_per_batch(ds, settings, *, window: int, grain_defaults: bool = False) -> float:
  """Seconds per batch in steady state: skip the buffers, time `window` batches."""
  if grain_defaults:
    iterator = iter(ds.to_iter_dataset())
    warmup = 16 + 2  # its 16 threads start 16 batches at once
  else:
    iterator = _processes.open_iterator(ds, settings)
    warmup = _processes.buffered_batches(settings) + 2
  try:
    for _ in range(warmup):
      next(iterator)
    start = time.perf_counter()
    n = 0
    while n < window or time.perf_counter() - start < MIN_WINDOW_S:
      next(iterator)
      n += 1
    return (time.perf_counter() - start) / n
  finally:
    _processes.close_quietly(iterator)


def label(settings: LoaderSettings) -> str:
  return f"({settings.worker_count}, {settings.read_threads}, {settings.prefetch_buffer})"


def sweep(ds, grid, *, window: int) -> dict[LoaderSettings, float]:
  return {s: window_s_per_batch(ds, s, window=window) for s in grid}


def run_pipeline(name, source, transforms, *, rounds, window, max_workers, quick):
  ds = _dataset.build(source, batch_size=BATCH, transforms=transforms, shuffle=True,
                      seed=0, num_epochs=None, drop_remainder=True)
  tune_kwargs = dict(batch_size=BATCH, transforms=transforms, max_workers=max_workers, cache=False)
  if quick:
    tune_kwargs.update(tuning_steps=60, budget_s=15)
  tuned, tuned_s = {}, {}
  for horizon in HORIZONS:  # wall time: building the tuning pipeline included
    t0 = time.perf_counter()
    tuned[horizon] = _tuner.tune_worker_count(source, expected_batches=horizon,
                                              **tune_kwargs)
    tuned_s[horizon] = time.perf_counter() - t0
  paddle = _tuner.tune_worker_count(source, tune=("workers",), **tune_kwargs)
  threads = (0, 1, 4, 16) if quick else _settings.THREAD_LADDER
  grid = [LoaderSettings(w, t) for w in range(max_workers + 1) for t in threads]
  t0 = time.perf_counter()
  swept = sweep(ds, grid, window=window)
  sweep_s = time.perf_counter() - t0
  oracle = min(swept, key=swept.get)

  variants = {
      "grain defaults (0 workers, 16 threads, 500 buffer)": ("defaults", None),
      f"Paddle's rule: workers only -> {label(paddle.settings)}": ("fixed", paddle.settings),
      f"tunedjax tuned, horizon {HORIZONS[0]:,} -> {label(tuned[HORIZONS[0]].settings)}":
          ("fixed", tuned[HORIZONS[0]].settings),
      f"tunedjax tuned, horizon {HORIZONS[1]:,} -> {label(tuned[HORIZONS[1]].settings)}":
          ("fixed", tuned[HORIZONS[1]].settings),
      f"oracle (sweep of {len(grid)}) -> {label(oracle)}": ("fixed", oracle),
  }
  names = [*variants, harness.CONTROL]
  baseline = names[0]
  runs = {n: [] for n in names}
  for r in range(rounds):
    for n in harness.rotated(names, r):
      kind, setting = variants.get(n, variants[baseline])
      runs[n].append(window_s_per_batch(ds, setting or LoaderSettings(), window=window,
                                        grain_defaults=kind == "defaults"))
  timings = harness.Timings(runs, baseline)
  oracle_name = names[4]
  notes = {names[1]: f"tuned in {paddle.seconds:.1f} s, {len(paddle.trials)} trials",
           oracle_name: f"sweep took {sweep_s:.0f} s"}
  lines = []
  for i, horizon in enumerate(HORIZONS):
    n, r = names[2 + i], tuned[horizon]
    epoch_s = 1000 * timings.median(n)  # a 1,000-step epoch at the tuned throughput
    notes[n] = (f"tuned in {r.seconds:.2f} s ({tuned_s[horizon]:.2f} s wall), "
                f"{len(r.trials)} trials, {r.batches} batches, stopped: {r.stopped}; "
                f"= {r.seconds / epoch_s:.0%} of a 1,000-step epoch ({epoch_s:.2f} s)")
    lines.append(
        f"horizon {horizon:,} batches: tuned reaches "
        f"{timings.median(oracle_name) / timings.median(n):.0%} of the oracle's "
        f"throughput, {1 / timings.ratio(n):.2f}x grain defaults'; tuning = "
        f"{r.seconds / epoch_s:.1%} of a 1,000-step epoch "
        f"({r.seconds / (epoch_s * horizon / 1000):.1%} of the horizon's batches); "
        f"{r.reason or r.stopped}.")
  table = harness.ratio_table(timings, unit="ms/batch", scale=1e3, notes=notes)
  summary = "\n".join(f"- {line}" for line in lines)
  return f"**{name}**\n\n{table}\n\n{summary}\n", tuned


def measure(quick: bool = False) -> harness.Result:
  """Each pipeline's table (its tuning and the interleaved throughput rounds)."""
  rounds, window = (2, 16) if quick else (5, 40)
  max_workers = os.cpu_count() or 1
  parts = [run_pipeline(name, source, transforms, rounds=rounds, window=window,
                        max_workers=max_workers, quick=quick)[0]
           for name, (source, transforms) in make_sources(400 if quick else 4000).items()]
  return harness.Result("input_pipeline", figures={"parts": parts}, params={
      "rounds": rounds, "window": window, "max_workers": max_workers})


def render(result: harness.Result) -> str:
  p = result.params
  return ("## Input pipeline: tuned workers and read threads\n\n"
          "Median ms per batch (lower is better), ratio to grain's defaults per round. "
          "Produced by `benchmarks/run.py input_pipeline`.\n\n" + "\n".join(result.figures["parts"])
          + f"\n{result.machine} {result.load_line()} {p['rounds']} rounds of {p['window']} "
          f"batches of {BATCH}; max_workers={p['max_workers']}.")
