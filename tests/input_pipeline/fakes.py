"""Synthetic speeds and a fake clock for the loader's tuner tests."""

from __future__ import annotations

import math

from tunedjax import input_pipeline as ip
from tunedjax.input_pipeline import _search


class FakeClock:
  """Seconds that pass only when a fake trial says so."""

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def measure_on(clock, speed, *, startup_per_worker=1.5, body_s=0.5, batches=10,
                  noise=None):
  """A measurement on the fake clock; `speed(workers, threads)`, or with
  `speed.with_buffer`, `speed(workers, threads, buffer)`."""
  calls = []

  def measure(settings, deadline):
    calls.append((settings, deadline))
    startup = startup_per_worker * settings.worker_count
    start = clock.now
    # as the real one: the start-up cannot be cut short, the timed window can
    clock.now = min(start + startup + body_s, max(start + startup, deadline))
    knobs = ((settings.worker_count, settings.read_threads, settings.prefetch_buffer)
             if getattr(speed, "with_buffer", False)
             else (settings.worker_count, settings.read_threads))
    bps = max(0.1, speed(*knobs)) * (1.0 + (noise(len(calls)) if noise else 0.0))
    return ip.Trial(settings, batches_per_s=bps, batches=batches, startup_s=startup,
                    seconds=clock.now - start)

  measure.calls = calls
  return measure


def peak(w, t):  # best at 2 workers, 1 read thread
  return 20.0 - 3.0 * (w - 2) ** 2 - (math.log2(t + 1) - 1.0) ** 2


def buffered_peak(w, t, b):
  """The best at 2 workers, 1 thread, a buffer of 8; each buffer step pays ~10%."""
  buffer_gain = 3.0 * (3.0 - abs(math.log2(b) - 3.0)) if w else 0.0
  return peak(w, t) - 3.0 * (w - 2) ** 2 + buffer_gain


buffered_peak.with_buffer = True


def bench_on(clock, speed, *, serial=(0.01, 0.01, 8), step_s=None, **kwargs):
  """A `_search.Bench` on the fake clock, and the trials it was asked for:
  trials of `measure_on(clock, speed, **kwargs)`, a serial read measuring
  `serial` (seconds, CPU seconds, batches) and a step of `step_s`."""
  measure = measure_on(clock, speed, **kwargs)
  bench = _search.Bench(serial=lambda batches, limit_s: serial,
                        step=lambda calls, limit_s: step_s, trial=lambda window_s: measure)
  return bench, measure.calls
