"""Tuning sessions: phases (observe / tune / apply), the step counter, `stats`, no global state."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.autotune import selection_helpers as h
from tunedjax import _tuning
from tunedjax.autotune import _phases, _select

FAST = dict(rounds=1, budget_s=3.0)


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=h.DN)


def _operands(rng, size=6):
  return (jnp.asarray(rng.normal(size=(2, size, size, 4)).astype(np.float32)),
          jnp.asarray(rng.normal(size=(3, 3, 4, 4)).astype(np.float32)))


def _trace(x, w):
  """Traces `_conv` through the pass once; returns {'kernel (why)': n}."""
  counts = {}
  jax.jit(_select.select_kernels(_conv, **FAST, on_report=lambda r: counts.update(r.counts())))(x, w)
  return counts


def test_phase_of_follows_the_tuning_range():
  assert [_tuning.phase_of(s, (2, 4)) for s in (0, 1, 2, 3, 4, 9)] == [
      "observe", "observe", "tune", "tune", "apply", "apply"]
  assert _tuning.phase_of(None, (2, 4)) == "tune"  # no step counter: tune at once


def test_observe_tune_apply(tmp_path, rng):
  x, w = _operands(rng)
  x2, w2 = _operands(rng, size=7)
  with h.isolated_selection(tmp_path, kernel={"tuning_range": [1, 3]}), \
      h.registered("t_transposed"):
    assert _phases.step() == 0 and _tuning.default_session().phase() == "observe"
    assert _trace(x, w) == {"conv xla (observe)": 1}
    assert _phases.stats().buckets_tuned == 0
    assert _phases.step() == 1 and _tuning.default_session().phase() == "tune"
    tuned = _trace(x, w)
    assert list(tuned)[0].endswith("(tuned)")
    assert _phases.step() == 2
    assert list(_trace(x, w))[0].endswith("(hit)")
    assert _phases.step() == 3 and _tuning.default_session().phase() == "apply"
    # A bucket tuned in the window is applied; a new one falls back to xla untuned.
    assert list(_trace(x, w)) == [list(tuned)[0].replace("(tuned)", "(hit)")]
    assert _trace(x2, w2) == {"conv xla (miss)": 1}
    stats = _phases.stats()
  assert (stats.hits, stats.misses, stats.buckets_tuned) == (2, 2, 1)
  assert [(s.step, s.phase, s.hits, s.misses) for s in stats.per_step] == [
      (1, "tune", 0, 1), (2, "tune", 1, 0), (3, "apply", 1, 1)]
  assert [s.step for s in stats.window()] == [1, 2]
  assert stats.window()[0].tuning_s > 0 and stats.tuning_s == stats.window()[0].tuning_s
  assert stats.window()[1].hit_rate == 1.0 and stats.hit_rate == 0.5


def test_without_a_step_counter_buckets_are_tuned_on_first_trace(tmp_path, rng):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path, kernel={"tuning_range": [5, 10]}), \
      h.registered("t_transposed"):
    assert _tuning.default_session().current_step() is None
    assert list(_trace(x, w))[0].endswith("(tuned)")
    stats = _phases.stats()
  assert stats.step is None and stats.phase == "tune"
  assert (stats.hits, stats.misses, stats.buckets_tuned) == (0, 1, 1)
  assert stats.per_step[0].step is None


def test_step_logs_hit_rate_in_the_window(tmp_path, rng, caplog):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path, kernel={"tuning_range": [0, 2]}), \
      h.registered("t_transposed"):
    with caplog.at_level(logging.INFO, logger="tunedjax.autotune"):
      _phases.step()
      _trace(x, w)
      _phases.step()
      _trace(x, w)
      _phases.step()
  lines = [r.getMessage() for r in caplog.records if "cache hit rate" in r.getMessage()]
  assert len(lines) == 2
  assert "step 0: 1 lookups, 0 hits, 1 misses, cache hit rate 0.0%" in lines[0]
  assert "step 1: 1 lookups, 1 hits, 0 misses, cache hit rate 100.0%" in lines[1]
  assert any("enters the apply phase" in r.getMessage() for r in caplog.records)


def test_jit_option_retraces_when_leaving_observe(tmp_path, rng):
  x, w = _operands(rng)
  traces = []
  with h.isolated_selection(tmp_path, kernel={"tuning_range": [1, 2]}), \
      h.registered("t_transposed"):
    f = _select.select_kernels(_conv, jit=True, **FAST,
                               on_report=lambda r: traces.append(dict(r.counts())))
    want = _conv(x, w)
    for _ in range(4):
      _phases.step()
      np.testing.assert_allclose(f(x, w), want, rtol=1e-5, atol=1e-5)
  # step 0 observe (trace 1), step 1 tune (trace 2), steps 2-3 apply: no retrace.
  assert len(traces) == 2
  assert traces[0] == {"conv xla (observe)": 1}
  assert list(traces[1])[0].endswith("(tuned)")


def test_stats_and_reset():
  _phases.reset()
  _tuning.default_session().record(hit=True)
  _tuning.default_session().record(hit=False, tuning_s=0.5, tuned=True)
  s = _phases.stats()
  assert (s.hits, s.misses, s.buckets_tuned, s.hit_rate) == (1, 1, 1, 0.5)
  assert s.tuning_s == pytest.approx(0.5)
  _phases.reset()
  assert _phases.stats().per_step == () and _tuning.default_session().current_step() is None
