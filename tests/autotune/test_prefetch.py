"""Tuning work started ahead (`autotune/_prefetch.py`): the default kernels of the
buckets a trace will tune, compiled on a spare core, never while anything is timed.

First the `Prefetcher` alone (order, take, timing, close, failures, context),
then through `tunedjax.jit`: every bucket tuned takes its default from the work
ahead, decisions are those made without it, and no timing ever overlaps a
compile ahead.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tunedjax as tj
from tests.autotune import selection_helpers as h
from tunedjax import _tuning
from tunedjax._config import get_config
from tunedjax.autotune import _prefetch, _select, _tuner
from tunedjax.autotune._prefetch import Prefetcher

WAIT_S = 10.0  # the most a test waits for the other thread (it never takes that long)


# --- the Prefetcher alone ------------------------------------------------------------


def _wait_until(p: Prefetcher, key: str, state: str) -> None:
  with p._cond:  # pylint: disable=protected-access
    assert p._cond.wait_for(lambda: p._jobs[key].state == state, WAIT_S)  # pylint: disable=protected-access


def test_jobs_run_in_the_order_given_and_a_job_not_started_is_left_to_the_caller():
  p = Prefetcher()
  ran, gate = [], threading.Event()
  p.expect("first", lambda: (gate.wait(WAIT_S), ran.append("first"), 1)[-1], order=(0, 0))
  _wait_until(p, "first", _prefetch.RUNNING)
  for name, order in (("late", (1, 5)), ("early", (1, 2)), ("never", (0, 5)),
                      ("passed by", (1, 1))):
    p.expect(name, lambda name=name: (ran.append(name), name)[-1], order=order)
  p.expect("early", lambda: "a second expect of a key is ignored", order=(0, 0))
  assert p.take("never") is None  # not started: the caller does it, and it never runs
  gate.set()
  assert p.take("first") == 1  # waited for
  _wait_until(p, "early", _prefetch.DONE)
  # At most AHEAD finished jobs wait to be taken: "late" waits for a take.
  assert _prefetch.AHEAD == 2 and p._jobs["late"].state == _prefetch.PENDING  # pylint: disable=protected-access
  assert p.take("early") == "early"  # drops "passed by", a site the pass went past
  _wait_until(p, "late", _prefetch.DONE)
  assert p.take("late") == "late"
  assert p.take("first") is None and p.take("passed by") is None  # taken once; dropped
  p.close()
  assert ran == ["first", "passed by", "early", "late"] and p.done == 4


def test_no_job_runs_while_the_caller_times_and_timing_waits_for_the_job_in_progress():
  p = Prefetcher()
  release, entered, held = threading.Event(), threading.Event(), []
  p.expect("slow", lambda: (release.wait(WAIT_S), "slow")[-1], order=(0,))
  _wait_until(p, "slow", _prefetch.RUNNING)

  def time_something():
    with p.timing():
      entered.set()
      p.expect("held", lambda: "held", order=(1,))
      held.append(p._jobs["held"].state)  # pylint: disable=protected-access
  timer = threading.Thread(target=time_something)
  timer.start()
  assert not entered.wait(0.05)  # the compile in progress finishes first
  release.set()
  timer.join(WAIT_S)
  assert entered.is_set() and p.take("slow") == "slow"
  assert held == [_prefetch.PENDING]  # not started while the caller timed
  _wait_until(p, "held", _prefetch.DONE)  # once the timing ended
  p.close()


def test_close_drops_what_was_not_started_and_a_failure_only_means_do_it_yourself():
  p = Prefetcher()
  p.expect("boom", lambda: 1 / 0, order=(0,))
  gate = threading.Event()
  p.expect("blocker", lambda: (gate.wait(WAIT_S), "b")[-1], order=(1,))
  p.expect("dropped", lambda: "never", order=(2,))
  _wait_until(p, "blocker", _prefetch.RUNNING)
  assert p.take("boom") is None  # failed
  closing = threading.Thread(target=p.close)
  closing.start()
  assert not p._thread.join(0.05) and p._thread.is_alive()  # pylint: disable=protected-access
  gate.set()  # close waits for the job in progress
  closing.join(WAIT_S)
  assert not p._thread.is_alive()  # pylint: disable=protected-access
  assert p.take("dropped") is None
  p.expect("after close", lambda: "never", order=(3,))
  assert p.take("after close") is None


def test_a_job_runs_in_the_context_it_was_expected_in():
  p = Prefetcher()
  with tj.config_context({"kernel": {"objective": "memory"}}):
    p.expect("config", lambda: get_config().kernel.objective, order=(0,))
  _wait_until(p, "config", _prefetch.DONE)
  assert p.take("config") == "memory" and get_config().kernel.objective == "time"
  p.close()


# --- through tunedjax.jit ------------------------------------------------------------


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=h.DN)


def _three_buckets(x, ws):
  for w in ws:
    x = jax.nn.relu(_conv(x, w))
  return x.sum()


@pytest.fixture
def recorded(monkeypatch):
  """Fake timings (t_transposed twice xla's speed), and every timing's and
  every compile's interval with its thread."""
  intervals = []
  real_compile = _tuner._compile_all
  speed = {"xla": 0.002, "t_transposed": 0.001}

  def compile_all(functions, args, times=None):
    start = time.perf_counter()
    try:
      return real_compile(functions, args, times)
    finally:
      intervals.append(("compile", sorted(functions), threading.current_thread().name,
                        start, time.perf_counter()))

  def timed(runners, rounds=5, **kw):
    start = time.perf_counter()
    for run in runners.values():
      run()  # the real calls, so that a compile beside them would overlap
    intervals.append(("time", sorted(runners), threading.current_thread().name,
                      start, time.perf_counter()))
    return {n: [speed.get(n, 0.003)] * rounds for n in runners}

  monkeypatch.setattr(_tuner, "_compile_all", compile_all)
  monkeypatch.setattr(_tuning, "time_interleaved", timed)
  monkeypatch.setattr(_tuning, "usable_cores", lambda: 2)
  with h.registered("t_transposed"):
    yield intervals


def _tune_through_jit(tmp_path, rng, look_ahead: bool, monkeypatch):
  if not look_ahead:
    monkeypatch.setattr(_select, "_may_look_ahead", lambda selection: False)
  taken = []
  real_take = _prefetch.Prefetcher.take

  def patient_take(self, key):
    # Deterministic: waits for the worker to start a job the main thread
    # reached first (`take` itself leaves such a job to the caller).
    with self._cond:
      while key in self._jobs and self._jobs[key].state == _prefetch.PENDING:
        self._cond.wait()
    got = real_take(self, key)
    if not (isinstance(key, tuple) and key[0] == "reference"):
      taken.append(got)  # a bucket's default (a reference made beside is a tuple)
    return got

  monkeypatch.setattr(_prefetch.Prefetcher, "take", patient_take)
  x = jnp.asarray(rng.normal(size=(2, 8, 8, 3)).astype(np.float32))
  ws = [jnp.asarray(rng.normal(size=s).astype(np.float32))
        for s in ((3, 3, 3, 4), (3, 3, 4, 4), (1, 1, 4, 6))]
  f = tj.jit(_three_buckets, session=tj.autotune.TuningSession())  # tunes at once
  with tj.config_context({"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)}}):
    out = f(x, ws)
  entries = tj.autotune.Cache(tmp_path).entries("conv")
  decisions = {(tuple(e.key["lhs_shape"]), tuple(e.key["rhs_shape"])):
               (e.value["winner"], sorted(e.value["timings"]), sorted(e.value.get("pruned", {})),
                e.value.get("error_ratios"))
               for e in entries}
  np.testing.assert_allclose(float(out), float(_three_buckets(x, ws)), rtol=1e-5)
  return decisions, taken


def test_each_bucket_takes_its_default_from_the_work_ahead_and_decides_alike(
    recorded, tmp_path, rng, monkeypatch):
  ahead, taken = _tune_through_jit(tmp_path / "ahead", rng, True, monkeypatch)
  assert len(ahead) == 3 and len(taken) == 3 and all(t is not None for t in taken)
  worker = {i[2] for i in recorded if i[0] == "compile" and "xla" in i[1]}
  assert worker == {"tunedjax-prefetch"}  # every default compiled ahead, none again
  assert all(d[3] for d in ahead.values())  # error ratios (or their bounds) recorded
  recorded.clear()
  alone, taken = _tune_through_jit(tmp_path / "alone", np.random.default_rng(0), False,
                                   monkeypatch)
  assert taken == [] and alone == ahead  # winners, what was timed and pruned, error ratios
  assert all(i[2] == threading.current_thread().name for i in recorded)


def test_no_timing_overlaps_a_compile_ahead(recorded, tmp_path, rng, monkeypatch):
  _tune_through_jit(tmp_path, rng, True, monkeypatch)
  ahead = [(s, e) for kind, _, thread, s, e in recorded
           if kind == "compile" and thread == "tunedjax-prefetch"]
  timings = [(s, e) for kind, _, _, s, e in recorded if kind == "time"]
  assert ahead and timings
  for s, e in timings:
    assert all(e <= a or b <= s for a, b in ahead), (s, e, ahead)


def test_nothing_is_done_ahead_where_a_trace_will_not_tune(recorded, tmp_path, rng, monkeypatch):
  # A warm cache, or one core: no work ahead is started.
  _tune_through_jit(tmp_path, rng, True, monkeypatch)
  started = []
  monkeypatch.setattr(_prefetch.Prefetcher, "expect",
                      lambda self, key, make, order: started.append(key))
  _tune_through_jit(tmp_path, rng, True, monkeypatch)  # every bucket cached
  monkeypatch.setattr(_tuning, "usable_cores", lambda: 1)
  _tune_through_jit(tmp_path / "one core", rng, True, monkeypatch)
  assert started == []
