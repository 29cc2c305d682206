"""The whole-program search (`_verify.Verifier`) and its cached verdicts (`_verdict`).

Fake step times per variant (a variant is the set of vetoed decisions):
nothing is timed for real.
"""

from __future__ import annotations

import json
import warnings

import pytest

from tunedjax import _tuning
from tunedjax._errors import CacheWarning
from tunedjax.autotune import _verdict, _verify

ALL4 = {"a": "conv", "b": "conv", "c": "conv", "d": "conv"}


def _run(verifier, step_s, *, noise=None, limit=10_000):
  """Drives `verifier` with `step_s(vetoed set) -> seconds`; returns the runs made."""
  runs = []
  while (variant := verifier.next_variant()) is not None and len(runs) < limit:
    seconds = step_s(variant)
    if noise is not None:
      seconds *= noise(len(runs))
    verifier.record(variant, seconds, compiled=variant in verifier.compiled)
    runs.append(variant)
  return runs


def _additive(costs, base=1.0):
  """A step of `base` seconds plus costs[d] for every decision d not vetoed."""
  return lambda vetoed: base + sum(c for d, c in costs.items() if d not in vetoed)


def test_a_tuned_program_faster_in_context_is_verified_in_one_trial():
  v = _verify.Verifier(ALL4, calls_left=None, compile_s=0.0)
  runs = _run(v, _additive({"a": -0.1, "b": -0.05, "c": 0.0, "d": 0.0}))
  assert v.outcome == _verify.VERIFIED and v.final == frozenset() and not v.lost
  assert v.ratio == pytest.approx(0.85) and len(v.trials) == 1
  # A probe, a warm-up of the untuned program (it was not compiled), 5 pairs.
  assert len(runs) == 1 + 1 + 2 * _verify.DEFAULT_ROUNDS and v.compiles == 1


def test_the_untuned_program_compiled_before_needs_no_warm_up():
  v = _verify.Verifier(ALL4, calls_left=None, compile_s=0.0,
                       compiled=frozenset({frozenset(ALL4)}))
  runs = _run(v, _additive({"a": -0.1}))
  assert v.outcome == _verify.VERIFIED and len(runs) == 1 + 2 * _verify.DEFAULT_ROUNDS
  assert v.compiles == 0


def test_bisection_isolates_the_one_decision_that_loses_in_context():
  v = _verify.Verifier(ALL4, calls_left=None, compile_s=0.0)
  _run(v, _additive({"a": -0.05, "b": -0.05, "c": 0.3, "d": -0.05}))
  assert v.outcome == _verify.FOUND_LOSERS
  assert v.final == frozenset({"c"}) and v.lost == {"c": "alone"}
  assert v.ratio == pytest.approx(1.15)


def test_two_losers_in_different_halves_are_both_found():
  v = _verify.Verifier(ALL4, calls_left=None, compile_s=0.0)
  _run(v, _additive({"a": 0.2, "b": -0.1, "c": -0.1, "d": 0.2}))
  assert v.final == frozenset({"a", "d"}) and v.lost == {"a": "alone", "d": "alone"}


def test_families_are_tried_as_groups_first():
  decisions = {"c1": "conv", "c2": "conv", "n1": "norm", "n2": "norm"}
  v = _verify.Verifier(decisions, calls_left=None, compile_s=0.0)
  _run(v, _additive({"c1": -0.1, "c2": -0.1, "n1": 0.15, "n2": 0.15}))
  assert v.final == frozenset({"n1", "n2"}) and v.lost == {"n1": "alone", "n2": "alone"}
  # The first group trial puts back one whole family.
  assert {len(t.group) for t in v.trials[1:3]} == {2}


def test_losers_that_only_lose_together_keep_the_untuned_program():
  # Each of a and b alone costs nothing; both together cost 0.3 (an interaction).
  def step(vetoed):
    return 1.0 + (0.3 if not {"a", "b"} & vetoed else 0.0)
  v = _verify.Verifier({"a": "conv", "b": "conv"}, calls_left=None, compile_s=0.0)
  _run(v, step)
  # a is put back (no loss alone); b then loses in the program with a.
  assert v.lost == {"b": "alone"} and v.final == frozenset({"b"})
  assert v.outcome == _verify.FOUND_LOSERS


def test_a_tie_is_searched_and_the_search_keeps_gains_and_drops_losses():
  v = _verify.Verifier({"a": "conv", "b": "conv"}, calls_left=None, compile_s=0.0)
  _run(v, _additive({"a": -0.1, "b": 0.1}))
  assert v.ratio == pytest.approx(1.0)
  assert v.final == frozenset({"b"}) and v.outcome == _verify.FOUND_LOSERS


def test_noise_within_the_margin_is_a_tie_not_a_loss():
  # The tuned program is 1% slower, within the 3% margin: no verdict.
  wobble = lambda i: 1.0 + 0.01 * ((i * 7) % 3 - 1)  # noqa: E731
  v = _verify.Verifier({"a": "conv"}, calls_left=None, compile_s=0.0)
  _run(v, _additive({"a": 0.01}), noise=wobble)
  assert not v.lost and v.final == frozenset()
  assert v.outcome == _verify.TIE_KEPT and len(v.trials) == 1


def test_too_short_a_horizon_skips_the_check():
  # 10 calls left of a 1 s step: 3% of 1 s over fewer than 10 calls cannot pay
  # for compiling the untuned program (2 s).
  v = _verify.Verifier(ALL4, calls_left=10, compile_s=2.0)
  runs = _run(v, _additive({"a": 0.5}))
  assert v.outcome == _verify.SKIPPED and runs == [frozenset()] and v.final == frozenset()


def test_a_search_that_cannot_pay_back_keeps_the_untuned_program_when_tuned_lost():
  # Enough calls for the first trial (the untuned program compiled already), too
  # few to compile any variant for the search: the untuned program is kept.
  v = _verify.Verifier(ALL4, calls_left=40, compile_s=100.0,
                       compiled=frozenset({frozenset(ALL4)}))
  _run(v, _additive({"a": 0.5}))
  assert v.outcome == _verify.UNTUNED_KEPT and v.final == frozenset(ALL4)
  assert v.lost == {d: "program" for d in ALL4}


def test_a_tie_that_cannot_be_searched_keeps_the_tuned_program():
  v = _verify.Verifier(ALL4, calls_left=40, compile_s=100.0,
                       compiled=frozenset({frozenset(ALL4)}))
  _run(v, _additive({}))
  assert v.outcome == _verify.TIE_KEPT and v.final == frozenset() and not v.lost


def test_the_summary_is_plain_json():
  v = _verify.Verifier({"a": "conv"}, calls_left=None, compile_s=0.0)
  _run(v, _additive({"a": 0.5}))
  summary = v.summary()
  assert json.loads(json.dumps(summary)) == summary
  assert summary["outcome"] == _verify.FOUND_LOSERS and summary["lost"] == {"a": "alone"}


def test_a_verifier_needs_a_decision():
  with pytest.raises(ValueError, match="at least one decision"):
    _verify.Verifier({}, calls_left=None, compile_s=0.0)


@pytest.mark.parametrize("ratio, spread, expected", [
    (0.96, 0.0, _verify.FASTER), (0.98, 0.0, _verify.TIE), (1.05, 0.0, _verify.SLOWER),
    (1.05, 0.03, _verify.TIE), (0.9, 0.06, _verify.TIE)])
def test_judge_widens_the_margin_with_the_spread(ratio, spread, expected):
  assert _verify.judge(ratio, spread, 0.03) == expected


# -- verdicts in the cache -------------------------------------------------------------


def _lost(kernel="k1"):
  return {"conv:1": {"kernel": kernel, "label": "conv 1x1", "how": "alone"}}


def test_a_verdict_is_kept_per_program_context_and_kernel(tmp_path):
  cache, session = _tuning.Cache(tmp_path), _tuning.TuningSession()
  here = _verdict.context_key("step", "PyTreeDef((*,))", "f32[8]", "cpu")
  other = _verdict.context_key("step", "PyTreeDef((*, *))", "f32[8]", "cpu")
  _verdict.store(session, cache, here, lost=_lost(), kept={"conv:2": "k2"}, outcome="x")
  fresh = _tuning.TuningSession()  # read back from the file
  assert _verdict.loses(fresh, cache, here, "conv:1", "k1")
  assert not _verdict.loses(fresh, cache, here, "conv:1", "k9")  # re-tuned to another kernel
  assert not _verdict.loses(fresh, cache, other, "conv:1", "k1")  # another program
  assert not _verdict.loses(fresh, cache, None, "conv:1", "k1")
  assert _verdict.load(fresh, cache, here)["kept"] == {"conv:2": "k2"}


def test_later_verdicts_add_to_earlier_ones(tmp_path):
  cache, session = _tuning.Cache(tmp_path), _tuning.TuningSession()
  ctx = _verdict.context_key("f", "t", "s", "cpu")
  _verdict.store(session, cache, ctx, lost=_lost(), kept={}, outcome="a")
  _verdict.store(session, cache, ctx, lost={"conv:3": {"kernel": "k3", "label": "l",
                                                       "how": "group"}}, kept={}, outcome="b")
  assert set(_verdict.load(_tuning.TuningSession(), cache, ctx)["lost"]) == {"conv:1", "conv:3"}


@pytest.mark.parametrize("value", [
    {"lost": {}, "kept": {}},  # a field missing
    {"lost": [], "kept": {}, "outcome": "x"},
    {"lost": {"conv:1": {"kernel": "k", "label": "l", "how": "sometimes"}}, "kept": {},
     "outcome": "x"},
    {"lost": {}, "kept": {"conv:1": 3}, "outcome": "x"},
    {"lost": {"conv:1": "k"}, "kept": {}, "outcome": "x"}])
def test_a_corrupt_verdict_warns_and_reads_as_none(tmp_path, value):
  cache = _tuning.Cache(tmp_path)
  ctx = _verdict.context_key("f", "t", "s", "cpu")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    cache.put(_verdict.NAMESPACE, ctx, {"lost": {}, "kept": {}, "outcome": "x"})
  raw = json.loads(cache.path.read_text())
  for entry in raw["entries"]:
    entry["value"] = value
  cache.path.write_text(json.dumps(raw))
  with pytest.warns(CacheWarning, match="verdict"):
    found = _verdict.load(_tuning.TuningSession(), _tuning.Cache(tmp_path), ctx)
    loses = _verdict.loses(_tuning.TuningSession(), _tuning.Cache(tmp_path), ctx,
                           "conv:1", "k")
  assert found is None and not loses


def test_bucket_ids_follow_the_full_key():
  a = _verdict.bucket_id("conv", {"op": "conv", "lhs_shape": [1, 2], "candidates": {"x": "1"}})
  b = _verdict.bucket_id("conv", {"op": "conv", "lhs_shape": [1, 2], "candidates": {"x": "2"}})
  assert a != b and a.startswith("conv:")


from hypothesis import given, strategies as st  # noqa: E402


@given(costs=st.lists(st.floats(-0.2, 0.2), min_size=1, max_size=7),
       families=st.lists(st.sampled_from(["conv", "norm", "attention"]), min_size=7,
                         max_size=7),
       pair=st.floats(-0.3, 0.3), calls_left=st.one_of(st.none(), st.integers(5, 400)),
       compile_s=st.floats(0.0, 20.0))
def test_the_program_kept_is_never_slower_than_the_untuned_one_beyond_the_margin(
    costs, families, pair, calls_left, compile_s):
  # Additive costs per decision, and an interaction between the first two.
  names = [f"d{i}" for i in range(len(costs))]

  def step(vetoed):
    t = 1.0 + sum(c for n, c in zip(names, costs) if n not in vetoed)
    if len(names) > 1 and not {"d0", "d1"} & vetoed:
      t += pair
    return max(t, 0.05)

  v = _verify.Verifier(dict(zip(names, families)), calls_left=calls_left,
                       compile_s=compile_s, compiled=frozenset({frozenset(names)}))
  _run(v, step)
  assert v.done
  untuned = step(frozenset(names))
  if v.outcome != _verify.SKIPPED:
    assert step(v.final) <= untuned * (1 + v.margin) + 1e-9
  if calls_left is not None:
    assert v.calls <= calls_left  # every run was one the program makes anyway
