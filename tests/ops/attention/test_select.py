"""`tunedjax.attention` under kernel selection: tuned, cached, hinted, explained; the
memory objective; the public function's argument checks."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import _native, autotune
from tunedjax.autotune import _tuner
from tunedjax.ops.attention import _native_flash
from tunedjax.ops.attention._spec import AttentionSpec

from .helpers import rel

T = 256  # two blocks of 128: xla, einsum and (causal) blocked_causal_128 apply
# ... and native_flash (float32, causal) where the native kernels are built here.
CANDIDATES = {"xla", "einsum", "blocked_causal_128"} | (
    {"native_flash"} if _native.available(_native_flash.SOURCE) else set())


def _inputs(rng, t=T, heads=2, kv_heads=2, h=16):
  q = jnp.asarray(rng.normal(size=(1, t, heads, h)), jnp.float32)
  kv = [jnp.asarray(rng.normal(size=(1, t, kv_heads, h)), jnp.float32) for _ in range(2)]
  return q, *kv


def _loss(q, k, v):
  out = tj.attention(q, k, v, is_causal=True)
  return jnp.sum(jnp.tanh(out) * jnp.linspace(-1, 1, out.size).reshape(out.shape))


def _config(tmp_path, **kernel):
  return {"kernel": {"enable": True, **kernel}, "cache": {"dir": str(tmp_path)}}


def _attention_choices(f):
  return [(c.kernel, c.why) for c in f.report(memory=False).last.kernel_report.of("attention")]


def test_outside_kernel_selection_it_is_jax_attention(rng):
  q, k, v = _inputs(rng, t=12)
  mask = jnp.asarray(rng.random((1, 1, 1, 12)) < 0.8).at[..., 0].set(True)
  want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  np.testing.assert_array_equal(tj.attention(q, k, v, mask=mask, is_causal=True), want)
  np.testing.assert_array_equal(jax.jit(lambda *a: tj.attention(*a, mask=mask, is_causal=True))(
      q, k, v), want)
  # Unbatched [tokens, heads, head_dim], as JAX's.
  np.testing.assert_allclose(tj.attention(q[0], k[0], v[0]),
                             jax.nn.dot_product_attention(q[0], k[0], v[0]), atol=1e-6)


def test_tuned_under_tj_jit_cached_and_a_second_session_tunes_nothing(rng, tmp_path):
  q, k, v = _inputs(rng)
  grad = jax.value_and_grad(_loss, argnums=(0, 1, 2))
  want_value, want_grads = jax.jit(grad)(q, k, v)
  with tj.config_context(_config(tmp_path)):
    f = tj.jit(grad, session=autotune.TuningSession())
    value, grads = f(q, k, v)
    ((kernel, why),) = _attention_choices(f)
    assert why == "tuned" and kernel in CANDIDATES
    assert abs(float(value) - float(want_value)) <= 1e-5 * abs(float(want_value))
    for got, want in zip(grads, want_grads):
      assert rel(got, want) < 1e-4
    (row,) = [r for r in autotune.explain(_loss, q, k, v) if r.op == "attention"]
    assert row.bucket == f"attention 1x{T}x{T} h2/2 d16 float32 causal"
    assert row.kernel == kernel and set(row.candidates) == CANDIDATES
    assert set(row.temp_bytes) == set(row.candidates) and row.temp_bytes["xla"] > 0
    # A restart: a new session reads the cache and tunes nothing.
    g = tj.jit(grad, session=autotune.TuningSession())
    g(q, k, v)
    assert _attention_choices(g) == [(kernel, "hit")]
    assert g.report(memory=False).last.tuning_s == 0
    # explain traces afresh each time (make_jaxpr's own trace cache would skip the call).
    assert [r.kernel for r in autotune.explain(_loss, q, k, v) if r.op == "attention"] == [kernel]
  (entry,) = autotune.Cache(tmp_path).entries("attention")
  assert entry.value["winner"] == kernel


def test_hint_is_honoured_and_a_hint_that_does_not_apply_warns(rng, tmp_path):
  q, k, v = _inputs(rng)
  want = jax.jit(_loss)(q, k, v)
  with tj.config_context(_config(tmp_path, hints={"attention": "blocked_causal_128"})):
    f = tj.jit(_loss, session=autotune.TuningSession())
    np.testing.assert_allclose(f(q, k, v), want, rtol=1e-5)
    assert _attention_choices(f) == [("blocked_causal_128", "hint")]
  with tj.config_context(_config(tmp_path, hints={"attention": "pallas_gpu"})):
    g = tj.jit(_loss, session=autotune.TuningSession())
    with pytest.warns(autotune.HintWarning, match="attention='pallas_gpu' does not apply"):
      g(q[:, :64], k[:, :64], v[:, :64])  # below two blocks: only xla and einsum apply
  # Hints are checked against the registered families when they are used.
  with tj.config_context(_config(tmp_path, hints={"atention": "blocked_128"})):
    h = tj.jit(_loss, session=autotune.TuningSession())
    with pytest.raises(tj.AutotuneError, match="unknown op family 'atention'.*'attention'"):
      h(q, k, v)


def test_pow2_bucket_rounds_lengths_and_batch_only():
  from tunedjax.ops.attention._family import attention_key
  spec = AttentionSpec(3, 1000, 700, 8, 2, 64, "bfloat16", causal=True,
                       mask_shape=(3, 1, 1, 700))
  key = attention_key(spec, "pow2")
  assert (key["batch"], key["q_len"], key["kv_len"]) == (4, 1024, 1024)
  assert (key["heads"], key["kv_heads"], key["head_dim"]) == (8, 2, 64)
  assert (key["mask"], key["mask_axes"], key["causal"]) == ("bool", "b..s", True)
  assert attention_key(spec, "exact")["kv_len"] == 700
  with pytest.raises(tj.ConfigError, match="kernel.bucket"):
    attention_key(spec, "pow3")


# -- the memory objective --------------------------------------------------------------


def test_memory_objective_rule_on_synthetic_timings():
  ratios = {"xla": 1.0, "einsum": 0.95, "blocked_256": 0.62, "blocked_512": 0.58,
            "query_chunked": 0.63}
  temps = {"xla": 64 << 20, "einsum": 60 << 20, "blocked_256": 6 << 20,
           "blocked_512": 12 << 20, "query_chunked": 5 << 20}
  assert _tuner.choose(ratios, temps)[0] == "blocked_512"  # time: the fastest
  # memory: within 10% of 0.58 (<= 0.638): blocked_256, blocked_512, query_chunked.
  winner, reason = _tuner.choose(ratios, temps, objective="memory")
  assert winner == "query_chunked" and "fewest temporaries" in reason
  # The fastest stays when nothing near it is smaller; xla competes too.
  assert _tuner.choose({"xla": 1.0, "einsum": 0.97}, {"xla": 1, "einsum": 9},
                       objective="memory")[0] == "xla"
  assert _tuner.choose({"xla": 1.0, "einsum": 0.5}, {"xla": 1, "einsum": 9},
                       objective="memory")[0] == "einsum"  # xla is 2x slower: out
  # Without temporaries for every near candidate: the time rule.
  assert _tuner.choose(ratios, {"xla": 1}, objective="memory")[0] == "blocked_512"
  with pytest.raises(tj.TunedJaxError, match="objective"):
    _tuner.TuneOptions(objective="speed")
  with pytest.raises(tj.ConfigError, match="'time' or 'memory'"):
    tj.set_config({"kernel": {"objective": "fast"}})


def test_memory_objective_chooses_by_temporaries_under_tj_jit(rng, tmp_path):
  q, k, v = _inputs(rng)
  with tj.config_context(_config(tmp_path, objective="memory")):
    f = tj.jit(jax.grad(_loss), session=autotune.TuningSession())
    f(q, k, v)
    ((kernel, why),) = _attention_choices(f)
    (row,) = [r for r in autotune.explain(_loss, q, k, v) if r.op == "attention"]
  assert why == "tuned" and row.kernel == kernel
  (entry,) = autotune.Cache(tmp_path).entries("attention")
  assert entry.key["objective"] == "memory"
  value = entry.value
  assert set(value["temp_bytes"]) == CANDIDATES
  # The blocked kernel holds one [256, 128] group of scores, xla the whole [256, 256].
  assert value["temp_bytes"]["blocked_causal_128"] < value["temp_bytes"]["xla"]
  want = _tuner.choose({n: r for n, r in value["ratios"].items() if r <= _tuner.SCREEN_FACTOR},
                       value["temp_bytes"], objective="memory")[0]
  assert kernel == want


# -- argument checks ---------------------------------------------------------------------


@pytest.mark.parametrize("call,match", [
    (lambda q, kv: tj.attention(q[0, 0], kv, kv), r"query must be \[batch, q_len"),
    (lambda q, kv: tj.attention(q, kv[0], kv), r"key must have query's rank 4"),
    (lambda q, kv: tj.attention(q, kv, kv[:, :3]), r"value's shape \(1, 3, 2, 8\) must equal"),
    (lambda q, kv: tj.attention(q, kv.astype(jnp.bfloat16), kv), "key's dtype bfloat16"),
    (lambda q, kv: tj.attention(q.astype(jnp.int32), kv, kv),
     "query's dtype must be one of 'float16', 'bfloat16', 'float32' or 'float64', got int32"),
    (lambda q, kv: tj.attention(q, kv[..., :4], kv[..., :4]), "batch and head_dim axes"),
    (lambda q, kv: tj.attention(q[:, :, :3], kv, kv),
     "3 heads must be a multiple of key/value's 2 heads"),
    (lambda q, kv: tj.attention(q, kv, kv, mask=jnp.ones((1, 1, 1, 6))), "boolean"),
    (lambda q, kv: tj.attention(q, kv, kv, mask=jnp.ones((1, 1, 1, 7), bool)),
     r"does not broadcast to \[batch, heads, q_len, kv_len\] = \[1, 4, 5, 6\]: axis 3 is 7"),
    (lambda q, kv: tj.attention(q, kv, kv, bias=jnp.ones((1, 1, 1, 1, 6))),
     "at most 4 dimensions"),
    (lambda q, kv: tj.attention(q, kv, kv, bias=jnp.ones((1, 1, 1, 6), jnp.int32)),
     "bias must be a float array"),
    (lambda q, kv: tj.attention(q, kv, kv, scale="0.1"), "scale must be a finite number"),
    (lambda q, kv: tj.attention(q, kv, kv, is_causal="yes"), "is_causal must be True or False"),
    (lambda q, kv: tj.attention(q, kv, kv[:, :, :, :, None]), "value must have query's rank"),
    (lambda q, kv: tj.attention(object(), kv, kv), "query must be an array"),
])
def test_bad_arguments_raise_clear_errors(call, match):
  q = jnp.ones((1, 5, 4, 8), jnp.float32)
  kv = jnp.ones((1, 6, 2, 8), jnp.float32)
  with pytest.raises(tj.AutotuneError, match=match):
    call(q, kv)


def test_no_warning_and_reference_for_float16_on_cpu(rng):
  q = jnp.asarray(rng.normal(size=(1, 8, 2, 8)), jnp.float16)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = jax.jit(lambda q: tj.attention(q, q, q, is_causal=True))(q)
  want = jax.nn.dot_product_attention(q.astype(jnp.float32), q.astype(jnp.float32),
                                      q.astype(jnp.float32), is_causal=True)
  assert out.dtype == jnp.float16 and rel(out, want) < 5e-3


def test_the_report_shows_the_temporaries_each_tuned_bucket_saves(rng, tmp_path):
  q, k, v = _inputs(rng)
  grad = jax.grad(_loss, argnums=(0, 1, 2))
  with tj.config_context(_config(tmp_path)):
    for why in ("tuned", "hit"):  # tuned now, then read from the cache by a new session
      f = tj.jit(grad, session=autotune.TuningSession())
      f(q, k, v)
      report = f.report(memory=False).last.kernel_report
      ((kernel, got_why),) = _attention_choices(f)
      assert got_why == why
      (temps,) = report.temporaries
      record = autotune.Cache(tmp_path).entries("attention")[0].value["temp_bytes"]
      assert temps.bucket.startswith(f"attention 1x{T}x{T}") and temps.kernel == kernel
      assert (temps.default_bytes, temps.kernel_bytes) == (record["xla"], record[kernel])
      assert report.temp_bytes_saved == record["xla"] - record[kernel]
