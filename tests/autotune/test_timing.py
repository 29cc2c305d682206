"""`time_interleaved` (GC off, early stop) and the tuner's early decision."""

from __future__ import annotations

import gc
import itertools

import pytest

from tunedjax.autotune import _timing
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
    ({"xla": [1.0, 1.0], "a": [0.1, 0.1], "b": [0.2, 0.2]}, False),      # two clear winners
    ({"xla": [1.0, 1.0], "a": [0.1]}, False),                            # a candidate behind
])
def test_clear_choice(times, clear):
  assert _tuner.clear_choice(times) is clear


def test_a_clear_choice_is_never_a_different_winner_than_all_rounds_give():
  # The early rule fires only when every round agrees by a wide factor, so the
  # median of the rounds taken picks what the median of all rounds would.
  for winner_ratio in (0.05, 0.3, 0.55):
    times = {"xla": [1.0, 1.1], "k": [winner_ratio, winner_ratio * 1.1]}
    if _tuner.clear_choice(times):
      assert winner_ratio * (1 + _tuner.DEFAULT_MARGIN) < 1.0
