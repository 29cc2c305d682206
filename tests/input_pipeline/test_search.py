"""The search that chooses `LoaderSettings`: its rules, its comparisons in
interleaved rounds and its climb, on synthetic speeds with a fake clock."""

from __future__ import annotations

import logging
import math
import os

import pytest

from tunedjax import input_pipeline as ip
from tunedjax.input_pipeline import _search
from tunedjax.input_pipeline import _settings
from tests.input_pipeline.fakes import FakeClock
from tests.input_pipeline.fakes import bench_on
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


# --- the rules, one by one ---------------------------------------------------------


def _trial(settings, rate=10.0, *, startup_s=0.0, seconds=0.1, cpu_s=None):
  return ip.Trial(S.of(settings), batches_per_s=rate, batches=4, startup_s=startup_s,
                  seconds=seconds, cpu_s=cpu_s)


def _look(serial_s=0.01, cpu_s=0.01, step_s=None):
  return _search.Look(serial_s, cpu_s, 8, step_s)


def test_scores_are_medians_and_the_first_measured_wins_a_tie():
  scores = _search.Scores()
  scores.add([_trial((0, 2), r) for r in (3.0, 1.0, 2.0)] + [_trial((0, 4), 2.0)])
  assert scores.of(S(0, 2)) == 2.0 and scores.best() == S(0, 2)


def test_beats_means_more_than_the_margin():
  assert _search.beats(10.6, 10.0, 0.05) and not _search.beats(10.5, 10.0, 0.05)


def test_keep_start_keeps_a_measured_start_unless_beaten_beyond_noise():
  scores = _search.Scores()
  scores.add([_trial((0, 0), 10.0), _trial((0, 2), 10.4), _trial((0, 4), 11.0)])
  assert _search.keep_start(S(0, 2), S(0, 0), scores, 0.05) == S(0, 0)
  assert _search.keep_start(S(0, 4), S(0, 0), scores, 0.05) == S(0, 4)
  assert _search.keep_start(S(0, 4), S(1, 0), scores, 0.05) == S(0, 4)  # never measured


def test_consumer_bound_when_a_batch_costs_the_step_at_most_the_margin():
  assert _search.consumer_bound(_look(0.01, step_s=1.0), 0.05)
  assert not _search.consumer_bound(_look(0.1, step_s=1.0), 0.05)
  assert not _search.consumer_bound(_look(1e-6), 0.05)  # no step: the loader is all


def test_the_allowance_is_a_tenth_of_the_horizon_within_bounds():
  assert _search.allowance_for(0.001, 1000, 60.0) == pytest.approx(0.1)
  assert _search.allowance_for(1e-6, 1000, 60.0) == _search.MIN_ALLOWANCE_S
  assert _search.allowance_for(1.0, 1000, 60.0) == 60.0  # the budget


def test_the_trial_window_is_sized_for_the_fastest_setting_the_model_allows():
  # 8 ms of CPU a batch over 2 cores: 4 ms at best; 10% of 1,000 of them, over 20
  assert _search.trial_window(_look(0.01, 0.008), 1000, 2) == pytest.approx(0.02)
  assert _search.trial_window(_look(0.01, 0.008, step_s=0.5), 1000, 2) == 2.0  # at most
  assert _search.trial_window(_look(0.01, 0.008), 1, 2) == _search.MIN_WINDOW_S


def test_a_trial_estimate_is_start_wave_and_window_until_measured():
  estimate = lambda trials: _search.trial_estimate(S(0, 4), trials, _look(), usable=2,
                                                   window_s=0.05)
  # start 2 ms + a wave of 4 batches on 2 cores (20 ms) and 4 thread starts (8 ms) + 50 ms
  assert estimate([]) == pytest.approx(0.08)
  # a thread measured to start in 5 ms
  assert estimate([_trial((0, 2), startup_s=0.01)]) == pytest.approx(0.092)
  assert estimate([_trial((0, 4), seconds=0.05), _trial((0, 4), seconds=0.03)]) == 0.03


def test_the_possible_saving_is_the_read_with_a_step_else_what_cores_leave():
  assert _search.possible_saving(_look(0.01, 0.005), 100, 2) == pytest.approx(0.75)
  assert _search.possible_saving(_look(0.01, 0.005, step_s=1.0), 100, 2) == pytest.approx(1.0)
  assert _search.possible_saving(_look(0.01, 0.01), 100, 1) == 0.0  # CPU-bound on one core


def test_in_series_is_the_start_without_threads_or_workers_where_allowed():
  assert _search.in_series(S(2, 16, 4), _space()) == S(0, 0, 4)
  assert _search.in_series(S(0, 16), _space(tune=("workers",))) is None


def test_startup_estimate_counts_worker_and_thread_starts_and_a_wave():
  assert _search.startup_estimate(S(0, 16), 0.01, 2) == pytest.approx(0.032 + 0.08)
  assert _search.startup_estimate(S(2, 1), 0.01, 2) == pytest.approx(3.0 + 0.004 + 0.01)


def test_a_climb_estimate_cuts_in_process_trials_short_but_not_worker_starts():
  seen = [_trial((1, 0), startup_s=1.0, seconds=1.5), _trial((0, 16), seconds=0.3),
          _trial((0, 8), seconds=0.2)]
  assert _search.climb_estimate(S(0, 4), seen) == 0.2  # the cheapest in this process
  assert _search.climb_estimate(S(1, 4), seen) == 1.5  # the dearest at that worker count
  assert _search.climb_estimate(S(2, 0), seen) == pytest.approx(2 * 1.0 + 0.5)
  assert _search.climb_estimate(S(2, 0), []) == 2 * _search.DEFAULT_STARTUP_PER_WORKER_S


def test_the_worker_floor_spreads_the_cpu_over_the_cores_at_the_share_a_thread_gets():
  assert _search.worker_floor(_look(0.1, 0.05), [], 2) == (0.05, 0.5, 0.05)
  assert _search.worker_floor(_look(0.1, 0.05), [_trial((0, 0), cpu_s=0.02)], 2)[0] == 0.02
  assert _search.worker_floor(_look(0.1, 0.05, step_s=0.2), [], 2)[0] == 0.2  # the step
  assert _search.worker_floor(_look(1.0, 0.01), [], 2)[1] == 0.05  # a busy host


def test_a_worker_trial_costs_the_fewest_workers_starts_and_a_body():
  space = _space(max_workers=4)
  assert _search.worker_trial_cost(space, S(0, 16), [], 0.05) == pytest.approx(1.5 + 0.05)
  assert _search.worker_trial_cost(space, S(1, 16), [_trial((1, 0), startup_s=0.1,
                                                            seconds=0.4)], 0.05) == 3.3


def test_the_thread_guess_is_none_one_per_core_and_twice_that():
  space = _space(max_workers=0)
  guess = lambda cores, **kw: [s.read_threads for s in _search.thread_guess(S(), space,
                                                                            cores=cores)]
  assert guess(1) == [0, 1, 2] and guess(2) == [0, 2, 4] and guess(16) == [0, 16]
  assert _search.thread_guess(S(), _space(tune=("workers",)), cores=2) == [S()]


def test_thread_neighbours_are_one_rung_down_and_up():
  ladder = [0, 1, 2, 4]
  step = lambda t: [s.read_threads for s in _search.thread_neighbours(S(0, t), ladder)]
  assert step(2) == [1, 4] and step(0) == [1] and step(4) == [2]


# --- the stages, through `search` on a synthetic bench -------------------------------


def _search_on(speed, *, start=S(), max_workers=4, n=1000, usable=2, budget_s=60.0,
               **bench):
  clock = FakeClock()
  bench, calls = bench_on(clock, speed, **bench)
  result = _search.search(bench, start=start, space=_space(start, max_workers=max_workers),
                          budget_s=budget_s, margin=0.05, expected_batches=n, usable=usable,
                          clock=clock)
  return result, calls


def test_a_consumer_bound_start_in_series_is_kept_without_a_trial():
  result, calls = _search_on(peak, start=S(0, 0), step_s=1.0)
  assert result.stopped == "consumer-bound" and not calls and result.settings == S(0, 0)
  assert result.batches_per_s == 1 / 1.01 and result.batches == 8
  assert result.reason.startswith("kept workers=0 read_threads=0")


def test_no_payback_reads_in_series_without_a_trial():
  result, calls = _search_on(peak, start=S(0, 16), serial=(2e-4, 2e-4, 8), n=100)
  assert result.stopped == "no payback" and not calls and result.settings == S(0, 0)
  assert "does not pay for one round of the first guesses (0, 2, 4 read threads" in result.reason


def _threads_only(w, t):
  return {0: 10.0, 1: 16.0, 2: 20.0, 4: 23.0, 8: 22.0, 16: 20.0}[t] if w == 0 else 5.0


def test_threads_are_searched_in_this_process_from_the_guess():
  result, calls = _search_on(_threads_only, max_workers=0, serial=(0.1, 0.01, 2), usable=1,
                             n=10**5)
  assert result.settings == S(0, 4) and result.stopped == "converged"
  assert [t.phase for t in result.trials[:9]] == ["guess"] * 9
  assert {s.read_threads for s, _ in calls} == {0, 1, 2, 4, 8}
  assert result.reason.endswith("searched the read threads and buffer only")


def test_a_start_with_workers_climbs_its_threads_first():
  result, calls = _search_on(peak, start=S(2, 16), max_workers=2, serial=(0.1, 0.1, 2),
                             n=10**5)
  first = [s for s, _ in calls][:3]
  assert all(s.worker_count == 2 for s in first) and first[0] == S(2, 16)
  assert result.settings == S(2, 1)


def test_workers_are_not_tried_where_they_cannot_read_faster():
  # 50 ms of CPU a batch at half a core each on 2 cores: 50 ms at best, as read now
  result, calls = _search_on(lambda w, t: 20.0, serial=(0.1, 0.05, 8), n=10**5)
  assert "worker processes cannot read faster" in result.reason
  assert result.stopped == "converged" and all(s.worker_count == 0 for s, _ in calls)


def test_workers_are_not_tried_where_a_tenth_of_their_saving_does_not_pay():
  # 20 ms of CPU a batch at a fifth of a core each on 2 cores: 50 ms at best
  # against 100 ms, 10 s over 200 batches, a tenth of which is not a worker trial
  result, calls = _search_on(lambda w, t: 10.0, serial=(0.1, 0.02, 2), n=200)
  assert "does not fit in 10% of that" in result.reason
  assert all(s.worker_count == 0 for s, _ in calls)


def test_workers_are_searched_where_they_pay_and_the_start_kept_unless_beaten():
  result, calls = _search_on(lambda w, t: 40.0 if w else 10.0, serial=(0.1, 0.1, 2), n=10**5)
  assert result.worker_count > 0 and "after the worker search" in result.reason
  assert {t.phase for t in result.trials} >= {"guess", "seed"}
  flat, _ = _search_on(lambda w, t: 10.0, start=S(0, 0), serial=(0.1, 0.1, 2), n=10**6)
  assert flat.settings == S(0, 0)  # nothing beat the start beyond noise


def test_seed_settings_default_to_the_cores_this_process_may_use(monkeypatch):
  """Without `cpus`, seeds fit the process's CPU affinity, not the machine's cores."""
  space = _settings.search_space(S(), maxima={"worker_count": 8, "read_threads": 16})
  monkeypatch.setattr(os, "cpu_count", lambda: 64)
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
  assert _search.usable_cores() == 2
  got = [(s.worker_count, s.read_threads) for s in _search.seed_settings(S(), space)]
  assert got == [(w, t) for w, t in
                 ((s.worker_count, s.read_threads)
                  for s in _search.seed_settings(S(), space, cpus=2))]
  assert all(t <= 2 for _, t in got)
