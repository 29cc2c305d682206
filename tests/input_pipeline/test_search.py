"""The search that chooses `LoaderSettings`: its rules, its comparisons in
interleaved rounds and its climb, on synthetic speeds with a fake clock."""

from __future__ import annotations

import logging
import math

import pytest

from tunedjax import input_pipeline as ip
from tunedjax.input_pipeline import _search
from tunedjax.input_pipeline import _settings
from tests.input_pipeline.fakes import FakeClock
from tests.input_pipeline.fakes import buffered_peak
from tests.input_pipeline.fakes import measure_on
from tests.input_pipeline.fakes import peak

S = ip.LoaderSettings


def _space(start=S(), *, max_workers=4, tune=("workers", "read_threads"), **kwargs):
  return _settings.search_space(start, maxima={"worker_count": max_workers, "read_threads": 16,
                                               "prefetch_buffer": 16}, tune=tune, **kwargs)


def _run_climb(measure, clock, *, max_workers=4, tune=("workers", "read_threads"),
               batches_in_memory=None, **kwargs):
  kwargs["start"] = S.of(kwargs.get("start", (0, 16)))
  kwargs.setdefault("budget_s", 1e9)
  space = _space(kwargs["start"], max_workers=max_workers, tune=tune,
                 batches_in_memory=batches_in_memory)
  return _search.hill_climb(measure, space=space, clock=clock, **kwargs)


def test_climbs_both_knobs_to_the_best_setting():
  clock = FakeClock()
  result = _run_climb(measure_on(clock, peak), clock)
  grid = [(w, t) for w in range(5) for t in _settings.THREAD_LADDER]
  assert result.setting == max(grid, key=lambda s: peak(*s)) == (2, 1)
  assert result.stopped == "converged" and result.start == S(0, 16)
  assert len(result.trials) < len(grid)  # climbed, did not sweep


def _plateau(w: int, t: int) -> float:
  """What 2 cores measured on a decode-heavy pipeline: threads in one process
  or one worker reach the same rate; only several single-threaded workers win."""
  if w >= 2:
    return 60.0 - 2.0 * abs(math.log2(t + 1) - 1.5)
  return 45.0 if t >= 8 else 20.0 + 2.0 * t


def test_seeds_carry_the_climb_across_a_plateau():
  space = _space(max_workers=2)
  clock = FakeClock()
  plain = _search.hill_climb(measure_on(clock, _plateau), start=S(), space=space,
                             budget_s=1e9, clock=clock)
  assert _plateau(*plain.setting) == 45.0  # stuck on the plateau
  clock = FakeClock()
  seeded = _search.hill_climb(measure_on(clock, _plateau), start=S(), space=space,
                              budget_s=1e9, clock=clock,
                              seeds=_search.seed_settings(S(), space, cpus=2))
  grid = [(w, t) for w in space.values["worker_count"] for t in space.values["read_threads"]]
  assert seeded.setting == max(grid, key=lambda s: _plateau(*s))
  assert [t.phase for t in seeded.trials[1:3]] == ["seed", "seed"]


def test_workers_only_would_miss_the_best():
  clock = FakeClock()
  result = _run_climb(measure_on(clock, peak), clock, tune=("workers",))
  assert result.setting == (2, 16) and peak(2, 16) < peak(2, 1)


@pytest.mark.parametrize("budget_s", [0.0, 0.1, 3.0, 7.0, 15.0])
def test_time_budget_is_respected(budget_s):
  clock = FakeClock()
  result = _run_climb(measure_on(clock, peak), clock, budget_s=budget_s)
  assert result.seconds <= budget_s
  if budget_s == 0:
    assert result.trials == () and result.stopped == "no budget"
    assert result.settings == S(0, 16)
  else:
    assert result.stopped == "budget" and result.trials


def test_max_workers_is_respected():
  clock = FakeClock()
  measure = measure_on(clock, lambda w, t: 10.0 + 5 * w)  # more workers always faster
  result = _run_climb(measure, clock, max_workers=3)
  assert max(t.worker_count for t in result.trials) == 3 == result.worker_count
  assert result.batches == sum(t.batches for t in result.trials)


def test_start_is_kept_unless_beaten_beyond_the_noise_margin():
  clock = FakeClock()
  flat = measure_on(clock, lambda w, t: 10.0, noise=lambda i: 0.03 * (i % 3 - 1))
  result = _run_climb(flat, clock, start=(1, 4))
  assert result.settings == S(1, 4)


def test_top_two_are_remeasured_alternately():
  clock = FakeClock()
  result = _run_climb(measure_on(clock, peak), clock)
  confirm = [t.settings for t in result.trials if t.phase == "confirm"]
  assert len(confirm) == 4 and confirm[0] == confirm[3] != confirm[1] == confirm[2]
  assert result.settings in confirm


def test_each_trial_is_logged_at_debug(caplog):
  clock = FakeClock()
  with caplog.at_level(logging.DEBUG, logger="tunedjax.input_pipeline"):
    result = _run_climb(measure_on(clock, peak), clock)
  trial_lines = [r for r in caplog.records if "tuning trial" in r.getMessage()]
  assert len(trial_lines) == len(result.trials)
  assert "best: workers=2 read_threads=1 prefetch_buffer=2" in caplog.text
  assert "chosen" in result.table()


def test_the_buffer_is_climbed_with_the_other_knobs():
  clock = FakeClock()
  result = _run_climb(measure_on(clock, buffered_peak), clock, tune=_settings.TUNE_NAMES, start=S(0, 16, 2))
  assert result.settings == S(2, 1, 8)
  assert {t.prefetch_buffer for t in result.trials} > {2, 8}
  # without workers the buffer does nothing: no trial varies it there
  assert {t.prefetch_buffer for t in result.trials if t.worker_count == 0} == {2}
  clock = FakeClock()
  fixed = _run_climb(measure_on(clock, buffered_peak), clock, start=S(0, 16, 2))
  assert fixed.settings == S(2, 1, 2) and {t.prefetch_buffer for t in fixed.trials} == {2}


def test_the_climb_keeps_the_buffers_within_the_memory_budget():
  clock = FakeClock()
  # 12 batches fit: 2 workers may keep 6 each, not 8 (the unbounded best)
  result = _run_climb(measure_on(clock, buffered_peak), clock, tune=_settings.TUNE_NAMES, start=S(0, 16, 2),
                  batches_in_memory=12)
  assert all(t.worker_count * t.prefetch_buffer <= 12 for t in result.trials)
  assert result.settings == S(2, 1, 4)


def test_the_allowance_shrinks_as_the_climb_finds_faster_settings():
  """A tuning bounded by a tenth of the batches' time stops sooner once it
  has found that the batches will be read faster."""
  speed = lambda w, t: 100.0 if t == 0 else 1.0  # no read threads: 100x faster

  def climb(allowance):
    clock = FakeClock()
    return _run_climb(measure_on(clock, speed, body_s=0.5), clock, max_workers=0,
                      start=(0, 16), budget_s=100.0, allowance=allowance)
  assert climb(None).seconds > 2.0  # five 0.5 s trials and more
  # 0.1 x 1000 batches: 100 s at 1/s, 1 s at 100/s
  fast = climb(lambda rate: 0.1 * 1000 / rate)
  # the first round's three trials (16, 8, 0 threads), then no more: 1.5 s > 1 s
  assert fast.settings.read_threads == 0 and fast.stopped == "budget"
  assert len(fast.trials) == 3 and fast.seconds <= 1.5 + 1e-9


def test_interleaved_rounds_see_through_a_host_slowing_down():
  clock = FakeClock()
  order = []

  def measure(settings, deadline):  # the host slows by 20% at every trial
    order.append(settings.read_threads)
    rate = {0: 10.0, 2: 11.0}[settings.read_threads] * 0.8 ** (len(order) - 1)
    clock.now += 0.01
    return ip.Trial(settings, batches_per_s=rate, batches=4, startup_s=0.0, seconds=0.01)

  trials, best, scores = _search.compare(measure, [S(0, 0), S(0, 2)], rounds=2,
                                        left=lambda: 1.0, estimate=lambda s: 0.01,
                                        clock=clock)
  assert order == [0, 2, 2, 0] and [t.read_threads for t in trials] == order  # rotates
  assert best == S(0, 2) and scores[S(0, 2)] == pytest.approx((0.88 + 1.375) / 2)
  # a challenger within the margin does not replace the incumbent
  speeds = {0: 10.0, 2: 10.3}
  _, best, _ = _search.compare(
      lambda s, d: ip.Trial(s, batches_per_s=speeds[s.read_threads], batches=4,
                            startup_s=0.0, seconds=0.01),
      [S(0, 0), S(0, 2)], rounds=2, left=lambda: 1.0, estimate=lambda s: 0.01, clock=clock)
  assert best == S(0, 0)


def test_compare_stops_at_a_round_that_does_not_fit():
  clock = FakeClock()

  def measure(settings, deadline):
    clock.now += 0.4
    return ip.Trial(settings, batches_per_s=1.0 + settings.read_threads, batches=4,
                    startup_s=0.0, seconds=0.4)

  t0 = clock.now
  trials, best, _ = _search.compare(measure, [S(0, 0), S(0, 2)], rounds=3,
                                   left=lambda: 1.0 - (clock.now - t0),
                                   estimate=lambda s: 0.4, clock=clock)
  assert len(trials) == 2 and best == S(0, 2)  # one whole round, no third trial
  trials, best, _ = _search.compare(measure, [S(0, 0), S(0, 2)], rounds=3,
                                   left=lambda: 0.7, estimate=lambda s: 0.4, clock=clock)
  assert trials == [] and best is None  # no round fits: no trial, no winner
