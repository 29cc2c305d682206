"""Kernel tuning that pays for itself: the tuning horizon, "cannot pay back", the budget."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.autotune import selection_helpers as h
from tunedjax import _tuning
from tunedjax._errors import AutotuneError
from tunedjax._tuning import _cache
from tunedjax.autotune import _explain, _payback, _registry, _report, _select, _tuner
from tunedjax.autotune._predict import Estimate, Prediction
from tunedjax.ops.conv._spec import ConvSpec

FAST = {"rounds": 1, "budget_s": 3.0}


def _spec() -> ConvSpec:
  return ConvSpec.from_arrays(np.ones((2, 9, 9, 4), np.float32), np.ones((3, 3, 4, 6), np.float32),
                              padding="SAME", dimension_numbers=h.DN)


def _candidates(spec, *names):
  from tunedjax.autotune import _registry  # pylint: disable=import-outside-toplevel
  return [k for k in _registry.applicable_kernels(spec, "cpu") if k.name in ("xla", *names)]


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=h.DN)


class FakeClock:
  """The tuner's clock; `_compile_all` advances it by `compile_s` per function
  compiled, and records that as each one's compile time."""

  def __init__(self, monkeypatch, compile_s: float):
    self.now = 0.0
    self.compiled: list[list[str]] = []
    real = _tuner._compile_all

    def compile_all(functions, args, times=None):
      self.compiled.append(sorted(functions))
      self.now += compile_s * len(functions)
      out = real(functions, args, times)
      if times is not None:
        times.update({name: compile_s for name in functions})
      return out

    monkeypatch.setattr(_tuner, "_clock", lambda: self.now)
    monkeypatch.setattr(_tuner, "_compile_all", compile_all)


# -- the decision, on synthetic timings -------------------------------------------


def test_payback_compares_the_most_saved_with_the_expected_cost():
  p = _tuner.Payback(horizon=48, sites=2, cost_factor=1.5)
  assert p.most_saved(0.01) == pytest.approx(0.96)  # 10 ms x 2 sites x 48 runs
  assert p.expected_cost(compile_s=0.1, call_s=0.01, candidates=4) == pytest.approx(0.66)
  assert p.pays(0.01, 0.66) and not p.pays(0.005, 0.66)
  assert not _tuner.Payback(horizon=1).pays(0.01, 0.66)
  for bad in ({"horizon": 0}, {"horizon": True}, {"horizon": 3, "sites": 0},
              {"horizon": 3, "cost_factor": 0.0}, {"horizon": 2.5}):
    with pytest.raises(AutotuneError, match="Payback"):
      _tuner.Payback(**bad)


@pytest.mark.parametrize("horizon, kept", [(10, True), (100, False)])
def test_a_bucket_is_tuned_only_when_it_can_pay_back(monkeypatch, horizon, kept):
  # xla's first call takes 2 ms and compiling it 50 ms; one other candidate:
  # tuning it is expected to cost 52 ms. 10 runs save at most 20 ms (kept);
  # 100 runs save up to 200 ms (tuned).
  spec = _spec()
  clock = FakeClock(monkeypatch, compile_s=0.05)
  monkeypatch.setattr(_tuning, "time_interleaved",
                      lambda runners, rounds=5, **kw: {n: [0.002 if n == "xla" else 0.001] * rounds
                                                       for n in runners})
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=2),
                                payback=_tuner.Payback(horizon=horizon))
  assert result.kept is kept
  record = result.payback
  assert record["horizon"] == horizon and record["sites"] == 1 and record["kept"] is kept
  assert record["default_s"] == pytest.approx(0.002)
  assert record["cost_s"] == pytest.approx(0.052) == record["estimate_s"]
  if kept:
    assert result.winner == "xla" and result.reason.startswith(_tuner.CANNOT_PAY_BACK)
    assert "0.02 s at most" in result.reason and "0.052 s" in result.reason
    assert clock.compiled == [["xla"]]  # the other candidate was never compiled
    assert set(result.timings) == {"xla"}
  else:
    assert result.winner == "t_transposed" and result.ratios["t_transposed"] == pytest.approx(0.5)
    assert clock.compiled == [["xla"], ["t_transposed"]]


@pytest.mark.parametrize("low, kept", [(0.1, False), (0.7, True)])
def test_a_prediction_bounds_what_tuning_could_save(monkeypatch, low, kept):
  # xla's first call takes 2 ms: 20 ms within 10 runs. The candidate is predicted
  # to compile in 5 ms: tuning it is expected to cost 7 ms. Measured to take at best
  # 0.1x xla's time, it could save 18 ms (tuned); at best 0.7x, 6 ms (kept, said).
  spec = _spec()
  FakeClock(monkeypatch, compile_s=0.05)
  monkeypatch.setattr(_tuning, "time_interleaved",
                      lambda runners, rounds=5, **kw: {n: [0.002 if n == "xla" else 0.001] * rounds
                                                       for n in runners})
  prediction = Prediction("xla", {"t_transposed": Estimate(low, 0.0, compile_s=0.005)})
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=2),
                                payback=_tuner.Payback(horizon=10), prediction=prediction)
  assert result.kept is kept
  record = result.payback
  assert record["estimate_s"] == pytest.approx(0.007)  # what tuning costs, unscaled
  assert record["cost_s"] == pytest.approx(0.007 / (1 - low))  # xla's time needed
  if kept:
    assert "0.006 s at most to save (the best predicted at best 0.7x xla's time)" in result.reason
    assert _payback.still_cannot_pay_back(result.to_value(), horizon=10)
    assert not _payback.still_cannot_pay_back(result.to_value(), horizon=20)


def test_a_short_first_call_is_confirmed_before_tuning(monkeypatch):
  # xla's first call took 50 ms, mostly one-time costs; its second 1 ms. With
  # 2 runs the first would pay back tuning (100 ms >= 52 ms): the second decides.
  spec = _spec()
  FakeClock(monkeypatch, compile_s=0.05)
  calls = []

  def fake_timer(runners, rounds=5, **kw):
    calls.append(sorted(runners))
    return {n: [0.05 if len(calls) == 1 else 0.001] * rounds for n in runners}

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                payback=_tuner.Payback(horizon=2))
  assert calls == [["xla"], ["xla"]] and result.kept
  assert result.payback["default_s"] == pytest.approx(0.001)
  assert list(result.timings) == ["xla"] and list(result.timings["xla"]) == [0.05, 0.001]


def test_a_first_call_that_pays_back_even_if_mostly_warm_up_is_not_confirmed(monkeypatch):
  # xla's first call took 50 ms. With 100 runs even a quarter of it (12.5 ms)
  # saves far more than tuning costs (~0.1 s): a second call could not change
  # the decision, so none is made.
  spec = _spec()
  FakeClock(monkeypatch, compile_s=0.05)
  calls = []

  def fake_timer(runners, rounds=5, **kw):
    calls.append(sorted(runners))
    return {n: [0.05 if n == "xla" else 0.001] * rounds for n in runners}

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=1),
                                payback=_tuner.Payback(horizon=100))
  # xla once (its first call), then the candidate's screening call: no second xla call.
  assert calls[:2] == [["xla"], ["t_transposed"]] and not result.kept
  assert result.payback["default_s"] == pytest.approx(0.05)
  assert result.winner == "t_transposed"


def test_without_a_horizon_every_candidate_compiles_at_once(monkeypatch):
  spec = _spec()
  clock = FakeClock(monkeypatch, compile_s=0.05)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=1))
  assert clock.compiled == [["t_transposed", "xla"]] and result.payback == {}
  assert "payback" not in result.to_value()


def test_a_cached_decision_holds_for_a_shorter_horizon_and_not_a_longer_one():
  value = {"winner": "xla", "payback": {"horizon": 48, "sites": 1, "default_s": 0.002,
                                        "cost_s": 0.5, "estimate_s": 0.25, "decided_s": 0.1,
                                        "kept": True}}
  holds = lambda horizon, sites=1: _payback.still_cannot_pay_back(value, horizon=horizon,
                                                                sites=sites)
  assert holds(48) and holds(1) and holds(200)  # 0.4 s < 0.5 s
  assert not holds(250) and not holds(None)  # 0.5 s: pays; unbounded: always tune
  assert not holds(48, sites=6)  # a sixth site of the bucket in the program: pays
  tuned = {**value, "payback": {**value["payback"], "kept": False}}
  assert not _payback.still_cannot_pay_back(tuned, horizon=1)
  assert not _payback.still_cannot_pay_back({"winner": "xla"}, horizon=1)  # an older entry


# -- the budget bounds timing, not compiles ----------------------------------------


def test_slow_compiles_do_not_spend_the_timing_budget(monkeypatch):
  # Compiling took 100 s of a 1 s budget (a loaded machine): every candidate
  # is still checked and timed. Counting compiles, both were "skipped" before.
  spec = _spec()
  FakeClock(monkeypatch, compile_s=50.0)
  with h.registered("t_transposed", "t_wrong"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed", "t_wrong"),
                                options=_tuner.TuneOptions(rounds=2, budget_s=1.0))
  assert result.skipped == ()
  assert set(result.timings) == {"xla", "t_transposed"} and set(result.rejected) == {"t_wrong"}


# -- cache values -------------------------------------------------------------------


def test_old_cache_values_without_payback_still_load():
  old = {"winner": "xla", "reason": "best other candidate im2col took 1.20x xla's time",
         "timings": {"xla": [0.001, 0.001], "im2col": [0.0012, 0.0012]},
         "ratios": {"im2col": 1.2}, "errors": {}, "rejected": {}, "skipped": [],
         "measured_at": "2026-11-20T10:00:00+00:00", "tuning_s": 0.3, "temp_bytes": {}}
  _registry.validate_cache_value(old, "conv")
  result = _tuner.TuneResult.from_value(old)
  assert result.payback == {} and not result.kept and result.to_value() == old


def test_bad_payback_records_are_rejected():
  good = {"horizon": 4, "sites": 1, "default_s": 0.001, "cost_s": 0.2, "estimate_s": 0.2,
          "decided_s": 0.05, "kept": True}
  _registry.validate_cache_value({"winner": "xla", "payback": good}, "conv")
  for bad in ([1], {**good, "horizon": 0}, {**good, "kept": "yes"}, {**good, "cost_s": -1},
              {k: v for k, v in good.items() if k != "sites"}, {**good, "horizon": True}):
    with pytest.raises((TypeError, ValueError), match="payback"):
      _registry.validate_cache_value({"winner": "xla", "payback": bad}, "conv")


# -- the session's horizon ------------------------------------------------------------


def test_session_horizon_is_validated():
  assert _tuning.TuningSession().horizon is None
  s = _tuning.TuningSession(horizon=12)
  assert s.horizon == 12
  s.horizon = None
  assert s.horizon is None
  for bad in (0, -3, 2.0, True, "10"):
    with pytest.raises(ValueError, match=r"horizon must be None \(unbounded\) or an int >= 1.*got"):
      _tuning.TuningSession(horizon=bad)
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
      s.horizon = bad


# -- end to end through the selection pass ----------------------------------------------


def _trace(session, x, w, counts):
  counts.clear()
  jax.jit(_select.select_kernels(_conv, session=session, **FAST,
                                 on_report=lambda r: counts.update(r.counts())))(x, w)


def test_a_bucket_kept_for_horizon_1_is_cached_with_it_and_retuned_for_a_longer_one(
    tmp_path, rng):
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 4)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(3, 3, 4, 4)).astype(np.float32))
  counts: dict[str, int] = {}
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    short = _tuning.TuningSession("short", horizon=1)
    _trace(short, x, w, counts)
    assert counts == {"conv xla (cannot pay back)": 1}
    assert short.stats().buckets_kept == 1 and short.stats().buckets_tuned == 0
    (entry,) = _cache.default_cache().entries("conv")
    assert entry.value["payback"]["kept"] is True and entry.value["payback"]["horizon"] == 1
    assert entry.value["reason"].startswith("cannot pay back")
    assert set(entry.value["timings"]) == {"xla"}  # nothing else was compiled or timed
    (row,) = _explain.explain(_conv, x, w)
    assert row.kernel == "xla" and row.horizon == 1 and row.reason.startswith("cannot pay back")
    assert row.xla_ms == pytest.approx(1e3 * entry.value["payback"]["default_s"])

    again = _tuning.TuningSession("again", horizon=1)  # a restart, same horizon: no cost
    _trace(again, x, w, counts)
    assert counts == {"conv xla (hit)": 1} and again.stats().tuning_s == 0.0

    longer = _tuning.TuningSession("long", horizon=10**9)
    _trace(longer, x, w, counts)
    assert list(counts) == [k for k in counts if k.endswith("(tuned)")] and len(counts) == 1
    assert longer.stats().buckets_tuned == 1
    (entry,) = _cache.default_cache().entries("conv")
    assert "payback" not in entry.value and {"xla", "t_transposed"} <= set(entry.value["timings"])
    _tuning.default_session().forget_measured()  # explain reads the file again
    (row,) = _explain.explain(_conv, x, w)
    assert row.horizon is None and row.kernel == entry.value["winner"]


def test_an_unbounded_session_retunes_a_kept_bucket_and_payback_can_be_turned_off(
    tmp_path, rng):
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 4)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(3, 3, 4, 4)).astype(np.float32))
  counts: dict[str, int] = {}
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    _trace(_tuning.TuningSession(horizon=1), x, w, counts)
    assert counts == {"conv xla (cannot pay back)": 1}
    _trace(_tuning.TuningSession(), x, w, counts)  # tj.jit alone: no horizon
    assert len(counts) == 1 and next(iter(counts)).endswith("(tuned)")
  with h.isolated_selection(tmp_path / "off", kernel={"payback": False}), \
      h.registered("t_transposed"):
    _trace(_tuning.TuningSession(horizon=1), x, w, counts)
    assert len(counts) == 1 and next(iter(counts)).endswith("(tuned)")


def test_a_later_site_of_a_kept_bucket_that_makes_it_pay_tunes_it(monkeypatch, tmp_path, rng):
  # Each site of a bucket adds its time to what tuning could save. xla takes
  # 10 ms and compiles in 15 ms, so tuning the n other candidates is expected
  # to cost n x 25 ms; with a horizon of n runs, one site saves at most
  # n x 10 ms, two n x 20 ms (kept), three n x 30 ms: the third site tunes it.
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 4)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(3, 3, 4, 4)).astype(np.float32))
  FakeClock(monkeypatch, compile_s=0.015)
  fast = {"xla": 0.01, "t_transposed": 0.002}
  monkeypatch.setattr(_tuning, "time_interleaved",
                      lambda runners, rounds=5, **kw: {n: [fast.get(n, 0.009)] * rounds
                                                       for n in runners})
  three = lambda x, w: _conv(_conv(_conv(x, w), w), w)
  counts: dict[str, int] = {}
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    from tunedjax.autotune import _registry  # pylint: disable=import-outside-toplevel
    others = len(_registry.applicable_kernels(ConvSpec.from_arrays(x, w, padding="SAME",
                                                                   dimension_numbers=h.DN),
                                              "cpu")) - 1
    session = _tuning.TuningSession(horizon=others)
    jax.jit(_select.select_kernels(three, session=session, **FAST,
                                   on_report=lambda r: counts.update(r.counts())))(x, w)
  assert counts == {"conv xla (cannot pay back)": 1, "conv xla (hit)": 1,
                    "conv t_transposed (tuned)": 1}
  assert session.stats().buckets_kept == 1 and session.stats().buckets_tuned == 1


@pytest.fixture
def paybacks_seen(monkeypatch):
  """The `payback` argument of every `tune_bucket` call, in order."""
  seen = []
  real = _tuner.tune_bucket

  def spy(*args, payback=None, **kw):
    seen.append(payback)
    return real(*args, payback=payback, **kw)

  monkeypatch.setattr(_tuner, "tune_bucket", spy)
  return seen


def test_the_session_corrects_its_estimate_with_measured_costs(paybacks_seen, tmp_path, rng):
  seen = paybacks_seen
  session = _tuning.TuningSession(horizon=10**9)
  # Without predictions: a prediction drawn from the first bucket's timings can
  # prune every other candidate of the next (a loaded machine), leaving no
  # estimate to correct.
  with h.isolated_selection(tmp_path, kernel={"predict": False}), h.registered("t_transposed"):
    for size in (5, 6, 7):
      x = jnp.asarray(rng.normal(size=(2, size, size, 4)).astype(np.float32))
      w = jnp.asarray(rng.normal(size=(3, 3, 4, 4)).astype(np.float32))
      _trace(session, x, w, {})
  assert [p.horizon for p in seen] == [10**9] * 3
  assert seen[0].cost_factor == seen[1].cost_factor == 1.0  # fewer than two measured
  assert seen[2].cost_factor != 1.0 and seen[2].cost_factor > 0  # the first two's median


def test_kernel_report_counts_kept_sites_as_misses():
  r = _report.KernelReport((_report.KernelChoice("conv", "xla", "cannot pay back", 3),
                            _report.KernelChoice("conv", "depthwise", "tuned", 1)))
  assert (r.kept, r.misses, r.hits, r.tuned) == (3, 4, 0, 1)
  assert "cannot pay back" in _report.REASONS
  assert json.dumps(r.counts()) == '{"conv xla (cannot pay back)": 3, "conv depthwise (tuned)": 1}'


# -- the Trainer hands over its horizon ------------------------------------------------


def test_the_trainer_tunes_with_the_steps_of_its_fit_as_horizon(paybacks_seen, tmp_path):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  import tunedjax as tj  # pylint: disable=import-outside-toplevel
  from tests.trainer import models as m  # pylint: disable=import-outside-toplevel

  seen = paybacks_seen
  rng = np.random.default_rng(0)
  data = {"x": rng.normal(size=(32, 8, 8, 3)).astype(np.float32),
          "y": rng.normal(size=(32,)).astype(np.float32)}
  model = nnx.Sequential(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), nnx.relu)
  loss = lambda model, b: ((model(b["x"]).mean(axis=(1, 2, 3)) - b["y"]) ** 2).mean()
  config = {"kernel": {"enable": True, "tuning_range": [0, 10]}, "cache": {"dir": str(tmp_path)}}
  trainer = tj.Trainer(model, m.optimizer(), loss, autotune=config, progress=False)
  history = trainer.fit(data, batch_size=8, steps=3)
  assert trainer.session.horizon == 3
  assert seen and all(p is not None and p.horizon == 3 for p in seen)
  kernels = history.tuning["kernels"]
  assert kernels and all(k.endswith("(cannot pay back)") for k in kernels), kernels
  assert trainer.session.stats().buckets_kept == len(seen)


def test_sites_are_counted_per_bucket_not_per_label(monkeypatch, tmp_path):
  # Two buckets with one label (the same shapes, other dimension numbers: a
  # convolution and its input gradient look like this): each is its own first
  # site. Counted by label, the second would have been a second site and tuned.
  from tunedjax.autotune import _bucket, _registry  # pylint: disable=import-outside-toplevel
  specs = [ConvSpec.from_arrays(np.ones((2, 6, 6, 4), np.float32),
                                np.ones((3, 3, 4, 4), np.float32), padding="SAME",
                                dimension_numbers=("NHWC", rhs, "NHWC"))
           for rhs in ("HWIO", "HWOI")]
  family = _registry.op_family("conv")
  keys = [_bucket.bucket_key(s, _registry.applicable_kernels(s, "cpu"), family=family)
          for s in specs]
  assert family.label(keys[0]) == family.label(keys[1]) and keys[0] != keys[1]
  others = {len(_registry.applicable_kernels(s, "cpu")) - 1 for s in specs}
  assert len(others) == 1
  FakeClock(monkeypatch, compile_s=0.015)  # 15 ms compile + 10 ms call per candidate
  monkeypatch.setattr(_tuning, "time_interleaved",
                      lambda runners, rounds=5, **kw: {n: [0.01] * rounds for n in runners})
  with h.isolated_selection(tmp_path):
    # Two sites of one bucket would pay (2 x 2n x 10 ms >= n x 25 ms); one does not.
    session = _tuning.TuningSession(horizon=2 * others.pop())
    selection = _select.new_selection(platform="cpu", session=session)
    whys = [_select.decide(family, s, selection)[1] for s in specs]
  assert whys == ["cannot pay back", "cannot pay back"]
  assert sorted(selection.sites.values()) == [1, 1]
