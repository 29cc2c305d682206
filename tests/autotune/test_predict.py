"""Predicted decisions: rank a bucket's kernels before compiling, compile only what could win."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tests.autotune import selection_helpers as h
from tunedjax import _tuning, autotune
from tunedjax._errors import AutotuneError, CacheWarning, ConfigError
from tunedjax.autotune import _payback, _predict, _registry, _result, _tuner
from tunedjax.autotune._predict import Estimate, Point, Prediction
from tunedjax.ops.conv._family import conv_features
from tunedjax.ops.conv._spec import ConvSpec

# -- the predictor, on constructed measurements ------------------------------------


def test_neighbours_rank_the_candidates_and_rule_out_the_hopeless():
  points = [Point({"n": 4.0}, {"xla": 1.0, "fast": 0.1, "slow": 2.0}),
            Point({"n": 6.0}, {"xla": 1.0, "fast": 0.12, "slow": 2.5})]
  pred = _predict.predict({"n": 5.0}, ["xla", "fast", "slow"], points, default="xla")
  assert pred.best() == "fast"
  assert pred.estimates["fast"].ratio == pytest.approx(math.sqrt(0.1 * 0.12))
  kept, pruned = pred.could_win(margin=0.1)
  assert kept == ["xla", "fast"] and list(pruned) == ["slow"]
  assert "needs < 0.91x" in pruned["slow"]


def test_a_candidate_no_measured_bucket_is_near_is_unknown_and_compiled():
  points = [Point({"n": 4.0}, {"xla": 1.0, "fast": 0.1})]
  pred = _predict.predict({"n": 40.0}, ["xla", "fast", "new"], points, default="xla")
  assert pred.estimates == {} and pred.unknown == ("fast", "new")
  assert pred.could_win(margin=0.1) == (["xla", "fast", "new"], {})
  assert _predict.predict({"n": 1.0}, ["xla", "fast"], [], default="xla").unknown == ("fast",)


def test_this_machines_measurements_outweigh_a_prior():
  prior = Point({"n": 4.0}, {"xla": 1.0, "k": 0.1}, source="prior")
  local = Point({"n": 4.0}, {"xla": 1.0, "k": 1.0})
  est = _predict.estimate({"n": 4.0}, "k", [prior, local])
  # Weights 0.5 and 1: the log-mean sits two thirds of the way to the local 1.0.
  assert est.ratio == pytest.approx(math.exp(math.log(0.1) / 3))
  assert est.spread > _predict.BASE_SPREAD  # they disagree: wider


def test_disagreeing_or_distant_neighbours_keep_a_candidate_that_could_win():
  # Near buckets disagree on which of a and b is faster: both are compiled.
  split = [Point({"n": 4.0}, {"xla": 1.0, "a": 0.3, "b": 0.5}),
           Point({"n": 4.5}, {"xla": 1.0, "a": 0.5, "b": 0.3})]
  assert _predict.predict({"n": 4.2}, ["xla", "a", "b"], split,
                          default="xla").could_win(margin=0.1)[0] == ["xla", "a", "b"]
  # Within `TOLERANCE` of the best: not worth compiling.
  close = [Point({"n": 4.0}, {"xla": 1.0, "a": 0.30, "b": 0.33})]
  assert _predict.predict({"n": 4.0}, ["xla", "a", "b"], close,
                          default="xla").could_win(margin=0.1)[0] == ["xla", "a"]
  far = [Point({"n": 4.0}, {"xla": 1.0, "a": 0.1, "b": 0.5})]
  assert _predict.predict({"n": 4.0}, ["xla", "a", "b"], far,
                          default="xla").could_win(margin=0.1)[0] == ["xla", "a"]
  # Far from every measured bucket, both are uncertain and both are compiled.
  assert _predict.predict({"n": 12.0}, ["xla", "a", "b"], far,
                          default="xla").could_win(margin=0.1)[0] == ["xla", "a", "b"]


def test_compile_time_counts_within_a_horizon():
  # a: 0.30x but compiles for 2 s; b: 0.55x and compiles for 20 ms.
  pred = Prediction("xla", {"a": Estimate(0.30, 0.05, compile_s=2.0),
                            "b": Estimate(0.55, 0.05, compile_s=0.02)})
  assert pred.could_win(margin=0.1)[0] == ["xla", "a"]  # unbounded: time alone
  # The default would take 1 s within the horizon: a can save at most ~0.7 s,
  # less than its compile; b saves ~0.45 s for 20 ms.
  kept, pruned = pred.could_win(margin=0.1, horizon_s=1.0)
  assert kept == ["xla", "b"] and list(pruned) == ["a"]
  # Over a long horizon the compile does not matter.
  assert pred.could_win(margin=0.1, horizon_s=1000.0)[0] == ["xla", "a"]



def test_within_a_horizon_a_second_candidate_must_pay_its_own_compile():
  # Both far ahead of xla, uncertain which is faster (no pair timed). The best
  # is compiled anyway; the other could save at most horizon x (the best's
  # pessimistic ratio - its own optimistic one) beyond it.
  pred = Prediction("xla", {"a": Estimate(0.10, 0.4, compile_s=0.3),
                            "b": Estimate(0.12, 0.4, compile_s=0.3)})
  assert pred.could_win(margin=0.1)[0] == ["xla", "a", "b"]  # unbounded: both
  # 1 s of xla's time in the horizon: b could save ~0.15 s over a, not its 0.3 s compile.
  kept, pruned = pred.could_win(margin=0.1, horizon_s=1.0)
  assert kept == ["xla", "a"] and list(pruned) == ["b"]
  # 20 s: it could save ~3 s over a, which pays its compile.
  assert pred.could_win(margin=0.1, horizon_s=20.0)[0] == ["xla", "a", "b"]

def test_conv_features_keep_depthwise_and_dense_buckets_apart():
  dense = ConvSpec.from_arrays(np.ones((8, 16, 16, 32), np.float32),
                               np.ones((3, 3, 32, 32), np.float32), padding="SAME",
                               dimension_numbers=h.DN)
  depthwise = ConvSpec.from_arrays(np.ones((8, 16, 16, 32), np.float32),
                                   np.ones((3, 3, 1, 32), np.float32), padding="SAME",
                                   dimension_numbers=h.DN, feature_group_count=32)
  wider = ConvSpec.from_arrays(np.ones((8, 16, 16, 64), np.float32),
                               np.ones((3, 3, 64, 64), np.float32), padding="SAME",
                               dimension_numbers=h.DN)
  family = autotune.op_family("conv")
  f = {name: conv_features(family.key(s, "exact"))
       for name, s in (("dense", dense), ("depthwise", depthwise), ("wider", wider))}
  assert f["depthwise"]["depthwise"] == 3.0 and f["dense"]["depthwise"] == 0.0
  assert _predict._distance(f["dense"], f["wider"]) < _predict._distance(f["dense"],
                                                                         f["depthwise"])


def test_machine_classes_and_the_priors_file_chosen(tmp_path):
  fp = autotune.device_fingerprint()
  classes = _predict.machine_class(fp)
  assert classes[-1] == "cpu"
  assert _predict.priors_file(tmp_path, classes) is None
  (tmp_path / "cpu.json").write_text("{}")
  assert _predict.priors_file(tmp_path, classes) == tmp_path / "cpu.json"
  gpu = dataclasses.replace(fp, platform="gpu", compute_capability="9.0")
  assert _predict.machine_class(gpu) == ("gpu-sm90", "gpu")


# -- the tuner with a prediction: what is compiled, what is timed -------------------


def _spec() -> ConvSpec:
  return ConvSpec.from_arrays(np.ones((2, 9, 9, 4), np.float32), np.ones((3, 3, 4, 6), np.float32),
                              padding="SAME", dimension_numbers=h.DN)


NAMES = ("t_transposed", "t_wrong", "t_boom")


def _candidates(spec):
  return [k for k in _registry.applicable_kernels(spec, "cpu") if k.name in ("xla", *NAMES)]


@pytest.fixture
def counted(monkeypatch):
  """Counts what `_compile_all` compiles; fakes the timings (xla 2 ms, t_transposed as set)."""
  compiled: list[str] = []
  real = _tuner._compile_all
  speed = {"xla": 0.002, "t_transposed": 0.001}

  def compile_all(functions, args, times=None):
    compiled.extend(sorted(functions))
    return real(functions, args, times)

  monkeypatch.setattr(_tuner, "_compile_all", compile_all)
  monkeypatch.setattr(_tuning, "time_interleaved", lambda runners, rounds=5, **kw: {
      n: [speed.get(n, 0.002)] * rounds for n in runners})
  with h.registered(*NAMES):
    yield compiled, speed


def _prediction(best="t_transposed", ratio=0.2):
  others = {n: Estimate(3.0, 0.1, compile_s=0.01) for n in NAMES if n != best}
  return Prediction("xla", {best: Estimate(ratio, 0.1, compile_s=0.01), **others})


def test_a_confident_prediction_compiles_only_the_predicted_kernel_and_the_default(counted):
  compiled, _ = counted
  spec = _spec()
  result = _tuner.tune_bucket(spec, _candidates(spec), options=_tuner.TuneOptions(rounds=2),
                              prediction=_prediction())
  assert sorted(compiled) == ["t_transposed", "xla"]
  assert result.winner == "t_transposed" and result.decided == "predicted"
  assert sorted(result.pruned) == ["t_boom", "t_wrong"]
  assert result.predicted["t_transposed"] == pytest.approx(0.2)
  assert result.regret == pytest.approx(1.0)
  assert set(result.compile_s) == {"xla", "t_transposed"}
  assert all(s > 0 for s in result.compile_s.values())
  assert set(result.timings) == {"xla", "t_transposed"}  # timed against the default


def test_without_a_prediction_or_with_predict_off_every_candidate_compiles(counted):
  compiled, _ = counted
  spec = _spec()
  _tuner.tune_bucket(spec, _candidates(spec), options=_tuner.TuneOptions(rounds=1))
  assert sorted(compiled) == sorted(["xla", *NAMES])
  compiled.clear()
  result = _tuner.tune_bucket(spec, _candidates(spec),
                              options=_tuner.TuneOptions(rounds=1, predict=False),
                              prediction=_prediction())
  assert sorted(compiled) == sorted(["xla", *NAMES]) and result.decided == "timed"
  assert result.pruned == {} and set(result.compile_s) == {"xla", *NAMES}


def test_a_wrong_prediction_is_caught_by_timing(counted):
  compiled, speed = counted
  speed["t_transposed"] = 0.004  # predicted at 0.2x, measured at 2x: the default stays
  spec = _spec()
  result = _tuner.tune_bucket(spec, _candidates(spec), options=_tuner.TuneOptions(rounds=2),
                              prediction=_prediction())
  assert sorted(compiled) == ["t_transposed", "xla"]
  assert result.winner == "xla" and result.ratios["t_transposed"] == pytest.approx(2.0)
  assert result.regret == pytest.approx(2.0)  # the predicted winner's time over the best


def test_the_accuracy_check_still_drops_a_wrong_kernel_predicted_to_win(counted):
  compiled, _ = counted
  spec = _spec()
  result = _tuner.tune_bucket(spec, _candidates(spec), options=_tuner.TuneOptions(rounds=1),
                              prediction=_prediction(best="t_wrong", ratio=0.1))
  assert sorted(compiled) == ["t_wrong", "xla"]
  assert result.winner == "xla" and "t_wrong" in result.rejected


def test_a_prediction_that_nothing_can_win_keeps_the_default_uncompiled_candidates(counted):
  compiled, _ = counted
  spec = _spec()
  pred = Prediction("xla", {n: Estimate(3.0, 0.1) for n in NAMES})
  result = _tuner.tune_bucket(spec, _candidates(spec), prediction=pred)
  assert compiled == [] and result.winner == "xla" and result.decided == "predicted"
  assert result.reason.startswith("predicted: no other candidate could win")


def test_compile_times_are_recorded_and_the_payback_cost_uses_the_predicted_ones(counted):
  compiled, _ = counted
  spec = _spec()
  # Predicted to compile for 10 s: 100 runs of a 2 ms default cannot pay that back.
  pred = Prediction("xla", {"t_transposed": Estimate(0.5, 0.1, compile_s=10.0),
                            "t_wrong": Estimate(3.0, 0.1), "t_boom": Estimate(3.0, 0.1)})
  slow = _tuner.tune_bucket(spec, _candidates(spec), payback=_tuner.Payback(horizon=100),
                            prediction=pred)
  assert compiled == ["xla"] and set(slow.compile_s) == {"xla"} and slow.winner == "xla"
  assert slow.kept and slow.decided == "kept" and "saves its compile" in slow.reason
  assert "cannot save its compile" in slow.pruned["t_transposed"]
  # Kept for this horizon and a shorter one; a horizon long enough to pay the
  # 10 s compile back tunes it.
  value = slow.to_value()
  assert _payback.still_cannot_pay_back(value, horizon=100)
  assert _payback.still_cannot_pay_back(value, horizon=10)
  assert not _payback.still_cannot_pay_back(value, horizon=100_000)
  # Predicted to compile for 1 ms: it pays back, and only it is compiled
  # (beside the default: `_compiled_ahead`).
  compiled.clear()
  pred = dataclasses.replace(pred, estimates={**pred.estimates, "t_transposed": Estimate(
      0.5, 0.1, compile_s=0.001)})
  fast = _tuner.tune_bucket(spec, _candidates(spec), payback=_tuner.Payback(horizon=100),
                            prediction=pred, options=_tuner.TuneOptions(rounds=2))
  assert not fast.kept and compiled == ["t_transposed", "xla"]
  assert fast.payback["estimate_s"] == pytest.approx(0.001 + 0.002)
  assert fast.winner == "t_transposed"


@pytest.fixture
def grouped(monkeypatch):
  """What each `_compile_all` call compiles; fakes the timings (xla 2 ms, t_transposed 1 ms)."""
  groups: list[list[str]] = []
  called: list[str] = []
  real = _tuner._compile_all
  speed = {"xla": 0.002, "t_transposed": 0.001}

  def compile_all(functions, args, times=None):
    groups.append(sorted(functions))
    return real(functions, args, times)

  def timed(runners, rounds=5, **kw):
    called.extend(runners)
    return {n: [speed.get(n, 0.002)] * rounds for n in runners}

  monkeypatch.setattr(_tuner, "_compile_all", compile_all)
  monkeypatch.setattr(_tuning, "time_interleaved", timed)
  with h.registered(*NAMES):
    yield groups, called


def _decision(result):
  return (result.winner, result.decided, result.kept, sorted(result.pruned),
          sorted(result.timings), result.ratios)


@pytest.mark.parametrize("horizon", [100, 2])
def test_the_predicted_best_compiles_beside_the_default_and_decides_alike(
    grouped, monkeypatch, horizon):
  # On two cores the candidate predicted best (and quick to compile) compiles
  # in the same call as the default, before the payback decision; on one core
  # after it. Either way the same decision: tuned with 100 runs, kept with 2
  # (2 runs of a 2 ms default cannot pay for a compile), and a kept bucket's
  # candidate compiled ahead is never called.
  groups, called = grouped
  spec = _spec()

  def tune():
    groups.clear(), called.clear()
    return _tuner.tune_bucket(spec, _candidates(spec), payback=_tuner.Payback(horizon=horizon),
                              prediction=_prediction(), options=_tuner.TuneOptions(rounds=2))

  monkeypatch.setattr(_tuning, "usable_cores", lambda: 2)
  beside, groups_beside, called_beside = tune(), list(groups), set(called)
  monkeypatch.setattr(_tuning, "usable_cores", lambda: 1)
  alone, groups_alone = tune(), list(groups)
  assert _decision(beside) == _decision(alone)
  assert groups_beside == [["t_transposed", "xla"]]
  assert beside.kept is (horizon == 2)
  if beside.kept:
    assert groups_alone == [["xla"]] and called_beside == {"xla"}
    assert set(beside.compile_s) == {"xla", "t_transposed"}  # measured, for later predictions
  else:
    assert groups_alone == [["xla"], ["t_transposed"]] and beside.winner == "t_transposed"
  # Deciding is counted as if the default had compiled alone.
  assert beside.payback["decided_s"] <= beside.tuning_s


def test_nothing_compiles_beside_the_default_without_a_quick_predicted_candidate(
    grouped, monkeypatch):
  groups, _ = grouped
  monkeypatch.setattr(_tuning, "usable_cores", lambda: 2)
  spec = _spec()
  slow = _prediction(ratio=0.2)
  slow = dataclasses.replace(slow, estimates={**slow.estimates, "t_transposed": Estimate(
      0.2, 0.1, compile_s=_tuner.AHEAD_COMPILE_S * 2)})
  unknown = dataclasses.replace(slow, estimates={
      n: e for n, e in slow.estimates.items() if n != "t_transposed"},
      unknown=("t_transposed",))
  for prediction in (None, slow, unknown):
    groups.clear()
    _tuner.tune_bucket(spec, _candidates(spec), payback=_tuner.Payback(horizon=10**6),
                       prediction=prediction, options=_tuner.TuneOptions(rounds=1))
    assert groups[0] == ["xla"], (prediction, groups)


def test_payback_without_predicted_compiles_uses_the_defaults():
  p = _tuner.Payback(horizon=10)
  assert p.expected_cost(compile_s=0.5, call_s=0.01, candidates=2) == pytest.approx(1.02)
  assert p.expected_cost(compile_s=0.5, call_s=0.01, candidates=2,
                         compile_each=[0.1, 0.2]) == pytest.approx(0.32)


# -- through the selector: a family with features, the cache, priors ----------------

OP = "toy_scaled"


@dataclasses.dataclass(frozen=True)
class ScaledSpec:
  n: int


def _scale(x, spec):
  del spec
  return 3.0 * x


@pytest.fixture
def toy(monkeypatch, tmp_path):
  """A family whose buckets differ by size; `fast` always wins, `slow` always loses."""
  speed = {"xla": 1.0, "fast": 0.1, "slow": 3.0}
  compiled: list[list[str]] = []
  real = _tuner._compile_all

  def compile_all(functions, args, times=None):
    compiled.append(sorted(functions))
    return real(functions, args, times)

  monkeypatch.setattr(_tuner, "_compile_all", compile_all)
  monkeypatch.setattr(_tuning, "time_interleaved", lambda runners, rounds=5, **kw: {
      n: [1e-3 * speed[n]] * rounds for n in runners})
  priors = tmp_path / "priors"
  priors.mkdir()

  def register(features=lambda key: {"n": math.log2(key["n"])}):
    family = autotune.OpFamily(
        name=OP, spec_type=ScaledSpec, key=lambda s, b: {"n": s.n},
        operands=lambda s, rng: (rng.standard_normal((s.n,)).astype(np.float32),),
        features=features, priors=priors)
    autotune.register_op_family(family, replace=True)
    for name in speed:
      autotune.register_kernel(OP, name, _scale, applicable=lambda s, p: True, replace=True)
    return family

  _predict._load_priors.cache_clear()
  try:
    yield register, compiled, priors
  finally:
    autotune.unregister_op_family(OP)
    _predict._load_priors.cache_clear()


def _run(tmp_path, n, **kernel):
  cache = tmp_path / "cache"
  with tj.config_context({"kernel": {"enable": True, **kernel}, "cache": {"dir": str(cache)}}):
    f = tj.jit(lambda x: autotune.dispatch(OP, ScaledSpec(x.shape[0]), x),
               session=autotune.TuningSession())
    np.testing.assert_allclose(f(jnp.ones(n)), 3.0 * np.ones(n))
  entries = {e.key["n"]: e.value for e in autotune.Cache(cache).entries(OP)}
  return entries[n]


def test_a_bucket_is_predicted_from_the_buckets_this_machine_measured(toy, tmp_path):
  register, compiled, _ = toy
  register()
  first = _run(tmp_path, 64)  # nothing measured yet, no priors: every candidate
  assert compiled == [["fast", "slow", "xla"]] and _result.decided(first) == "timed"
  assert set(first["compile_s"]) == {"xla", "fast", "slow"}
  assert "predicted" not in first  # nothing known: no estimates
  compiled.clear()
  second = _run(tmp_path, 128)  # a neighbour of 64: slow is ruled out
  assert compiled == [["fast", "xla"]] and _result.decided(second) == "predicted"
  assert second["winner"] == "fast" and list(second["pruned"]) == ["slow"]
  assert second["predicted"]["fast"] == pytest.approx(0.1)
  assert _result.regret(second) == pytest.approx(1.0)
  compiled.clear()
  third = _run(tmp_path, 256, predict=False)  # the switch: exhaustive
  assert compiled == [["fast", "slow", "xla"]] and _result.decided(third) == "timed"


def _priors_file(priors, buckets):
  data = {"format": _predict.PRIORS_FORMAT, "version": _predict.PRIORS_VERSION, "family": OP,
          "machine_class": "cpu", "provenance": _predict.provenance(
              machine="test", jax_version="0", command="test"), "buckets": buckets}
  (priors / "cpu.json").write_text(json.dumps(data))


def test_priors_shipped_as_data_predict_a_machines_first_bucket(toy, tmp_path):
  register, compiled, priors = toy
  _priors_file(priors, [{"features": {"n": 6.0}, "ratios": {"fast": 0.1, "slow": 3.0},
                         "compile_s": {"fast": 0.01}}])
  register()
  value = _run(tmp_path, 64)
  assert compiled == [["fast", "xla"]] and list(value["pruned"]) == ["slow"]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": _predict.PRIORS_FORMAT, "version": 1,
                                                 "family": OP, "buckets": [{"features": 1}]})])
def test_a_corrupt_priors_file_warns_and_every_candidate_is_timed(toy, tmp_path, content):
  register, compiled, priors = toy
  (priors / "cpu.json").write_text(content)
  register()
  with pytest.warns(CacheWarning, match="priors .* cannot be read"):
    value = _run(tmp_path, 64)
  assert compiled == [["fast", "slow", "xla"]] and value["winner"] == "fast"


def test_missing_priors_are_no_warning(toy, tmp_path):
  register, compiled, _ = toy
  register()
  with warnings.catch_warnings():
    warnings.simplefilter("error", CacheWarning)
    _run(tmp_path, 64)
  assert compiled == [["fast", "slow", "xla"]]


def test_a_family_whose_features_fail_is_tuned_exhaustively(toy, tmp_path):
  register, compiled, _ = toy
  register(features=lambda key: 1 / 0)
  assert _run(tmp_path, 64)["winner"] == "fast"
  assert compiled == [["fast", "slow", "xla"]]


# -- the cache value and the options ---------------------------------------------


def test_old_cache_values_without_the_new_fields_still_load():
  old = {"winner": "xla", "reason": "r", "timings": {"xla": [0.1]}, "ratios": {"xla": 1.0},
         "errors": {}, "rejected": {}, "skipped": [], "measured_at": "", "tuning_s": 0.5,
         "temp_bytes": {}}
  _result.validate_value(old, "conv", known={"xla"})
  r = _result.TuneResult.from_value(old)
  assert r.compile_s == {} and r.predicted == {} and r.pruned == {}
  assert r.decided == "timed" and r.regret is None and r.to_value() == old
  new = _result.TuneResult("xla", "r", compile_s={"xla": 0.1}, predicted={"xla": 1.0},
                           pruned={"fft": "predicted 3x"})
  assert _result.TuneResult.from_value(new.to_value()) == new


@pytest.mark.parametrize("field, bad", [("compile_s", {"xla": -1.0}),
                                        ("predicted", {"xla": 0.0}),
                                        ("pruned", {"fft": 3}), ("compile_s", [1.0])])
def test_bad_new_fields_are_rejected(field, bad):
  with pytest.raises(TypeError, match=field):
    _result.validate_value({"winner": "xla", field: bad}, "conv", known={"xla"})


def test_bad_option_values_give_clear_errors():
  with pytest.raises(AutotuneError, match=r"TuneOptions.predict must be True .* got 'yes'"):
    _tuner.TuneOptions(predict="yes")
  with pytest.raises(ConfigError, match="kernel.predict"):
    tj.Config.from_dict({"kernel": {"predict": "no"}})
  with pytest.raises(AutotuneError, match="features must be callable"):
    autotune.OpFamily(name="x", spec_type=int, key=lambda s, b: {}, operands=lambda s, r: (),
                      features=3)


def test_explain_and_the_report_show_how_each_bucket_was_decided(toy, tmp_path):
  register, _, _ = toy
  register()
  _run(tmp_path, 64)  # timed: every candidate
  cache = tmp_path / "cache"
  with tj.config_context({"kernel": {"enable": True}, "cache": {"dir": str(cache)}}):
    f = tj.jit(lambda x: autotune.dispatch(OP, ScaledSpec(x.shape[0]), x),
               session=autotune.TuningSession())
    f(jnp.ones(128))
    report = f.report(memory=False).last.kernel_report
  (decision,) = report.decisions
  assert (decision.decided, decision.kernel, decision.compiled, decision.candidates) == (
      "predicted", "fast", 2, 3)
  assert decision.regret == pytest.approx(1.0) and decision.compile_s > 0
  assert report.decided() == {"predicted": 1} and report.compiled == (2, 3)
  assert "buckets 1 predicted, 2 of 3 candidates compiled" in str(report)
  rows = {r.bucket: r for r in autotune.explain(
      lambda x, y: (autotune.dispatch(OP, ScaledSpec(64), x),
                    autotune.dispatch(OP, ScaledSpec(128), y)),
      jnp.ones(64), jnp.ones(128), cache=cache)}
  first, second = rows[f"{OP} 64"], rows[f"{OP} 128"]
  assert (first.decided, first.compiled, first.regret) == ("timed", 3, None)
  assert (second.decided, second.compiled) == ("predicted", 2)
  assert second.regret == pytest.approx(1.0) and second.compile_s > 0
