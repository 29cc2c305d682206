"""`time_interleaved` (GC off, early stop) and the tuner's early decision."""

from __future__ import annotations

import gc
import itertools

import numpy as np
import pytest

from tunedjax._tuning import _timing
from tunedjax.autotune import _tuner


def _fake_clock():
  ticks = itertools.count()
  return lambda: float(next(ticks))


def test_garbage_collection_is_off_while_timing_and_restored_after():
  seen = []
  candidates = {"a": lambda: seen.append(gc.isenabled()), "b": lambda: seen.append(gc.isenabled())}
  assert gc.isenabled()
  _timing.time_interleaved(candidates, rounds=2)
  assert seen and not any(seen)
  assert gc.isenabled()
  gc.disable()
  try:
    _timing.time_interleaved(candidates, rounds=1)
    assert not gc.isenabled()  # a caller that had it off keeps it off
  finally:
    gc.enable()


def test_garbage_collection_is_restored_when_a_candidate_raises():
  def boom():
    raise RuntimeError("boom")
  with pytest.raises(RuntimeError):
    _timing.time_interleaved({"a": boom}, rounds=1)
  assert gc.isenabled()


def test_stop_ends_the_rounds_early_and_sees_every_candidate_each_round():
  seen = []

  def stop(times):
    seen.append({k: len(v) for k, v in times.items()})
    return len(times["a"]) == 2

  times = _timing.time_interleaved({"a": lambda: 1, "b": lambda: 2}, rounds=6, stop=stop,
                                   clock=_fake_clock())
  assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}
  assert seen == [{"a": 1, "b": 1}, {"a": 2, "b": 2}]


def test_stop_is_not_asked_after_the_last_round():
  calls = []
  _timing.time_interleaved({"a": lambda: 1}, rounds=2, stop=lambda t: calls.append(1) or False,
                           clock=_fake_clock())
  assert calls == [1]


@pytest.mark.parametrize("times, clear", [
    ({"xla": [1.0, 1.0], "depthwise": [0.1, 0.2]}, True),               # a clear win
    ({"xla": [1.0, 1.0], "im2col": [2.0, 3.0]}, True),                  # a clear loss
    ({"xla": [1.0, 1.0], "a": [0.1, 0.1], "b": [3.0, 2.0]}, True),
    ({"xla": [1.0], "depthwise": [0.1]}, False),                         # one round only
    ({"xla": [1.0, 1.0], "im2col": [0.8, 0.95]}, False),                 # close to the margin
    ({"xla": [1.0, 1.0], "im2col": [0.1, 1.0]}, False),                  # rounds disagree
    ({"xla": [1.0, 1.0], "a": [0.1, 0.1], "b": [0.2, 0.2]}, True),       # a beats b by 2x
    ({"xla": [1.0, 1.0], "a": [0.1, 0.1], "b": [0.12, 0.13]}, False),    # a close second
    ({"xla": [1.0, 1.0], "a": [0.1, 0.1], "b": [0.9, 1.1]}, True),       # b near xla: moot
    ({"xla": [1.0, 1.0], "a": [0.1]}, False),                            # a candidate behind
])
def test_clear_choice(times, clear):
  assert _tuner.clear_choice(times) is clear


@pytest.mark.parametrize("seed", range(20))
def test_a_clear_choice_names_the_winner_the_median_of_its_rounds_gives(seed):
  # Whenever the rule stops, the rounds taken already decide as the tuner's
  # median rule does, and a later round within the clear factor cannot flip it.
  rng = np.random.default_rng(seed)
  names = ["a", "b", "c"]
  level = {n: float(rng.choice([0.05, 0.3, 0.8, 1.0, 2.0])) for n in names}
  times = {"xla": [1.0, 1.0], **{n: [level[n] * rng.uniform(0.9, 1.1) for _ in range(2)]
                                 for n in names}}
  if not _tuner.clear_choice(times):
    return
  medians = {n: float(np.median(times[n])) for n in names}
  best = min(medians, key=medians.get)
  threshold = 1 / (1 + _tuner.DEFAULT_MARGIN)
  if medians[best] < threshold:
    assert all(medians[n] > medians[best] * _tuner.CLEAR_FACTOR for n in names if n != best)
  else:
    assert all(m > threshold * _tuner.CLEAR_FACTOR for m in medians.values())
