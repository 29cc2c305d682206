"""The causal block-skipping kernels (``blocked_causal_*``) against JAX's attention in float64.

Query block ``i`` attends key blocks ``0..i`` only: checked against the float64
reference, forward and the gradients of query, key and value, on lengths that
are and are not multiples of the block, with fewer keys than queries and more
(JAX's causal mask is top-left aligned), grouped heads and bfloat16; and that
the schedule visits each unmasked block pair once and the masked ones never.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tunedjax as tj
from tunedjax import autotune
from tunedjax.ops.attention import _kernels as K
from tunedjax.ops.attention._spec import AttentionSpec

from .helpers import draw, kernel_call, reference64, rel, vjp_of

# (output, gradients) bounds relative to the largest reference value, as test_kernels'.
BOUNDS = {"float32": (2e-5, 2e-4), "bfloat16": (3e-2, 8e-2)}


def _check(block, q, k, v, ct, *, dtype="float32", scale=None):
  want, want_grads = reference64(q, k, v, None, None, ct, is_causal=True, scale=scale)
  out, grads = vjp_of(kernel_call(K.blocked_causal(block)), q, k, v, None, None, ct,
                      is_causal=True, scale=scale)
  fwd_bound, grad_bound = BOUNDS[dtype]
  assert out.dtype == q.dtype and out.shape == q.shape
  assert rel(out, want) < fwd_bound
  for name, got, w, x in zip(("dq", "dk", "dv"), grads, want_grads, (q, k, v)):
    assert got.dtype == x.dtype and got.shape == x.shape, name
    # With one key to attend (one query, or one key) dq and dk are 0 but for rounding:
    # errors relative to at least 0.01 (the inputs and cotangent are standard normal).
    err = np.max(np.abs(np.asarray(got, np.float64) - w))
    assert err < grad_bound * max(np.max(np.abs(w)), 1e-2), name


@pytest.mark.parametrize("t,s,kv_heads,groups", [
    (32, 32, 2, 1),   # four whole blocks of 8
    (37, 37, 2, 3),   # a partial last block, grouped heads
    (19, 37, 1, 2),   # fewer queries than keys: keys 19.. are never attended
    (37, 19, 2, 2),   # more queries than keys: queries 19.. attend every key
    (9, 1, 1, 1),     # one key: dq and dk are rounding noise around 0
])
def test_causal_kernel_matches_float64(t, s, kv_heads, groups, rng):
  q, k, v, _, _, ct = draw(rng, 2, t, s, kv_heads, groups, 8)
  _check(8, q, k, v, ct)


def test_keys_past_the_last_query_get_zero_gradients(rng):
  q, k, v, _, _, ct = draw(rng, 1, 12, 30, 1, 1, 8)
  _, (_, dk, dv) = vjp_of(kernel_call(K.blocked_causal(8)), q, k, v, None, None, ct,
                          is_causal=True)
  assert not np.any(np.asarray(dk[:, 12:])) and not np.any(np.asarray(dv[:, 12:]))
  assert np.all(np.any(np.asarray(dv[:, :12]) != 0, axis=-1))


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 50), s=st.integers(1, 50),
       kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2, 4]),
       h=st.sampled_from([4, 8]), block=st.sampled_from([8, 16]),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**16))
def test_causal_kernel_matches_float64_on_random_shapes(b, t, s, kv_heads, groups, h, block,
                                                        scale, seed):
  q, k, v, _, _, ct = draw(np.random.default_rng(seed), b, t, s, kv_heads, groups, h)
  _check(block, q, k, v, ct, scale=scale)


def test_bfloat16_within_its_bound(rng):
  q, k, v, _, _, ct = draw(rng, 1, 40, 40, 2, 2, 8, dtype=jnp.bfloat16)
  _check(8, q, k, v, ct, dtype="bfloat16")


@pytest.mark.parametrize("q_blocks,k_blocks", [(1, 1), (4, 4), (7, 7), (8, 3), (16, 16)])
def test_the_schedule_computes_each_unmasked_block_pair_once(q_blocks, k_blocks):
  # The scan's steps hold q_blocks pairs each; the pairs are those with j <= i, each once
  # (about half of all pairs), and each lane of a step writes distinct query blocks.
  sched = K._causal_schedule(q_blocks, k_blocks)  # pylint: disable=protected-access
  real = ~sched["pad"]
  pairs = sorted(zip(sched["q"][real].tolist(), sched["k"][real].tolist()))
  assert pairs == sorted((i, j) for i in range(q_blocks) for j in range(min(i + 1, k_blocks)))
  assert sched["q"].shape == (-(-len(pairs) // q_blocks), q_blocks)
  assert np.array_equal(sched["diagonal"][real], sched["q"][real] == sched["k"][real])
  for step in sched["lanes"]:
    for lane in step:
      rows = lane[lane < q_blocks]
      assert len(set(rows.tolist())) == len(rows)


@pytest.mark.slow
def test_temporaries_are_a_block_of_scores_not_the_score_matrix(rng):
  # 1,024 tokens in blocks of 64: forward+backward temporaries well below one
  # [1024, 1024] score matrix per head, and below the einsum kernel's.
  q, k, v, _, _, _ = draw(rng, 1, 1024, 1024, 2, 2, 16)
  spec = AttentionSpec.from_arrays(q, k, is_causal=True)
  both = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, spec) ** 2), argnums=(0, 1, 2))
  temp = lambda f: jax.jit(both(f)).lower(q, k, v).compile().memory_analysis(
      ).temp_size_in_bytes
  scores = 4 * 1024 * 1024 * 4  # heads x q_len x kv_len x float32
  assert temp(K.blocked_causal(64)) < 0.5 * scores < temp(K.einsum)


def test_applicable_to_causal_attention_without_bias_or_mask_from_two_blocks():
  names = lambda spec: [k.name for k in autotune.kernels("attention")
                        if k.name.startswith("blocked_causal") and k.applicable(spec, "cpu")]
  causal = AttentionSpec(1, 1024, 1024, 8, 2, 64, "float32", causal=True)
  assert names(causal) == ["blocked_causal_128", "blocked_causal_256"]
  # There, the kernels that compute every block pair are left out; not without causality.
  everything = lambda spec: [k.name for k in autotune.kernels("attention")
                             if k.applicable(spec, "cpu") and k.name != "native_flash"]
  assert everything(causal) == ["xla", "einsum", "blocked_causal_128", "blocked_causal_256"]
  assert everything(AttentionSpec(1, 1024, 1024, 8, 8, 64, "float32", causal=True,
                                  mask_shape=(1, 1, 1, 1024))) == [
      "xla", "einsum", "blocked_128", "blocked_256", "blocked_512", "query_chunked"]
  assert names(AttentionSpec(1, 300, 1024, 8, 8, 64, "bfloat16", causal=True)) == [
      "blocked_causal_128"]
  assert names(AttentionSpec(1, 1024, 1024, 8, 2, 64, "float32")) == []  # not causal
  for extra in ({"mask_shape": (1, 1, 1, 1024)}, {"bias_shape": (1, 8, 1024, 1024),
                                                  "bias_dtype": "float32"}):
    assert names(AttentionSpec(1, 1024, 1024, 8, 8, 64, "float32", causal=True, **extra)) == []


@pytest.mark.slow
def test_registered_kernel_hinted_under_tj_jit_matches_jax(rng, tmp_path):
  q, k, v, _, _, ct = draw(rng, 1, 300, 300, 2, 2, 16)  # 2 blocks of 128 and a partial one

  def loss(q, k, v):
    return jnp.sum(tj.attention(q, k, v, is_causal=True) * ct)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  want, want_grads = reference64(q, k, v, None, None, ct, is_causal=True)
  with tj.config_context({"kernel": {"enable": True,
                                     "hints": {"attention": "blocked_causal_128"}},
                          "cache": {"dir": str(tmp_path)}}):
    f = tj.jit(grad, session=autotune.TuningSession())
    value, grads = f(q, k, v)
    choices = f.report(memory=False).last.kernel_report.of("attention")
  assert [(c.kernel, c.why) for c in choices] == [("blocked_causal_128", "hint")]
  assert abs(float(value) - float(np.sum(want * np.asarray(ct)))) < 1e-4 * float(
      np.sum(np.abs(want * np.asarray(ct))))
  for got, w in zip(grads, want_grads):
    assert rel(got, w) < 2e-4
