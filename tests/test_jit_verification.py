"""`tunedjax.jit` with a horizon: the whole-program check across its calls, and
programs without kernel sites compiled once whatever the phase.

Deterministic: the tuner's timer is faked, and the check's clock is moved
only by `jax.debug.callback`s inside the program (see
tests/trainer/test_verification.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import _tuning
from tunedjax.autotune import _registry, _verify
from tests.autotune.selection_helpers import StepClock

SLOW = "t_slow_in_program"




@pytest.fixture
def clock(monkeypatch, tmp_path):
  """A fake clock; `SLOW`, 10x faster than xla alone and 0.05 s slower in the program."""
  fake = StepClock()

  def slow(lhs, rhs, spec):
    jax.debug.callback(lambda: fake.advance(0.05))
    return _registry.get_kernel("conv", "xla").fn(lhs, rhs, spec)

  _registry.register_kernel("conv", SLOW, slow, applicable=lambda spec, p: True, replace=True)
  monkeypatch.setattr(_tuning, "time_interleaved", lambda runners, rounds=5, **kw: {
      n: [0.001 if n == SLOW else 0.010] * max(rounds, 1) for n in runners})
  monkeypatch.setattr(_verify, "_clock", fake)
  # payback off: whether tuning pays back depends on real compile times.
  with tj.config_context({"kernel": {"enable": True, "payback": False},
                          "layout": {"enable": False},
                          "cache": {"dir": str(tmp_path / "cache")}}):
    yield fake
  _registry.unregister_kernel("conv", SLOW)


def _conv_fn(clock):
  def f(x, w):
    jax.debug.callback(lambda: clock.advance(0.1))
    return jax.nn.relu(jax.lax.conv(x, w, (1, 1), "SAME")).sum()
  return f


def _args():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=(2, 3, 6, 6)), jnp.float32),
          jnp.asarray(rng.normal(size=(4, 3, 3, 3)), jnp.float32))


def test_a_horizon_makes_jit_check_the_tuned_program_across_its_calls(clock):
  session = _tuning.TuningSession(horizon=100)
  f = tj.jit(_conv_fn(clock), session=session)
  x, w = _args()
  reference = float(jax.jit(lambda x, w: jax.nn.relu(jax.lax.conv(x, w, (1, 1), "SAME")).sum())(
      x, w))
  for _ in range(30):
    assert float(f(x, w)) == pytest.approx(reference, rel=1e-5)
  found = f.verification()
  assert found["outcome"] == _verify.FOUND_LOSERS and found["tuned_over_untuned"] == 1.5
  assert [(d["kernel"], d["how"]) for d in found["lost"]] == [(SLOW, "alone")]
  start = clock.now
  f(x, w)  # the kept program: the untuned one
  assert clock.now - start == pytest.approx(0.1)
  # A new jit of the same function and arguments reads the verdict.
  g = tj.jit(_conv_fn(clock), session=_tuning.TuningSession(horizon=100))
  g(x, w)
  assert g.report(memory=False).last.kernels == {"conv xla (loses in context)": 1}
  assert g.verification() is None  # nothing left to check: every site on its default


@pytest.mark.parametrize("lowered_first", [False, True])
def test_the_check_s_compile_cost_is_the_tuned_program_s_first_call(clock, lowered_first):
  """Timed from the trace's start when the call traced it, from the call's start when
  `lower` traced it earlier: the time in between is not compiling."""
  f = tj.jit(_conv_fn(clock), session=_tuning.TuningSession(horizon=100))
  x, w = _args()
  if lowered_first:
    f.lower(x, w)
    clock.advance(1000.0)
  for _ in range(30):
    f(x, w)
  found = f.verification()
  # The first call: tracing (the tuner's runs of the slow kernel move the faked clock
  # 0.05 s each), compiling and one run (0.15 s), less the tuning's real seconds: under
  # a second on the faked clock, and never the 1000 s between `lower` and the call.
  assert 0.0 <= found["compile_s"] < 1.0
  assert found["outcome"] == _verify.FOUND_LOSERS


def test_without_a_horizon_or_with_verify_off_nothing_is_checked(clock):
  x, w = _args()
  plain = tj.jit(_conv_fn(clock), session=_tuning.TuningSession())
  off = tj.jit(_conv_fn(clock), session=_tuning.TuningSession(horizon=100), verify=False)
  for _ in range(3):
    plain(x, w)
    off(x, w)
  assert plain.verification()["outcome"] == "not checked: no horizon"
  assert off.verification() is None
  assert any(SLOW in k for k in off.report(memory=False).last.kernels)


def test_jit_verify_must_be_a_bool():
  with pytest.raises(TypeError, match="verify"):
    tj.jit(lambda x: x, verify="yes")


# -- no kernel site: one program for every phase ---------------------------------------


def test_a_program_without_kernel_sites_is_traced_once_across_phases(tmp_path):
  traces = []

  def mlp(x, w):
    traces.append(x.shape)
    return jnp.tanh(x @ w).sum()

  session = _tuning.TuningSession()
  f = tj.jit(mlp, session=session)
  x, w = jnp.ones((4, 3)), jnp.ones((3, 2))
  with tj.config_context({"kernel": {"enable": True, "tuning_range": [1, 3]},
                          "cache": {"dir": str(tmp_path)}}):
    for _ in range(5):
      session.step()
      f(x, w)
    assert session.phase() == "apply" and traces == [(4, 3)]


def test_a_site_found_later_in_a_shared_program_is_tuned_in_its_own(tmp_path, clock):
  traces = []

  def f(x, w):
    traces.append(x.ndim)
    if x.ndim == 4:
      return jax.lax.conv(x, w, (1, 1), "SAME").sum()
    return (x * 2).sum()

  session = _tuning.TuningSession()
  g = tj.jit(f, session=session)
  x4, w = _args()
  with tj.config_context({"kernel": {"tuning_range": [1, 3]}}):
    session.step()
    g(jnp.ones(3), w)  # observe: no site
    session.step()
    g(jnp.ones(3), w)  # tune: the same program, not traced again
    assert traces == [1]
    out = float(g(x4, w))  # a site: traced in the shared program, then in its own
    assert float(g(x4, w)) == pytest.approx(out, rel=1e-5)
  last = g.report(memory=False).last.kernels
  assert any(SLOW in k for k in last), last


def test_calls_with_the_check_paused_run_the_tuned_program_untimed(clock):
  f = tj.jit(_conv_fn(clock), session=_tuning.TuningSession(horizon=100))
  x, w = _args()
  f(x, w)  # traces and tunes; the check starts with the next call
  with f.checks_paused():
    for _ in range(4):
      start = clock.now
      f(x, w)
      assert clock.now - start == pytest.approx(0.15)  # the tuned program
  assert f.verification()["outcome"] == "checking" and f.verification()["runs"] == 0
  for _ in range(30):
    f(x, w)
  assert f.verification()["outcome"] == _verify.FOUND_LOSERS


def test_a_warm_cache_compiles_one_program_for_the_observe_and_tune_phases(clock):
  x, w = _args()
  with tj.config_context({"kernel": {"tuning_range": [1, 3]}}):
    cold = _tuning.TuningSession(horizon=100)
    f = tj.jit(_conv_fn(clock), session=cold)
    for _ in range(3):
      cold.step()
      f(x, w)  # observe (xla: the untuned program), then tuned: two programs
    assert len(f.report(memory=False)) == 2
    for _ in range(30):
      cold.step()
      f(x, w)  # the check: SLOW loses in context, a verdict for this program
    assert f.verification()["outcome"] == _verify.FOUND_LOSERS
    warm = _tuning.TuningSession(horizon=100)
    g = tj.jit(_conv_fn(clock), session=warm)
    for _ in range(3):
      warm.step()
      g(x, w)
  # A program checked before: its observe phase found every final choice in
  # the cache (SLOW's verdict included), and nothing is checked again.
  (only,) = g.report(memory=False)
  assert only.kernels == {"conv xla (loses in context)": 1}, only.kernels
  assert g.verification() is None  # no decision left to check


def test_a_program_seen_for_the_first_time_observes_on_defaults(clock):
  x, w = _args()
  with tj.config_context({"kernel": {"tuning_range": [1, 3]}}):
    first = _tuning.TuningSession()
    f = tj.jit(_conv_fn(clock), session=first)
    for _ in range(3):
      first.step()
      f(x, w)
    again = _tuning.TuningSession()  # no check ran (no horizon): no verdict entry
    g = tj.jit(_conv_fn(clock), session=again)
    again.step()
    g(x, w)
  assert g.report(memory=False).last.kernels == {"conv xla (observe)": 1}
