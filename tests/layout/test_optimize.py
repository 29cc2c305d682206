"""optimize(): reports, explain, and measure mode with its caches."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import tunedjax as tj
from tunedjax import _tuning
from tunedjax import layout, rewrite
from tunedjax._tuning import _cache
from tunedjax.layout import _measure


def net(x, w):
  y = jax.nn.relu(lax.conv(x, w, (1, 1), "SAME"))
  return lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


@pytest.fixture
def args(rng):
  return (jnp.asarray(rng.normal(size=(2, 3, 8, 8)), jnp.float32),
          jnp.asarray(rng.normal(size=(4, 3, 3, 3)), jnp.float32))


@pytest.fixture
def tmp_cache(tmp_path):
  _tuning.default_session().forget_measured()
  with tj.config_context({"cache": {"dir": str(tmp_path)}}):
    yield _cache.default_cache()
  _tuning.default_session().forget_measured()


def test_report_after_a_call(args):
  opt = layout.optimize(net)
  with pytest.raises(tj.TunedJaxError, match="call the function first"):
    opt.report()
  opt(*args)
  report = opt.report()
  assert report.decision == "relaid" and report.target == "NHWC"  # auto on CPU
  assert report.reason == "float32 convolutions on cpu prefer NHWC"
  assert report.counts["convolutions re-laid"] == 1
  assert report.counts["pooling ops re-laid"] == 1
  assert report.signature == "float32[2,3,8,8], float32[4,3,3,3]"
  text = str(report)
  assert "re-laid to NHWC" in text and "convolutions re-laid: 1" in text
  assert opt.signatures() == [report.signature]
  assert "layout.optimize(net" in repr(opt)


def test_explain_counts_transposes_exactly(args):
  report = layout.explain(net, *args, target="NHWC")
  assert (report.transposes_before, report.transposes_after) == (0, 3)  # x, w in; y out
  assert "transposes in the jaxpr: 0 before, 3 after" in str(report)


def test_measure_mode_decides_caches_and_keeps_the_function(args, tmp_cache):
  opt = layout.optimize(net, mode="measure")
  got = opt(*args)
  assert jnp.allclose(got, net(*args), rtol=1e-5, atol=1e-6)
  report = opt.report()
  assert report.mode == "measure" and not report.cached
  assert report.decision in ("relaid", "original")
  assert set(report.seconds) == {"original", "relaid"}
  assert all(s > 0 for s in report.seconds.values())
  assert report.reason.startswith("measured:")
  # the same function again: decided in this process, not measured again
  again = layout.optimize(net, mode="measure")
  again(*args)
  assert again.report().cached and again.report().decision == report.decision
  # after a restart (memory cleared): read from the persistent cache
  _tuning.default_session().forget_measured()
  entries = tmp_cache.entries("layout")
  assert len(entries) == 1 and entries[0].key["target"] == "NHWC"
  third = jax.jit(layout.optimize(net, mode="measure"))
  third(*args)
  assert third.__wrapped__.report().cached


def test_measure_mode_under_jit_and_a_stored_original_decision(args, tmp_cache):
  closed = jax.make_jaxpr(net)(*args)
  key = _measure.cache_key(closed, "NHWC")
  tmp_cache.put("layout", key, {"choice": "original", "target": "NHWC",
                                "seconds": {"original": 1.0, "relaid": 2.0}})
  opt = layout.optimize(net, mode="measure")
  jaxpr = jax.make_jaxpr(opt)(*args)
  report = opt.report()
  assert report.decision == "original" and report.cached
  assert "not faster (2.00x" in report.reason
  assert rewrite.count_primitives(jaxpr)["transpose"] == 0          # runs as written
  assert jnp.allclose(jax.jit(opt)(*args), net(*args))


def test_invalid_stored_decision_is_a_miss(args, tmp_cache):
  closed = jax.make_jaxpr(net)(*args)
  tmp_cache.put("layout", _measure.cache_key(closed, "NHWC"),
                {"choice": "fastest", "target": "NHWC", "seconds": {}})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert _measure.lookup(closed, "NHWC") is None
  assert any("choice" in str(w.message) for w in caught)
  with pytest.raises(ValueError, match="'relaid', 'original'"):
    _measure.validate({"choice": "x", "target": "NHWC"})
  with pytest.raises(ValueError, match="target"):
    _measure.validate({"choice": "relaid", "target": "HWCN"})
  with pytest.raises(TypeError, match="seconds"):
    _measure.validate({"choice": "relaid", "target": "NHWC", "seconds": {"a": "1"}})


def test_measure_mode_without_convolutions_measures_nothing(tmp_cache):
  opt = layout.optimize(jnp.tanh, mode="measure")
  opt(jnp.ones(3))
  assert opt.report().decision == "unchanged"
  assert tmp_cache.entries("layout") == []


def test_random_inputs_are_random_floats_and_zero_indices():
  avals = [jax.core.ShapedArray((3, 4), jnp.float32), jax.core.ShapedArray((3,), jnp.int32),
           jax.core.ShapedArray((2,), jnp.bfloat16)]
  x, i, b = _tuning.random_inputs(avals)
  assert x.std() > 0.1 and (i == 0).all() and b.dtype == jnp.bfloat16
