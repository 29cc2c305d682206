"""The garbage collector paused while `tunedjax.jit` traces (`rewrite._gc`)."""

from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax.rewrite import _gc


@pytest.fixture(autouse=True)
def _collector_on(monkeypatch):
  """Each test starts with the collector on and leaves it as it found it.

  The pause's time limit is raised, so that a slow machine cannot end a pause
  a test is looking at (the limit itself is tested with its own).
  """
  monkeypatch.setattr(_gc, "LIMIT_S", 60.0)
  was = gc.isenabled()
  gc.enable()
  yield
  assert _gc._depth == 0  # every block closed
  if was:  # as found, either way (a test may have turned it off as a user would)
    gc.enable()
  else:
    gc.disable()


def test_paused_turns_the_collector_off_and_back_on():
  with _gc.paused():
    assert not gc.isenabled()
    with _gc.paused():  # nested: still off, and on only after the outer block
      assert not gc.isenabled()
    assert not gc.isenabled()
  assert gc.isenabled()


def test_paused_leaves_a_users_gc_disable_in_force():
  gc.disable()
  with _gc.paused():
    assert not gc.isenabled()
  assert not gc.isenabled()


def test_paused_turns_the_collector_back_on_after_an_error():
  with pytest.raises(ValueError), _gc.paused():
    raise ValueError("in the trace")
  assert gc.isenabled()


def test_paused_gives_the_collector_back_at_the_time_limit():
  with _gc.paused(limit_s=0.05):
    assert not gc.isenabled()
    _gc._timer.join(5.0)  # the limit passes (no sleep: wait for the timer thread itself)
    assert gc.isenabled()
  assert gc.isenabled()


def test_a_late_timer_leaves_a_newer_pause_alone():
  with _gc.paused():
    old = _gc._pause
  with _gc.paused():
    _gc._expire(old)  # the first pause's timer, had it fired late
    assert not gc.isenabled()
  assert gc.isenabled()


def test_threads_nest_the_pause():
  inside, release = threading.Event(), threading.Event()

  def other():
    with _gc.paused():
      inside.set()
      release.wait(5.0)

  t = threading.Thread(target=other)
  with _gc.paused():
    t.start()
    inside.wait(5.0)
  assert not gc.isenabled()  # the other thread's block is still open
  release.set()
  t.join(5.0)
  assert gc.isenabled()


@pytest.mark.parametrize("config", [
    {"layout": {"enable": True}},
    {"layout": {"enable": True}, "kernel": {"enable": True, "hints": {"conv": "im2col"}}},
])
def test_tj_jit_traces_with_the_collector_paused(tmp_path, config):
  seen = []

  def f(x, w):
    seen.append(gc.isenabled())  # runs while jit traces
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return jnp.sum(jnp.tanh(y) ** 2)

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 6, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 3, 3, 3)), jnp.float32)
  with tj.config_context({**config, "cache": {"dir": str(tmp_path)}}):
    step = tj.jit(jax.value_and_grad(f, argnums=(0, 1)))
    (value, grads) = step(x, w)
  assert seen == [False]
  assert gc.isenabled()
  want_value, want_grads = jax.value_and_grad(f, argnums=(0, 1))(x, w)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for g, want in zip(grads, want_grads):
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()))
