"""`tune_worker_count`: its measurements (real and small, or synthetic through
the search), its bounds and its cache entry."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tunedjax as tj
from tunedjax import input_pipeline as ip
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _search
from tunedjax.input_pipeline import _settings
from tunedjax.input_pipeline import _tuner
from tests.input_pipeline.fakes import FakeClock
from tests.input_pipeline.fakes import buffered_peak

# The tuner's searches time real pipelines against their budgets: not beside
# other tests (the serial phase of `make test`).
pytestmark = pytest.mark.serial

S = ip.LoaderSettings


@pytest.fixture
def cache_dir(tmp_path):
  with tj.config_context({"cache": {"dir": str(tmp_path)}}):
    yield tmp_path


def _slow_square(x):
  return np.sqrt(np.abs(x)) * x


def test_real_tuning_is_bounded_and_cached(cache_dir):
  src = np.random.default_rng(0).normal(size=(256, 8)).astype(np.float32)
  kwargs = dict(batch_size=8, transforms=[_slow_square], max_workers=0,
                max_read_threads=2, tuning_steps=60, budget_s=20)
  first = ip.tune_worker_count(src, **kwargs)
  assert not first.from_cache and first.trials
  assert all(t.batches <= 60 for t in first.trials)  # tuning_steps: per trial
  assert first.seconds <= 20 + 1
  assert all(t.worker_count == 0 and t.read_threads <= 2 for t in first.trials)
  assert all(t.batches_per_s > 0 for t in first.trials)
  again = ip.tune_worker_count(src, **kwargs)
  assert again.from_cache and again.trials == () and again.seconds == 0.0
  assert again.setting == first.setting
  other = ip.tune_worker_count(src, **{**kwargs, "batch_size": 4})  # another pipeline
  assert not other.from_cache


def test_consumer_is_measured_end_to_end(cache_dir):
  seen = []
  result = ip.tune_worker_count(np.arange(200.0), batch_size=4, max_workers=0,
                                max_read_threads=1, tuning_steps=40, budget_s=10,
                                consumer=seen.append, cache=False)
  # interleaved rounds of the guesses (no threads, one), each trial end to end
  assert {t.phase for t in result.trials} <= {"guess", "climb"}
  assert {t.read_threads for t in result.trials} == {0, 1}
  trial_batches = sum(t.batches for t in result.trials)
  assert trial_batches > 0 and result.batches > trial_batches  # + the serial first look
  # + one untimed warm-up (the compile), + the step timed alone on a ready batch
  assert 1 <= len(seen) - 1 - trial_batches <= _search.CONSUMER_CALLS
  assert result.step_s is not None and result.batch_s is not None


class _SlowRecords:
  """A transform that "takes" `seconds` of the fake clock per record."""

  def __init__(self, offset, seconds):
    self.offset, self.seconds = offset, seconds

  def __call__(self, record):
    self.offset[0] += self.seconds
    return record


def test_a_slow_consumer_and_a_fast_loader_skip_the_search(cache_dir):
  offset = [0.0]

  def slow_step(batch):  # every step "takes" 1 s of the fake clock
    offset[0] += 1.0
  clock = lambda: time.perf_counter() + offset[0]
  result = ip.tune_worker_count(np.arange(400.0), batch_size=4, max_workers=2,
                                max_read_threads=16, read_threads=16, tuning_steps=100,
                                budget_s=6, consumer=slow_step, cache=False, clock=clock)
  assert result.stopped == "consumer-bound" and result.trials == ()
  assert result.settings == result.start == S(0, 16)
  assert result.step_s == pytest.approx(1.0, abs=0.05) and result.batch_s < 0.05
  assert "not the bottleneck" in result.reason and "1e+03 ms" in result.reason
  assert result.seconds < 6
  # decided on the first estimate (a few batches read in series), no probe
  assert "in series" in result.reason and result.batches <= _search.SERIAL_BATCHES


def test_a_consumer_bound_finding_is_cached_like_a_search(cache_dir):
  offset = [0.0]

  def slow_step(batch):  # every step "takes" 1 s of the fake clock
    offset[0] += 1.0
  clock = lambda: time.perf_counter() + offset[0]
  options = dict(batch_size=4, max_workers=2, max_read_threads=16, read_threads=16,
                 tuning_steps=100, budget_s=6, consumer=slow_step, clock=clock)
  first = ip.tune_worker_count(np.arange(400.0), **options)
  assert first.stopped == "consumer-bound" and not first.from_cache
  again = ip.tune_worker_count(np.arange(400.0), **options)  # a restart: nothing measured
  assert again.from_cache and again.settings == first.settings and again.trials == ()


def test_a_slow_loader_and_a_fast_consumer_search(cache_dir):
  offset = [0.0]
  clock = lambda: time.perf_counter() + offset[0]
  result = ip.tune_worker_count(np.arange(400.0), batch_size=4, max_workers=0,
                                max_read_threads=2, read_threads=2, tuning_steps=30,
                                budget_s=60, transforms=[_SlowRecords(offset, 0.01)],
                                consumer=lambda batch: None, cache=False, clock=clock)
  assert result.stopped != "consumer-bound" and len(result.trials) > 1
  # 4 records of 10 ms a batch; two read threads advance the fake clock
  # concurrently (an unlocked +=), so a little of it can be lost: not 0.04.
  assert result.batch_s >= 0.02 and result.step_s < 0.01
  assert {t.read_threads for t in result.trials} >= {0, 2}  # the guesses


def test_a_slow_consumer_cannot_push_tuning_far_past_its_budget(cache_dir):
  offset = [0.0]

  def slow_step(batch):  # every step "takes" 1 s of the fake clock
    offset[0] += 1.0
  clock = lambda: time.perf_counter() + offset[0]
  # batches of 4 records at 0.1 s: the loader is a bottleneck worth searching
  result = ip.tune_worker_count(np.arange(400.0), batch_size=4, max_workers=0,
                                max_read_threads=0, read_threads=0, tuning_steps=100,
                                budget_s=6, consumer=slow_step, cache=False, clock=clock,
                                transforms=[_SlowRecords(offset, 0.1)])
  # One trial at most: its first batch, then two timed ones, never its whole warm-up.
  assert result.trials and result.stopped != "consumer-bound"
  assert result.seconds <= 6 + 3 * 1.4 + 0.5


def test_the_consumers_first_call_is_not_charged_to_the_budget(cache_dir):
  offset = [0.0]

  def compiling_step(batch):  # the first call "takes" 1000 s, as a compile would
    if not offset[0]:
      offset[0] = 1000.0
  clock = lambda: time.perf_counter() + offset[0]
  result = ip.tune_worker_count(np.arange(200.0), batch_size=4, max_workers=0,
                                max_read_threads=1, tuning_steps=20, budget_s=10,
                                consumer=compiling_step, cache=False, clock=clock)
  assert result.trials and result.stopped != "no budget" and result.seconds < 10 + 1


def test_loader_auto_tuning_does_not_move_the_stream(cache_dir):
  src = np.arange(300.0)
  plain = ip.Loader(src, batch_size=6, seed=2, worker_count=0, read_threads=0)
  auto = ip.Loader(src, batch_size=6, seed=2, worker_count="auto", read_threads="auto",
                   max_workers=0, tuning_steps=40, tuning_budget_s=10)
  result = auto.tune()
  assert result is not None and not result.from_cache and auto.position == 0
  assert auto.settings == result.settings
  for _ in range(5):
    np.testing.assert_array_equal(next(auto), next(plain))
  restarted = ip.Loader(src, batch_size=6, seed=2, max_workers=0, tuning_steps=40,
                        tuning_budget_s=10)
  next(restarted)
  assert restarted.tuning.from_cache and restarted.tuning.settings == result.settings


def test_config_enable_tunes_even_given_ints(cache_dir):
  with tj.config_context({"dataloader": {"enable": True, "max_workers": 0,
                                         "tuning_steps": 30}}):
    loader = ip.Loader(np.arange(100.0), batch_size=4, worker_count=0, read_threads=4,
                       tuning_budget_s=10)
    result = loader.tune(cache=False)
  assert result is not None and result.start == S(0, 4)
  assert all(t.batches <= 30 and t.worker_count == 0 for t in result.trials)


def test_only_the_auto_knob_is_tuned(cache_dir):
  loader = ip.Loader(np.arange(100.0), batch_size=4, worker_count=0, read_threads="auto",
                     tuning_steps=30, tuning_budget_s=10)
  # No payback bound: a search whose first look says no trial could pay back for
  # 1,000 batches would try nothing, and nothing would be checked.
  result = loader.tune(cache=False, expected_batches=10**6)
  assert result.trials and {t.worker_count for t in result.trials} == {0}


@pytest.mark.slow
def test_real_trial_with_a_worker_process(cache_dir):
  result = ip.tune_worker_count(np.arange(400.0), batch_size=4, worker_count=1,
                                read_threads=0, prefetch_buffer=1, max_workers=1,
                                max_read_threads=0, max_prefetch_buffer=2, tuning_steps=40,
                                budget_s=30, cache=False,
                                expected_batches=10**6)  # no payback bound: search it all
  assert result.trials[0].settings == S(1, 0, 1) and result.trials[0].startup_s > 0
  # the first round also steps the worker's buffer, with a real worker
  assert {t.prefetch_buffer for t in result.trials if t.worker_count} == {1, 2}
  assert result.seconds <= 30 + 2
  assert all(t.batches <= 40 for t in result.trials)


def test_bad_tuner_options_are_explained():
  with pytest.raises(tj.ConfigError, match="max_workers"):
    ip.tune_worker_count(np.arange(10.0), batch_size=2, max_workers=-1)
  with pytest.raises(tj.ConfigError, match="did you mean 'workers'"):
    ip.tune_worker_count(np.arange(10.0), batch_size=2, tune=("worker",))


def test_consumer_seconds_bound_the_measured_rate(cache_dir):
  result = ip.tune_worker_count(np.arange(200.0), batch_size=4, max_workers=0,
                                max_read_threads=0, tuning_steps=12, budget_s=10,
                                consumer_s=0.004, cache=False)
  assert result.trials and all(t.batches_per_s <= 1 / 0.004 for t in result.trials)


# --- the per-worker prefetch buffer: searched, bounded by memory, cached ---------


class _FakeMeasure:
  """Stands in for `_tuner._measure_real`: records what the tuner asked for."""

  def __init__(self, speed):
    self.speed, self.seen, self.datasets = speed, [], []

  def __call__(self, ds, **kwargs):
    self.datasets.append(ds)

    def measure(settings, deadline):
      self.seen.append(settings)
      knobs = (settings.worker_count, settings.read_threads, settings.prefetch_buffer)
      return ip.Trial(settings, batches_per_s=max(0.1, self.speed(*knobs)), batches=10,
                      startup_s=0.0, seconds=0.01)

    return measure


@pytest.fixture
def fake_measure(monkeypatch):
  fake = _FakeMeasure(buffered_peak)
  monkeypatch.setattr(_tuner, "_measure_real", fake)
  return fake


_IMAGES = np.random.default_rng(1).normal(size=(64, 8, 8, 3)).astype(np.float32)
_BATCH_BYTES = 4 * 8 * 8 * 3 * 4  # batch_size 4, float32


def _tune(**kwargs):
  kwargs = {"batch_size": 4, "max_workers": 4, "max_read_threads": 16, "tuning_steps": 20,
            "budget_s": 60, **kwargs}
  return ip.tune_worker_count(_IMAGES, **kwargs)


def test_tuning_measures_a_batch_and_bounds_the_buffers_by_it(cache_dir, fake_measure):
  result = _tune(memory_budget=12 * _BATCH_BYTES, cache=False)
  assert fake_measure.seen and all(
      s.worker_count * s.prefetch_buffer * _BATCH_BYTES <= 12 * _BATCH_BYTES
      for s in fake_measure.seen)
  assert len({s.prefetch_buffer for s in fake_measure.seen}) > 1  # the buffer was searched
  assert result.settings == S(2, 1, 4)
  roomy = _tune(memory_budget=10**9, cache=False)
  assert roomy.settings == S(2, 1, 8)
  assert _tune(max_prefetch_buffer=4, memory_budget=10**9, cache=False).prefetch_buffer == 4


def test_the_default_budget_is_a_fraction_of_available_memory(cache_dir, fake_measure,
                                                             monkeypatch):
  monkeypatch.setattr(_settings, "available_memory", lambda: 40 * _BATCH_BYTES)
  _tune(cache=False)  # 10 batches: a quarter of the 40 available
  assert max(s.worker_count * s.prefetch_buffer for s in fake_measure.seen
             if s.worker_count) <= 40 * _settings.MEMORY_FRACTION


def test_the_chosen_buffer_round_trips_through_the_cache(cache_dir, fake_measure):
  first = _tune()
  assert not first.from_cache and first.settings == S(2, 1, 8)
  (entry,) = tj.autotune.Cache().entries("dataloader")
  assert entry.value["prefetch_buffer"] == 8 and entry.value["batch_bytes"] == _BATCH_BYTES
  assert first.trials[0].settings == S(0, 0)  # the guesses start with the read in series
  assert entry.value["trials"][0] == {**S(0, 0).to_dict(),
                                      "batches_per_s": round(first.trials[0].batches_per_s, 3)}
  measured = len(fake_measure.seen)
  again = _tune()
  assert again.from_cache and again.settings == first.settings
  assert len(fake_measure.seen) == measured  # nothing measured
  # With less memory now, the cached buffer is lowered to fit (not re-measured).
  tight = _tune(memory_budget=8 * _BATCH_BYTES)
  assert tight.from_cache and tight.settings == S(2, 1, 4)


def test_an_entry_from_before_the_buffer_converts_and_a_bad_one_is_a_miss(
    cache_dir, fake_measure):
  cache = tj.autotune.Cache()
  key = _tuner.cache_key(
      _dataset.as_source(_IMAGES), batch_size=4, transforms=[], shuffle=True,
      drop_remainder=True, start=S(), tune=_settings.TUNE_NAMES, consumer=None, consumer_s=None,
      maxima={"worker_count": 4, "read_threads": 16,
              "prefetch_buffer": _tuner.DEFAULT_MAX_PREFETCH_BUFFER})
  old = {"worker_count": 3, "read_threads": 1, "batches_per_s": 12.5, "seconds": 4.0,
         "trials": [[0, 16, 10.0], [3, 1, 12.5]]}  # the two-value format
  cache.put("dataloader", key, old)
  converted = _tune(cache=cache)
  assert converted.from_cache and converted.settings == S(3, 1, 2)
  assert not fake_measure.seen
  for bad in ({**old, "prefetch_buffer": 0}, {**old, "prefetch_buffer": "x"},
              {"read_threads": 1, "batches_per_s": 1.0}, {**old, "batch_bytes": -1}):
    cache.put("dataloader", key, bad)
    with pytest.warns(UserWarning, match="invalid 'dataloader' entry"):
      retuned = _tune(cache=tj.autotune.Cache())
    assert not retuned.from_cache and retuned.trials


def test_a_loader_tunes_the_buffer_only_along_with_another_knob(cache_dir):
  assert not ip.Loader(np.arange(8), batch_size=2, worker_count=2, read_threads=1).needs_tuning
  loader = ip.Loader(np.arange(8), batch_size=2, worker_count=2, read_threads=1)
  assert loader.settings == S(2, 1, 2) and loader.tuning is None
  assert ip.Loader(np.arange(8), batch_size=2, worker_count=2, read_threads=1,
                   prefetch_buffer=5).prefetch_buffer == 5
  assert ip.Loader(np.arange(8), batch_size=2, worker_count="auto").needs_tuning


def test_the_loader_runs_with_the_settings_it_tuned(cache_dir, fake_measure):
  loader = ip.Loader(_IMAGES, batch_size=4, max_workers=4, tuning_steps=20,
                     tuning_budget_s=60)
  result = loader.tune(cache=False)
  assert result.settings == loader.settings == S(2, 1, 8)
  assert "prefetch_buffer=8" in repr(loader) and "prefetch_buffer" in result.table()


def _workers_pay(w, t, b):
  return 40.0 if w else 10.0


_workers_pay.with_buffer = True


@pytest.mark.parametrize("expected_batches, searched", [(100, False), (10**5, True)])
def test_worker_trials_only_when_a_tenth_of_their_saving_pays_for_one(
    cache_dir, fake_measure, monkeypatch, expected_batches, searched):
  fake_measure.speed = _workers_pay
  # read in series: 0.1 s a batch, all of it CPU (an idle core)
  monkeypatch.setattr(_tuner, "_time_serial", lambda ds, **kw: (0.1, 0.1, 2))
  result = _tune(expected_batches=expected_batches, cache=False)
  # workers could save up to 0.1 - 0.1 / cores s a batch: 5-9 s over 100
  # batches, a tenth of which does not pay for a ~1.5 s worker start (nor
  # does a tenth of the 100 batches' 10 s)
  assert any(s.worker_count for s in fake_measure.seen) == searched
  if not searched:
    # (a tenth of what any setting could save does not even pay for a round of
    # the in-process guesses)
    assert result.worker_count == 0 and result.stopped == "no payback"
    assert "does not pay for one round" in result.reason
  else:
    assert result.worker_count > 0


class _Waves:
  """An iterator of n read threads on a fake clock: batch i is ready at the
  end of wave i // n + 1 (a wave takes `wave_s`), so n arrive together."""

  def __init__(self, clock, n, wave_s):
    self.clock, self.n, self.wave_s, self.i, self.t0 = clock, n, wave_s, 0, clock.now

  def __next__(self):
    self.clock.now = max(self.clock.now, self.t0 + (self.i // self.n + 1) * self.wave_s)
    self.i += 1
    return np.zeros(2)

  def close(self):
    pass


@pytest.mark.parametrize("threads", [1, 4, 16])
def test_an_in_process_window_times_whole_waves_of_read_threads(monkeypatch, threads):
  clock = FakeClock()
  monkeypatch.setattr(_tuner._processes, "open_iterator",
                      lambda ds, settings: _Waves(clock, threads, 1.0))
  warmup, window = _tuner.trial_sizes(500, S(0, threads))
  with _tuner._Pool() as pool:
    measure = _tuner._measure_real(None, warmup=warmup, window=window, max_window_s=1e-3,
                                   consumer=None, consumer_s=None, clock=clock, pool=pool)
    trial = measure(S(0, threads), clock.now + 1e-3)
  # threads batches a second: not the burst of a wave that was ready already
  assert trial.batches_per_s == pytest.approx(threads)
  assert trial.batches <= 1 + max(2, threads)  # one wave timed, no drain of the buffer



class _Iterator:

  def __init__(self):
    self.closed = False

  def close(self):
    self.closed = True


def test_the_pool_keeps_the_two_latest_worker_settings_warm_and_closes_all(monkeypatch):
  opened = []
  monkeypatch.setattr(_tuner._processes, "open_iterator",
                      lambda ds, settings: opened.append(_Iterator()) or opened[-1])
  with _tuner._Pool() as pool:
    for settings in (S(1, 0), S(2, 0), S(0, 4), S(4, 0)):
      iterator, warm = pool.take(None, settings)
      assert not warm
      pool.give_back(settings, iterator)
    assert pool.take(None, S(2, 0)) == (opened[1], True)  # re-measured on warm workers
    assert pool.take(None, S(1, 0))[1] is False  # the oldest was closed
  # all it held closed; the two taken out are the taker's to give back
  assert [it.closed for it in opened] == [True, False, True, True, False]


# --- issue 18, item 1: the first look, the payback rule, the guess, contention ---


def _host(monkeypatch, *, serial: tuple[float, float, int], cores: int) -> None:
  """A host of `cores` usable cores where reading in series measures `serial`
  (seconds a batch, CPU seconds a batch, batches read)."""
  monkeypatch.setattr(_tuner, "_time_serial", lambda ds, **kw: serial)
  monkeypatch.setattr(_tuner, "host_fingerprint",
                      lambda: {"cpu": "", "cpus": cores, "usable_cpus": cores, "machine": "x"})


def _threads_peak_at_4(w, t, b):
  """Decode-like: read threads help up to 4 (on any core count), workers never."""
  return {0: 10.0, 1: 16.0, 2: 20.0, 4: 23.0, 8: 22.0, 16: 20.0}[t] if w == 0 else 5.0


_threads_peak_at_4.with_buffer = True


def _no_threads_best(w, t, b):
  """Light-like: every hand-off to a read thread costs more than it gives."""
  return 100.0 / (1.0 + 0.2 * t) if w == 0 else 10.0


_no_threads_best.with_buffer = True


def test_the_search_starts_from_the_guess_not_the_starts_thread_wave(cache_dir, fake_measure,
                                                                     monkeypatch):
  fake_measure.speed = _no_threads_best
  # read in series: 10 ms a batch, 5 ms of it CPU (worth a search on 2 cores)
  _host(monkeypatch, serial=(0.01, 0.005, 2), cores=2)
  result = _tune(read_threads=16, max_workers=0, cache=False)
  assert result.settings == S(0, 0)
  # never the start's 16 threads: a wave of 16 was what the light pipeline paid
  assert max(s.read_threads for s in fake_measure.seen) <= 4
  assert [t.phase for t in result.trials][:3] == ["guess"] * 3
  assert [t.read_threads for t in result.trials[:3]] == [0, 2, 4]


def test_the_climb_from_the_guess_finds_the_best_thread_count(cache_dir, fake_measure,
                                                              monkeypatch):
  fake_measure.speed = _threads_peak_at_4
  # read in series: 0.1 s a batch, 10 ms of it CPU (it waits: threads can help)
  _host(monkeypatch, serial=(0.1, 0.01, 2), cores=1)
  result = _tune(max_workers=0, cache=False)  # guesses 0, 1, 2 on one core
  assert result.settings == S(0, 4)
  assert {t.read_threads for t in result.trials} == {0, 1, 2, 4, 8}  # not 16
  assert result.stopped == "converged"


@pytest.mark.parametrize("expected_batches, stops", [(100, True), (10**6, False)])
def test_a_horizon_too_short_to_pay_back_a_trial_stops_at_once(
    cache_dir, fake_measure, monkeypatch, expected_batches, stops):
  # read in series: 0.2 ms a batch, all of it CPU, on 2 cores: threads could
  # save at most 0.1 ms a batch, 10 ms over 100 batches, a tenth of which
  # (1 ms) does not pay for a trial (a 4 ms window and two batches)
  _host(monkeypatch, serial=(2e-4, 2e-4, 8), cores=2)
  result = _tune(expected_batches=expected_batches, cache=False)
  if stops:
    assert result.stopped == "no payback" and result.trials == () and not fake_measure.seen
    assert result.settings == S(0, 0) and result.batches == 8
    assert "does not pay for one round" in result.reason and "100 batches" in result.reason
  else:
    assert result.stopped != "no payback" and fake_measure.seen


def test_a_real_light_pipeline_is_tuned_within_a_tenth_of_its_batches(cache_dir):
  src = np.random.default_rng(0).normal(size=(4000, 64)).astype(np.float32)
  result = ip.tune_worker_count(src, batch_size=16, transforms=[_slow_square],
                                max_workers=0, cache=False)
  epoch_s = 1000 / result.batches_per_s
  # a tenth of the batches at the pace found, plus one trial's overrun
  assert result.seconds <= 0.1 * epoch_s + 0.02, result.table()
  assert all(t.read_threads <= 4 for t in result.trials)  # no 16-thread wave


def _sleepy(record):  # waits like a read from disk: threads overlap it
  time.sleep(0.001)
  return record


def test_a_waiting_pipeline_is_given_read_threads(cache_dir):
  result = ip.tune_worker_count(np.arange(2000.0), batch_size=4, transforms=[_sleepy],
                                max_workers=0, cache=False)
  serial_rate = 1 / result.batch_s
  assert result.read_threads >= 2 and result.batches_per_s > 1.5 * serial_rate, result.table()
  # a tenth of the batches at the pace found, and what the last round's trials
  # overran it by on a loaded host (their estimates are from the pace before)
  assert result.seconds <= 0.15 * 1000 / result.batches_per_s + 0.05, result.table()


class _ChargedOffTheMainThread:
  """A transform that, read on a thread other than the main one, "takes"
  `seconds` of the fake clock per record from whatever else runs: the read
  threads' contention with the step for the cores and the GIL."""

  def __init__(self, offset, seconds):
    self.offset, self.seconds = offset, seconds

  def __call__(self, record):
    import threading  # pylint: disable=g-import-not-at-top
    if threading.current_thread() is not threading.main_thread():
      self.offset[0] += self.seconds
    return record


@pytest.mark.parametrize("contended", [False, True])
def test_a_consumer_bound_start_is_checked_for_contention_with_the_step(cache_dir, contended):
  offset = [0.0]

  def slow_step(batch):  # every step "takes" 1 s of the fake clock
    offset[0] += 1.0
    time.sleep(0.002)  # and lets the read threads run (a step releases the GIL)
  clock = lambda: time.perf_counter() + offset[0]
  transforms = [_ChargedOffTheMainThread(offset, 0.1 if contended else 0.0)]
  result = ip.tune_worker_count(np.arange(400.0), batch_size=4, max_workers=2,
                                max_read_threads=16, read_threads=16, tuning_steps=100,
                                budget_s=60, consumer=slow_step, cache=False, clock=clock,
                                transforms=transforms)
  assert result.stopped == "consumer-bound" and result.step_s == pytest.approx(1.0, abs=0.05)
  assert {t.phase for t in result.trials} == {"contention"}
  assert {t.settings for t in result.trials} == {S(0, 16), S(0, 0)}
  assert "not the bottleneck" in result.reason
  if contended:  # 16 threads cost each step 0.4 s: read in series instead
    assert result.settings == S(0, 0) and "slow the step" in result.reason
  else:
    assert result.settings == S(0, 16)
  assert result.seconds < 0.1 * 1000 * 1.0  # within a tenth of the horizon's steps


# --- issue 18, item 3: the horizon is stored with the choice ---------------------


def test_a_longer_horizon_tunes_again_and_an_equal_or_shorter_one_reuses(cache_dir,
                                                                         fake_measure):
  first = _tune(expected_batches=1000)
  assert not first.from_cache
  (entry,) = tj.autotune.Cache().entries("dataloader")
  assert entry.value["expected_batches"] == 1000
  measured = len(fake_measure.seen)
  assert _tune(expected_batches=1000).from_cache
  assert _tune(expected_batches=10).from_cache
  assert len(fake_measure.seen) == measured
  longer = _tune(expected_batches=50_000)  # may pay for more trials: measured again
  assert not longer.from_cache and len(fake_measure.seen) > measured
  (entry,) = tj.autotune.Cache().entries("dataloader")  # replaced, not added
  assert entry.value["expected_batches"] == 50_000
  measured = len(fake_measure.seen)
  assert _tune(expected_batches=1000).from_cache  # the longer horizon's choice serves
  assert _tune(expected_batches=50_000).from_cache
  assert len(fake_measure.seen) == measured


def test_an_entry_without_a_horizon_counts_as_the_default_one(cache_dir, fake_measure):
  _tune()
  cache = tj.autotune.Cache()
  (entry,) = cache.entries("dataloader")
  value = {k: v for k, v in entry.value.items() if k != "expected_batches"}
  cache.put("dataloader", entry.key, value)
  assert _tune(cache=cache, expected_batches=_tuner.DEFAULT_EXPECTED_BATCHES).from_cache
  assert not _tune(cache=cache, expected_batches=2 * _tuner.DEFAULT_EXPECTED_BATCHES).from_cache
  cache.put("dataloader", entry.key, {**value, "expected_batches": 0})
  with pytest.warns(UserWarning, match="invalid 'dataloader' entry"):
    assert not _tune(cache=tj.autotune.Cache()).from_cache


def test_a_no_payback_finding_is_cached_with_its_horizon(cache_dir, fake_measure, monkeypatch):
  monkeypatch.setattr(_tuner, "_time_serial", lambda ds, **kw: (2e-4, 2e-4, 8))
  first = _tune(expected_batches=100)
  assert first.stopped == "no payback" and not first.from_cache
  assert _tune(expected_batches=100).from_cache  # a restart reads nothing
  assert not _tune(expected_batches=10**6).from_cache  # a long horizon searches
  assert fake_measure.seen
