"""`autotune.explain`: the cache's answer for each conv bucket of a program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from tunedjax import autotune


def _depthwise(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=x.shape[1])


def _args(rng):
  return (jnp.asarray(rng.normal(size=(2, 8, 9, 9)), jnp.float32),
          jnp.asarray(rng.normal(size=(8, 1, 3, 3)), jnp.float32))


def test_an_untuned_bucket_has_no_kernel_and_a_tuned_one_its_measurement(tmp_path, rng):
  x, w = _args(rng)
  (before,) = autotune.explain(_depthwise, x, w, cache=tmp_path)
  assert before.kernel is None and before.count == 1 and "depthwise" in before.candidates
  autotune.select_kernels(_depthwise, cache=tmp_path, rounds=2)(x, w)
  (after,) = autotune.explain(_depthwise, x, w, cache=tmp_path)
  assert after.bucket == before.bucket and after.kernel in after.candidates
  assert after.xla_ms > 0 and after.kernel_ms > 0 and after.tuning_s > 0 and after.reason
  if after.kernel != "xla":
    assert after.speedup > 1.0


def test_gradient_convolutions_are_buckets_of_their_own(tmp_path, rng):
  x, w = _args(rng)
  loss = lambda x, w: (_depthwise(x, w) ** 2).sum()
  rows = autotune.explain(jax.grad(loss, argnums=(0, 1)), x, w, cache=tmp_path)
  assert len(rows) == 3 and sum(r.count for r in rows) == 3
  assert len({r.bucket for r in rows}) == 3


def test_a_bucket_only_xla_can_run_needs_no_cache(tmp_path, rng):
  x = jnp.asarray(rng.normal(size=(2, 3, 9, 9)), jnp.int32)
  w = jnp.asarray(rng.normal(size=(4, 3, 3, 3)), jnp.int32)
  (row,) = autotune.explain(lambda x, w: lax.conv(x, w, (1, 1), "SAME"), x, w, cache=tmp_path)
  assert row.kernel == "xla" and row.candidates == ("xla",)


def test_explain_tunes_nothing(tmp_path, rng):
  x, w = _args(rng)
  autotune.explain(_depthwise, x, w, cache=tmp_path)
  assert autotune.Cache(tmp_path).entries() == []
  with pytest.raises(TypeError):
    autotune.explain(_depthwise, x, w, cache=3)
