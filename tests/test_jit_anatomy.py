"""A first call's anatomy: `f.report().last.first_call`, seconds per stage.

The stage clock (`tunedjax._tuning._anatomy`) on a fake clock: nested stages
are subtracted from their parent, JAX's compile events land where they ran,
and a record belongs to one thread. Then through `tunedjax.jit`: the stages add
up to the call's wall time measured around it, every pass and the kernel
tuner appear, later calls add nothing, traces that are not calls record
nothing, two threads tracing at once keep their own records, and the Trainer's
history and the demo's report carry it.
"""

from __future__ import annotations

import contextvars
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import tunedjax as tj
from tunedjax import _tuning
from tunedjax._tuning import _anatomy
from tunedjax.autotune import TuningSession
from tunedjax.demo import _report as demo_report


# --- the stage clock, on a fake clock ------------------------------------------------


class FakeClock:

  def __init__(self) -> None:
    self.now = 0.0

  def __call__(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
  fake = FakeClock()
  monkeypatch.setattr(_anatomy, "_clock", fake)
  return fake


def _record(body, pending=None, key="sig"):
  """Runs `body` as a traced function of a recorded first call; returns its record."""
  pending = pending or _anatomy.Pending()

  def traced():
    body()
    _anatomy.label(pending, key)
    return np.ones(2)

  out = _anatomy.recording(traced, pending)()
  return pending, _anatomy.finish(pending, out)


def test_a_nested_stage_is_subtracted_from_the_one_around_it(clock):
  def body():
    with _tuning.first_call_stage("trace"):
      clock.advance(1.0)
      with _tuning.first_call_stage("tune:time"):
        clock.advance(2.0)
        with _tuning.first_call_stage("tune:compile"):
          clock.advance(4.0)
        clock.advance(0.5)
      clock.advance(0.25)
    clock.advance(8.0)  # outside every stage: "other"

  pending, (key, first) = _record(body)
  assert key == "sig" and pending.count == 0
  assert dict(first.stages) == {"trace": 1.25, "tune:compile": 4.0, "tune:time": 2.5,
                                "other": 8.0}
  assert first.total_s == 15.75 == pytest.approx(sum(first.stages.values()))
  assert list(first.stages) == ["trace", "tune:compile", "tune:time", "other"]  # ORDER
  assert first.share("tune:compile") == pytest.approx(4.0 / 15.75)
  assert first.as_dict() == {"total_s": 15.75, "stages": dict(first.stages)}
  text = str(first)
  assert text.splitlines()[0] == "first call: 15.750 s"
  assert "tune:compile" in text and "25.4%" in text


def test_compile_events_count_where_they_ran_and_open_the_first_run(clock):
  def body():
    with _tuning.first_call_stage("trace"):  # an eager op in the user's code: its own
      clock.advance(1.0)
      _anatomy._current.get().compiled(True, 0.5)
    with _tuning.first_call_stage("tune:time"):  # the tuner's eager ops: tune:compile
      clock.advance(3.0)
      _anatomy._current.get().compiled(True, 1.0)

  pending = _anatomy.Pending()

  def traced():
    body()
    _anatomy.label(pending, "k")
    return np.ones(2)

  out = _anatomy.recording(traced, pending)()
  rec = _anatomy._current.get()
  clock.advance(0.25)                # JAX's own work after the trace: "other"
  clock.advance(2.0)
  rec.compiled(False, 0.75)          # lowering the step
  rec.compiled(True, 1.25)           # compiling it: the first run starts here
  clock.advance(0.5)
  with _tuning.first_call_stage("check"):
    clock.advance(0.125)
  _, first = _anatomy.finish(pending, out)
  assert dict(first.stages) == pytest.approx({
      "trace": 1.0, "tune:compile": 1.0, "tune:time": 2.0, "compile": 2.0, "check": 0.125,
      "first_run": 0.5, "other": 0.25})
  assert first.total_s == pytest.approx(6.875)


def test_a_record_belongs_to_its_thread_and_context(clock):
  pending = _anatomy.Pending()
  seen = {}

  def body():
    rec = _anatomy._current.get()
    context = contextvars.copy_context()  # the recorder, shared with another thread

    def elsewhere():
      with _tuning.first_call_stage("trace"):
        clock.advance(5.0)
      seen["same"] = _anatomy._current.get() is rec
      rec_other = _anatomy._current.get()
      seen["mine"] = rec_other.mine()

    thread = threading.Thread(target=context.run, args=(elsewhere,))
    thread.start()
    thread.join()

  _, (_, first) = _record(body, pending)
  assert seen == {"same": True, "mine": False}
  assert "trace" not in first.stages  # the other thread's stage went nowhere


def test_a_nested_trace_or_one_that_is_not_a_call_begins_no_record(clock):
  outer, inner = _anatomy.Pending(), _anatomy.Pending()
  counts = []

  def body():  # another function's first trace inside this one's
    inner_out = _anatomy.recording(lambda: np.ones(1), inner)()
    counts.append(inner.count)
    assert _anatomy.finish(inner, inner_out) is None

  _, done = _record(body, outer)
  assert counts == [0] and done is not None
  with _anatomy.not_a_call():
    out = _anatomy.recording(lambda: np.ones(1), inner)()
    assert inner.count == 0 and _anatomy.finish(inner, out) is None
  assert _anatomy._current.get() is None


def test_a_call_that_raises_leaves_no_record_open(clock):
  pending = _anatomy.Pending()

  def failing():
    raise ValueError("bad input")

  with pytest.raises(ValueError):
    _anatomy.recording(failing, pending)()
  assert pending.count == 0 and _anatomy._current.get() is None
  out = _anatomy.recording(lambda: np.ones(1), pending)()  # traced, then compiling raised
  _anatomy.drop(pending)
  assert pending.count == 0 and _anatomy.finish(pending, out) is None


def test_a_stage_outside_a_first_call_costs_one_context_read():
  assert _anatomy._current.get() is None
  with _tuning.first_call_stage("tune:time"):
    pass
  assert _anatomy._current.get() is None


# --- through tunedjax.jit --------------------------------------------------------------


def _conv_net(rng):
  params = [jnp.asarray(rng.normal(size=(8, 3, 3, 3)) * 0.3, jnp.float32),
            jnp.asarray(rng.normal(size=(8, 8, 3, 3)) * 0.3, jnp.float32)]
  x = jnp.asarray(rng.normal(size=(4, 3, 16, 16)), jnp.float32)

  def loss(params, x):
    for w in params:
      x = jax.nn.relu(jax.lax.conv_general_dilated(
          x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")))
    return jnp.mean(x ** 2)

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, [p - 0.1 * g for p, g in zip(params, grads)]

  return step, params, x


EVERY_PASS = {"mixed_precision": {"enable": True}, "layout": {"enable": True},
              "kernel": {"enable": True}}


def _timed_call(f, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(f(*args))
  return out, time.perf_counter() - start


@pytest.mark.serial  # within 5% of a wall time
def test_every_stage_of_a_tuned_first_call_adds_up_to_its_wall_time(tmp_path, rng):
  step, params, x = _conv_net(rng)
  f = tj.jit(step, session=TuningSession())  # no step yet: tunes at once
  with tj.config_context({**EVERY_PASS, "cache": {"dir": str(tmp_path)}}):
    out, wall = _timed_call(f, params, x)
    first = f.report(memory=False).last.first_call
    assert first is not None
    stages = first.stages
    for name in ("trace", "pass:mixed_precision", "pass:layout", "pass:kernel_selection",
                 "tune:compile", "tune:time", "compile", "first_run", "other"):
      assert name in stages, (name, stages)
    assert stages["tune:compile"] > 0 and stages["tune:time"] > 0 and stages["compile"] > 0
    assert all(v >= 0 for v in stages.values())
    assert sum(stages.values()) == pytest.approx(first.total_s)
    # Measured around the call, independently: within 5%.
    assert abs(first.total_s - wall) <= 0.05 * wall, (first.total_s, wall)
    assert first.total_s <= wall
    assert list(stages) == sorted(stages, key=_tuning.FIRST_CALL_STAGES.index)
    text = str(f.report(memory=False))
    assert "first call:" in text and "tune:compile" in text

    # Later calls add no record and do not replace this one.
    again, _ = _timed_call(f, params, x)
    assert f.report(memory=False).last.first_call is first and len(f.report(memory=False)) == 1
    assert f._book.firsts.count == 0
  np.testing.assert_allclose(np.asarray(again[0]), np.asarray(out[0]), rtol=1e-6)


@pytest.mark.serial  # within 5% of a wall time
def test_an_untuned_first_call_adds_up_too_and_a_new_shape_gets_its_own(rng):
  step, params, x = _conv_net(rng)
  f = tj.jit(step)
  with tj.config_context({"kernel": {"enable": False}, "layout": {"enable": False}}):
    _, wall = _timed_call(f, params, x)
    first = f.report(memory=False).last.first_call
    assert abs(first.total_s - wall) <= 0.05 * wall, (first.total_s, wall)
    assert set(first.stages) == {"trace", "compile", "first_run", "other"}
    _timed_call(f, params, x[:2])  # a new signature: a first call of its own
    report = f.report(memory=False)
    assert len(report) == 2 and report[1].first_call is not None
    assert report[1].first_call is not report[0].first_call


def test_traces_that_are_not_first_calls_record_nothing():
  f = tj.jit(lambda x: jnp.sin(x) * 2)
  x = jnp.arange(3.0)
  f.lower(x)  # traced, never called: no first call to measure
  assert f.report(memory=False).last.first_call is None
  f(x)  # jit's trace cache: this call does not trace again
  assert f.report(memory=False).last.first_call is None
  g = tj.jit(lambda x: jnp.cos(x).sum())
  jax.grad(g)(x)  # traced under another transformation: nothing ran
  assert g.report(memory=False).last.first_call is None and g._book.firsts.count == 0
  h = tj.jit(lambda x: jnp.tanh(x))

  @tj.jit
  def outer(x):
    return h(x) + 1  # inside another first call: its time is the outer's

  outer(x)
  assert h.report(memory=False).last.first_call is None
  assert outer.report(memory=False).last.first_call is not None


def test_two_threads_tracing_at_once_keep_their_own_records():
  both_tracing = threading.Barrier(2, timeout=60)

  def fn(x):
    both_tracing.wait()  # each thread's trace waits for the other's: they overlap
    return jnp.sin(x) * 3

  f = tj.jit(fn)
  results, errors = {}, []

  def call(n):
    try:
      results[n] = _timed_call(f, jnp.ones(n))[1]
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=call, args=(n,)) for n in (2, 5)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  by_signature = {r.signature: r.first_call for r in f.report(memory=False)}
  assert set(by_signature) == {"f32[2]", "f32[5]"}
  for n, wall in results.items():
    first = by_signature[f"f32[{n}]"]
    assert first is not None and "compile" in first.stages
    assert first.total_s <= wall
  assert f._book.firsts.count == 0


class _Net(nnx.Module):

  def __init__(self):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.conv(x).mean(axis=(1, 2, 3))


def _loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_the_trainer_history_carries_the_first_call(rng):
  data = {"x": rng.normal(size=(32, 8, 8, 3)).astype(np.float32),
          "y": rng.normal(size=(32,)).astype(np.float32)}
  trainer = tj.Trainer(_Net(), optax.sgd(0.1), _loss, autotune=False, progress=False)
  history = trainer.fit(data, batch_size=16, epochs=1)
  first = history.tuning["first_call"]
  assert set(first) == {"total_s", "stages"} and first["total_s"] > 0
  assert {"trace", "compile", "first_run"} <= set(first["stages"])
  assert sum(first["stages"].values()) == pytest.approx(first["total_s"])
  calls = history.tuning["first_calls"]
  assert calls and calls[-1]["signature"] and calls[-1]["stages"] == first["stages"]


def test_the_demo_report_shows_each_run_s_first_call():
  class Run:
    def __init__(self, first):
      self.first_call = first

  base = Run({"total_s": 1.0, "stages": {"trace": 0.2, "compile": 0.7, "other": 0.1}})
  tuned = Run({"total_s": 3.0, "stages": {"trace": 0.2, "tune:compile": 1.5,
                                          "compile": 1.2, "other": 0.1}})
  rows = demo_report.first_call_rows(base, tuned)
  assert rows == [("trace", "0.20 s", "0.20 s"), ("tune:compile", "-", "1.50 s"),
                  ("compile", "0.70 s", "1.20 s"), ("other", "0.10 s", "0.10 s"),
                  ("total", "1.00 s", "3.00 s")]
  assert demo_report.first_call_rows(Run(None), Run(None)) == []
