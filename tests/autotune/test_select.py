"""The kernel-selection pass, bucket keys and the bucket tuner."""

from __future__ import annotations

import collections

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from tests import processes
from tests.autotune import selection_helpers as h
from tunedjax import rewrite
from tunedjax import _tuning
from tunedjax._tuning import _cache
from tunedjax.autotune import _bucket, _phases, _registry, _select, _tuner
from tunedjax.ops.conv import _family as _conv_family
from tunedjax.ops.conv._spec import ConvSpec

FAST = dict(rounds=2, budget_s=5.0)


def _spec(lhs=(2, 9, 9, 4), rhs=(3, 3, 4, 6), **kw) -> ConvSpec:
  kw.setdefault("dimension_numbers", h.DN)
  kw.setdefault("padding", "SAME")
  return ConvSpec.from_arrays(np.ones(lhs, np.float32), np.ones(rhs, np.float32), **kw)


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=h.DN)


def _operands(rng, lhs=(2, 9, 9, 4), rhs=(3, 3, 4, 6)):
  return (jnp.asarray(rng.normal(size=lhs).astype(np.float32)),
          jnp.asarray(rng.normal(size=rhs).astype(np.float32)))


def _candidates(spec, *names):
  return [k for k in _registry.applicable_kernels(spec, "cpu") if k.name in ("xla", *names)]


# -- bucket keys ----------------------------------------------------------------


def test_bucket_key_holds_every_parameter_and_is_json():
  spec = _spec(window_strides=(2, 1), rhs_dilation=(1, 2))
  key = _bucket.bucket_key(spec, _registry.applicable_kernels(spec, "cpu"))
  assert json.loads(json.dumps(key)) == key
  assert key["lhs_shape"] == [2, 9, 9, 4] and key["rhs_shape"] == [3, 3, 4, 6]
  assert key["window_strides"] == [2, 1] and key["rhs_dilation"] == [1, 2]
  assert key["dimension_numbers"] == [list(d) for d in spec.dimension_numbers]
  for field in ("padding", "lhs_dilation", "feature_group_count", "batch_group_count",
                "lhs_dtype", "rhs_dtype", "out_dtype", "preferred_element_type",
                "precision"):
    assert field in key
  assert key["candidates"]["xla"] == _registry.get_kernel("conv", "xla").source_hash
  # Every parameter that changes the convolution changes the key.
  others = [_spec(window_strides=(1, 1), rhs_dilation=(1, 2)),
            _spec(window_strides=(2, 1), rhs_dilation=(1, 1)),
            _spec(lhs=(2, 9, 9, 4), rhs=(3, 3, 2, 6), window_strides=(2, 1),
                  rhs_dilation=(1, 2), feature_group_count=2)]
  for other in others:
    assert _bucket.bucket_key(other, []) != _bucket.bucket_key(spec, [])


def test_bucket_key_changes_with_a_kernel_source_hash():
  spec = _spec()
  xla = _registry.get_kernel("conv", "xla")
  edited = _registry.Kernel("conv", "xla", xla.fn, xla.applicable, "0" * 16)
  assert _bucket.bucket_key(spec, [xla]) != _bucket.bucket_key(spec, [edited])


def test_pow2_bucket_rounds_batch_and_spatial_only():
  spec = _spec(lhs=(3, 9, 12, 4))
  lhs, rhs = _conv_family.bucket_shapes(spec, "pow2")
  assert lhs == (4, 16, 16, 4) and rhs == (3, 3, 4, 6)
  assert _conv_family.bucket_shapes(spec, "exact") == ((3, 9, 12, 4), (3, 3, 4, 6))
  assert (_bucket.bucket_key(_spec(lhs=(3, 10, 10, 4)), [], bucket="pow2")
          == _bucket.bucket_key(_spec(lhs=(4, 16, 15, 4)), [], bucket="pow2"))


@given(n=st.integers(1, 40), hgt=st.integers(3, 70), wid=st.integers(3, 70),
       bgc=st.sampled_from([1, 2]))
def test_pow2_shapes_are_the_next_powers_of_two(n, hgt, wid, bgc):
  import types
  spec = types.SimpleNamespace(lhs_shape=(2 * n, hgt, wid, 6), rhs_shape=(3, 3, 6, 4),
                               dimension_numbers=((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
                               batch_group_count=bgc)
  lhs, rhs = _conv_family.bucket_shapes(spec, "pow2")
  assert rhs == spec.rhs_shape and lhs[3] == 6
  dims = (1, 2) if bgc > 1 else (0, 1, 2)
  for d in range(4):
    if d in dims:
      assert lhs[d] >= spec.lhs_shape[d] > lhs[d] // 2 and lhs[d] & (lhs[d] - 1) == 0
    else:
      assert lhs[d] == spec.lhs_shape[d]


# -- the bucket tuner ----------------------------------------------------------------


def test_failing_candidate_is_reported_and_skipped(caplog):
  spec = _spec()
  with h.registered("t_boom", "t_transposed"):
    with caplog.at_level(logging.WARNING, logger="tunedjax.autotune"):
      result = _tuner.tune_bucket(spec, _candidates(spec, "t_boom", "t_transposed"),
                                  options=_tuner.TuneOptions(rounds=2))
  assert "t_boom" in result.errors and "test kernel failed" in result.errors["t_boom"]
  assert "t_boom" not in result.timings and result.winner != "t_boom"
  assert set(result.timings) == {"xla", "t_transposed"}
  assert any("t_boom" in r.message and "skipped" in r.message for r in caplog.records)


def test_wrong_candidates_never_win(monkeypatch):
  spec = _spec()
  # Even if the wrong kernels were timed as infinitely fast, they are dropped
  # before timing: the fake timer makes every candidate it sees 10x faster.
  def fake_timer(runners, **kw):
    return {n: [1.0 if n == "xla" else 0.1] * 2 for n in runners}
  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_wrong", "t_zeros", "t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_wrong", "t_zeros", "t_transposed"),
                                options=_tuner.TuneOptions(rounds=2))
  assert set(result.rejected) == {"t_wrong", "t_zeros"}
  assert result.rejected["t_wrong"] == pytest.approx(0.01, rel=1e-3)
  assert result.winner == "t_transposed"


@pytest.mark.parametrize("ratio, expected", [(0.5, "t_transposed"), (0.95, "xla"),
                                             (1.3, "xla")])
def test_a_candidate_must_beat_xla_by_the_margin(monkeypatch, ratio, expected):
  spec = _spec()

  def fake_timer(runners, **kw):
    # Per-round times with noise; only the per-round ratio matters.
    base = [1.0, 2.0, 1.5]
    return {n: ([b * ratio for b in base] if n != "xla" else base) for n in runners}

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(margin=0.1))
  assert result.winner == expected
  assert result.ratios["t_transposed"] == pytest.approx(ratio)


def test_a_much_slower_candidate_is_screened_after_one_call(monkeypatch):
  spec = _spec()
  calls = []

  def fake_timer(runners, rounds=5, **kw):
    calls.append((sorted(runners), rounds))
    return {n: [10.0 if n == "t_transposed" else 1.0] * rounds for n in runners}

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=3))
  assert calls == [(["t_transposed", "xla"], 1)]  # no full rounds: only xla was left
  assert result.winner == "xla" and result.ratios["t_transposed"] == pytest.approx(10.0)
  assert len(result.timings["t_transposed"]) == 1


def test_the_call_that_checks_a_candidate_is_its_screening_round(monkeypatch):
  spec = _spec()
  calls = collections.Counter()
  real_runner = _tuner._runner

  def counting_runner(executable, operands):
    run = real_runner(executable, operands)
    name = next(n for n, e in compiled.items() if e is executable)

    def counted():
      calls[name] += 1
      return run()
    return counted

  compiled = {}
  real_compile_all = _tuner._compile_all

  def remembering(functions, args, times=None):
    compiled.update(real_compile_all(functions, args, times))
    return compiled

  monkeypatch.setattr(_tuner, "_runner", counting_runner)
  monkeypatch.setattr(_tuner, "_compile_all", remembering)
  monkeypatch.setattr(_tuner, "decisive", lambda *a, **k: False)  # always timed rounds
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=2))
  # One call checks the result and is timed as the screening round; then the
  # timed rounds. No separate screening call.
  assert set(calls) == {"xla", "t_transposed"}
  for name, n in calls.items():
    assert n == 1 + len(result.timings[name]), (name, n, result.timings)


@pytest.mark.parametrize("ratio, calls_expected", [(0.05, 1), (0.5, 2)])
def test_a_decisive_screening_round_ends_the_timing(monkeypatch, ratio, calls_expected):
  spec = _spec()
  calls = []

  def fake_timer(runners, rounds=5, **kw):
    calls.append(rounds)
    return {n: [ratio if n == "t_transposed" else 1.0] * rounds for n in runners}

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=3))
  assert len(calls) == calls_expected  # the screening round, then (if not decisive) rounds
  assert result.winner == "t_transposed"
  assert result.ratios["t_transposed"] == pytest.approx(ratio)


def test_a_fast_default_first_call_decides_nothing(monkeypatch):
  # xla's screening call under SCREEN_MIN_S: first-call costs could fake a 10x
  # gap or a 4x loss, so nothing is dropped or decided from it.
  spec = _spec()
  calls = []

  def fake_timer(runners, rounds=5, **kw):
    calls.append(rounds)
    first = len(calls) == 1
    return {n: [(0.001 if first else 0.01) if n == "xla" else 0.01] * rounds
            for n in runners}

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=3))
  assert calls == [1, 3]  # not screened out at 10x in the first call: timed, and equal
  assert result.winner == "xla" and result.ratios["t_transposed"] == pytest.approx(1.0)


def test_time_budget_bounds_a_bucket():
  spec = _spec()
  with h.registered("t_transposed", "t_wrong"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed", "t_wrong"),
                                options=_tuner.TuneOptions(budget_s=1e-9))
  assert set(result.skipped) == {"t_transposed", "t_wrong"}
  assert result.winner == "xla"


def test_tune_result_round_trips_and_validates():
  spec = _spec()
  with h.registered("t_transposed", "t_boom"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed", "t_boom"),
                                options=_tuner.TuneOptions(rounds=2))
    value = json.loads(json.dumps(result.to_value()))
    _registry.validate_cache_value(value, "conv")
    assert _tuner.TuneResult.from_value(value) == result
    assert value["measured_at"] and value["tuning_s"] > 0
    assert set(value["timings"]) == {"xla", "t_transposed"}
  for bad in ({**value, "winner": "os.system"}, {**value, "timings": {"xla": "fast"}},
              {**value, "tuning_s": -1}, {**value, "errors": {"x": 3}}, [1, 2]):
    with pytest.raises((TypeError, ValueError)):
      _registry.validate_cache_value(bad, "conv")


def test_cache_entry_with_unknown_kernel_reads_as_miss(tmp_path):
  cache = _cache.Cache(tmp_path)
  key = {"op": "conv", "x": 1}
  cache.put("conv", key, {"winner": "evil", "timings": {}})
  with pytest.warns(UserWarning, match="unknown conv kernel 'evil'"):
    assert cache.get("conv", key) is None


# -- the pass -------------------------------------------------------------------


def test_selection_pass_matches_plain_conv_forward_and_gradient(tmp_path, rng):
  x, w = _operands(rng)
  loss = lambda x, w: jnp.sum(jnp.sin(_conv(x, w)))
  counts = {}
  with h.isolated_selection(tmp_path), h.registered("t_transposed", "t_boom", "t_wrong"):
    f = jax.jit(_select.select_kernels(jax.value_and_grad(loss, argnums=(0, 1)),
                                       on_report=lambda r: counts.update(r.counts()), **FAST))
    got = f(x, w)
    stats = _phases.stats()
  want = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
  assert h.max_rel_err(got, want) < 1e-5
  # forward, input-gradient and weight-gradient convolutions: three buckets.
  assert sum(counts.values()) == 3 and stats.misses == 3 and stats.buckets_tuned == 3
  assert not any(k.startswith(("conv t_boom", "conv t_wrong")) for k in counts)


@pytest.mark.slow
def test_mobilenet_train_step_through_the_pass_matches(tmp_path, rng):
  params = h.mobilenet_params(rng)
  x, y = h.mobilenet_batch(rng)
  want = jax.jit(h.mobilenet_step)(params, x, y)
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    counts = {}
    tuned = jax.jit(_select.select_kernels(h.mobilenet_step, rounds=1, budget_s=2.0,
                                           on_report=lambda r: counts.update(r.counts())))
    got_tuned = tuned(params, x, y)
    assert sum(counts.values()) >= 8  # 3 forward convs + their gradients
    # Every convolution forced onto another kernel: the kernels' own maths.
    from tunedjax.autotune._hints import hint
    with hint(conv="t_transposed"):
      pinned = jax.jit(_select.select_kernels(h.mobilenet_step))(params, x, y)
  assert float(got_tuned[0]) == pytest.approx(float(want[0]), rel=1e-5)
  assert h.max_rel_err(got_tuned, want) < 1e-3
  assert h.max_rel_err(pinned, want) < 1e-3


def test_second_trace_hits_the_cache(tmp_path, rng):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    jax.jit(_select.select_kernels(_conv, **FAST))(x, w)
    first = _phases.stats()
    _tuning.default_session().forget_measured()  # read it back from the file this time
    counts = {}
    jax.jit(_select.select_kernels(_conv, on_report=lambda r: counts.update(r.counts())))(x, w)
    second = _phases.stats()
    entries = _cache.default_cache().entries("conv")
  assert (first.hits, first.misses) == (0, 1)
  assert (second.hits, second.misses) == (1, 1) and second.tuning_s == first.tuning_s
  assert len(entries) == 1
  assert list(counts) == [f"conv {entries[0].value['winner']} (hit)"]


def test_pow2_buckets_share_one_entry(tmp_path, rng):
  with h.isolated_selection(tmp_path, kernel={"bucket": "pow2"}), h.registered("t_transposed"):
    for size in (5, 7, 8):
      x, w = _operands(rng, lhs=(2, size, size, 4))
      out = jax.jit(_select.select_kernels(_conv, **FAST))(x, w)
      np.testing.assert_allclose(out, _conv(x, w), rtol=1e-5, atol=1e-5)
    stats = _phases.stats()
  assert (stats.hits, stats.misses, stats.buckets_tuned) == (2, 1, 1)


def test_only_xla_applicable_needs_no_lookup(tmp_path, rng):
  # A conv with batch groups: no built-in alternative handles it on CPU here,
  # unless one does; then it must be applicable and the lookup happens.
  x, w = _operands(rng)
  spec = ConvSpec.from_arrays(x, w, dimension_numbers=h.DN, padding="SAME")
  with h.isolated_selection(tmp_path):
    counts = {}
    names = [k.name for k in _registry.applicable_kernels(spec, "cpu")]
    with _registry_only_xla():
      jax.jit(_select.select_kernels(_conv, on_report=lambda r: counts.update(r.counts())))(x, w)
    assert counts == {"conv xla (only xla)": 1} and _phases.stats().misses == 0
  assert names[0] == "xla"


class _registry_only_xla:
  """Makes every non-xla conv kernel inapplicable for a block."""

  def __enter__(self):
    self.saved = {k.name: k for k in _registry.kernels("conv") if k.name != "xla"}
    for k in self.saved.values():
      _registry.register_kernel("conv", k.name, k.fn, applicable=lambda s, p: False,
                                replace=True)

  def __exit__(self, *exc):
    for k in self.saved.values():
      _registry.register_kernel("conv", k.name, k.fn, applicable=k.applicable, replace=True)


def test_kernel_pass_composes_with_rewrite_transform_and_vmap(tmp_path, rng):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    from tunedjax.autotune._hints import hint
    with hint(conv="t_transposed"):
      f = rewrite.transform(_conv, _select.kernel_pass())
      batched = jax.vmap(f, in_axes=(None, 0))(x, jnp.stack([w, 2 * w]))
  np.testing.assert_allclose(batched[1], 2 * _conv(x, w), rtol=1e-5, atol=1e-5)


# -- a restart -----------------------------------------------------------------------

_RESTART_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    import tunedjax as tj
    from tunedjax.autotune import _phases, _select
    tj.set_config({"cache": {"dir": sys.argv[1]}})
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 6, 6, 8)).astype(np.float32))
    w1 = jnp.asarray(rng.normal(size=(1, 1, 8, 8)).astype(np.float32))
    w3 = jnp.asarray(rng.normal(size=(3, 3, 8, 8)).astype(np.float32))
    def loss(x, w1, w3):
      dn = ("NHWC", "HWIO", "NHWC")
      h = lax.conv_general_dilated(x, w1, (1, 1), "VALID", dimension_numbers=dn)
      h = lax.conv_general_dilated(h, w3, (1, 1), "SAME", dimension_numbers=dn)
      return jnp.sum(h ** 2)
    step = jax.jit(_select.select_kernels(jax.grad(loss, argnums=(1, 2)), rounds=2, budget_s=5))
    jax.block_until_ready(step(x, w1, w3))
    s = _phases.stats()
    print(json.dumps({"hits": s.hits, "misses": s.misses, "tuning_s": s.tuning_s,
                      "hit_rate": s.hit_rate}))
""")


@pytest.mark.slow
def test_restart_spends_no_time_tuning(tmp_path):
  script = tmp_path / "restart.py"
  script.write_text(_RESTART_SCRIPT)
  env = processes.cpu_env()
  runs = []
  for _ in range(2):
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")],
                          capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
  first, second = runs
  assert first["misses"] >= 2 and first["hits"] == 0 and first["tuning_s"] > 0
  assert second == {"hits": first["misses"], "misses": 0, "tuning_s": 0.0, "hit_rate": 1.0}
  assert len(list(pathlib.Path(tmp_path / "cache").glob("*.json"))) == 1


def test_a_kernel_failing_at_trace_time_falls_back_to_xla(tmp_path, rng, caplog):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path), h.registered("t_boom"):
    from tunedjax.autotune._hints import hint
    counts = {}
    with hint(conv="t_boom"), caplog.at_level(logging.WARNING, logger="tunedjax.autotune"):
      out = jax.jit(_select.select_kernels(_conv, on_report=lambda r: counts.update(r.counts())))(
          x, w)
  np.testing.assert_allclose(out, _conv(x, w), rtol=1e-6)
  assert "conv t_boom (failed at trace)" in counts
  assert any("could not be applied" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("ratio, rounds_timed", [(0.1, 1), (3.0, 1), (0.85, 5)])  # + the screening call
def test_timing_stops_early_only_when_the_choice_is_clear(monkeypatch, ratio, rounds_timed):
  spec = _spec()

  def fake_timer(runners, rounds=5, stop=None, **kw):
    times = {n: [] for n in runners}
    for r in range(rounds):
      for n in runners:
        times[n].append(1.0 if n == "xla" else ratio)
      if stop is not None and r + 1 < rounds and stop(times):
        break
    return times

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=5))
  assert len(result.timings["xla"]) == rounds_timed
  assert result.winner == ("t_transposed" if ratio < 0.9 else "xla")


@pytest.mark.parametrize("warm, calls_expected", [(False, [1, 3]), (True, [1])])
def test_a_warm_family_s_default_tells_from_a_shorter_first_call(monkeypatch, warm, calls_expected):
  # xla's first call takes 50 ms, the candidate's 2 ms: decisive only once the
  # family has made a timed call in this process (then one-time costs are a fresh
  # executable's, a few ms); its first timed call may carry the process's first
  # convolution's (~60 ms), so it is confirmed by rounds.
  spec = _spec()
  calls = []

  def fake_timer(runners, rounds=5, **kw):
    calls.append(rounds)
    return {n: [0.05 if n == "xla" else 0.002] * rounds for n in runners}

  monkeypatch.setattr(_tuning, "time_interleaved", fake_timer)
  monkeypatch.setattr(_tuner, "_WARM", {("cpu", "conv")} if warm else set())
  with h.registered("t_transposed"):
    result = _tuner.tune_bucket(spec, _candidates(spec, "t_transposed"),
                                options=_tuner.TuneOptions(rounds=3))
  assert calls == calls_expected and result.winner == "t_transposed"
  assert ("cpu", "conv") in _tuner._WARM  # pylint: disable=protected-access
