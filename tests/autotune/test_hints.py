"""Kernel hints: `autotune.hint` and the config's ``kernel.hints``."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tunedjax as tj
from tests.autotune import selection_helpers as h
from tunedjax._errors import TunedJaxError
from tunedjax._tuning import _cache
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.autotune import _bucket, _hints, _phases, _registry, _select
from tunedjax.autotune._hints import HintWarning, hint


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=h.DN)


def _operands(rng):
  return (jnp.asarray(rng.normal(size=(2, 6, 6, 4)).astype(np.float32)),
          jnp.asarray(rng.normal(size=(3, 3, 4, 4)).astype(np.float32)))


def _trace(f, *args, **kw):
  counts = {}
  out = jax.jit(_select.select_kernels(f, rounds=1, budget_s=3.0,
                                       on_report=lambda r: counts.update(r.counts()), **kw))(*args)
  return counts, out


def test_hint_pins_the_kernel_without_tuning(tmp_path, rng):
  x, w = _operands(rng)
  loss = lambda x, w: jnp.sum(_conv(x, w) ** 2)
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    with hint(conv="t_transposed"):
      counts, grads = _trace(jax.grad(loss, argnums=(0, 1)), x, w)
    stats = _phases.stats()
  assert counts == {"conv t_transposed (hint)": 3}
  assert (stats.hits, stats.misses, stats.buckets_tuned) == (0, 0, 0)
  assert h.max_rel_err(grads, jax.grad(loss, argnums=(0, 1))(x, w)) < 1e-5


def test_hint_beats_a_cached_winner(tmp_path, rng):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    spec = ConvSpec.from_arrays(x, w, padding="SAME", dimension_numbers=h.DN)
    key = _bucket.bucket_key(spec, _registry.applicable_kernels(spec, "cpu"))
    _cache.default_cache().put("conv", key, {"winner": "t_transposed", "timings": {}})
    assert _trace(_conv, x, w)[0] == {"conv t_transposed (hit)": 1}
    with hint(conv="xla"):
      assert _trace(_conv, x, w)[0] == {"conv xla (hint)": 1}


def test_config_hints_and_context_hints_nest(tmp_path, rng):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path, kernel={"hints": {"conv": "xla"}}), \
      h.registered("t_transposed"):
    assert _trace(_conv, x, w)[0] == {"conv xla (hint)": 1}
    with hint(conv="t_transposed"):
      assert _hints.active_hints()["conv"] == "t_transposed"
      assert _trace(_conv, x, w)[0] == {"conv t_transposed (hint)": 1}
      with hint(conv="xla"):
        assert _trace(_conv, x, w)[0] == {"conv xla (hint)": 1}
      assert _hints.active_hints()["conv"] == "t_transposed"
    assert _hints.active_hints()["conv"] == "xla"


def test_inapplicable_hint_warns_once_and_selects_normally(tmp_path, rng):
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path), h.registered("t_never"):
    with hint(conv="t_never"):
      with pytest.warns(HintWarning, match="t_never.*does not apply"):
        counts, out = _trace(_conv, x, w)
      with warnings.catch_warnings():
        warnings.simplefilter("error", HintWarning)
        _trace(_conv, x, w)  # the same bucket again: no second warning
  assert not any("t_never" in k for k in counts)
  assert list(counts)[0].endswith("(tuned)")
  np.testing.assert_allclose(out, _conv(x, w), rtol=1e-5, atol=1e-5)


def test_unknown_kernel_or_op_lists_the_known_ones(tmp_path, rng):
  with pytest.raises(TunedJaxError, match=r"unknown conv kernel 'ff'.*Known conv kernels: 'xla'"):
    with hint(conv="ff"):
      pass
  with pytest.raises(TunedJaxError, match=r"unknown op family 'matmul'.*'conv'"):
    with hint(matmul="xla"):
      pass
  x, w = _operands(rng)
  with h.isolated_selection(tmp_path, kernel={"hints": {"conv": "no_such"}}):
    with pytest.raises(TunedJaxError, match="config kernel.hints: unknown conv kernel 'no_such'"):
      _trace(_conv, x, w)


def test_jit_option_retraces_when_the_hint_changes(tmp_path, rng):
  x, w = _operands(rng)
  traces = []
  with h.isolated_selection(tmp_path), h.registered("t_transposed"):
    f = _select.select_kernels(_conv, jit=True, rounds=1, budget_s=3.0,
                               on_report=lambda r: traces.append(dict(r.counts())))
    with hint(conv="xla"):
      f(x, w)
      f(x, w)
    with hint(conv="t_transposed"):
      out = f(x, w)
  assert traces == [{"conv xla (hint)": 1}, {"conv t_transposed (hint)": 1}]
  np.testing.assert_allclose(out, _conv(x, w), rtol=1e-5, atol=1e-5)


def test_config_hints_are_scoped():
  with tj.config_context({"kernel": {"hints": {"conv": "xla"}}}):
    assert dict(_hints.active_hints()) == {"conv": "xla"}
  with tj.config_context({"kernel": {"hints": {}}}):
    assert dict(_hints.active_hints()) == {}


def test_config_hints_are_checked_against_the_registry_when_used():
  """The config module knows no op family: an unknown one is reported on use, with the known."""
  from tunedjax.autotune import _hints
  with tj.config_context({"kernel": {"hints": {"conv2d": "im2col"}}}):  # accepted here
    with pytest.raises(tj.AutotuneError, match=r"unknown op family 'conv2d'.*did you mean 'conv'"):
      _hints.active_hints()
  with tj.config_context({"kernel": {"hints": {"conv": "im2cool"}}}):
    with pytest.raises(tj.AutotuneError, match=r"unknown conv kernel 'im2cool'.*'im2col'"):
      _hints.active_hints()
