"""A Transformer language model trained with Trainer(autotune=True): its attention is tuned.

The tiny configuration of `tunedjax.demo.TransformerLM` (2 layers, width 32,
64 tokens): every attention kernel computes the model's loss and gradients
as the unswapped model does; the Trainer tunes the attention buckets, lists
them, trains to the same losses as an untuned run, and a restart on the same
cache tunes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import tunedjax as tj
from tunedjax.ops.attention._spec import AttentionSpec
from tunedjax.demo import TransformerLM, lm_data, lm_loss

TINY = {"vocab": 32, "tokens": 64, "width": 32, "layers": 2, "heads": 4}
RTOL = 2e-5


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _tokens_for(kernel) -> int | None:
  """The shortest LM sequence (64 to 512 tokens) whose attention bucket `kernel` runs on CPU
  (blocked_512, from 1,024 keys, is the blocked code with longer blocks: left to the
  kernel tests, to keep this one short)."""
  for tokens in (64, 256, 512):
    q = jax.ShapeDtypeStruct((2, tokens, TINY["heads"], TINY["width"] // TINY["heads"]),
                             jnp.float32)
    if kernel.applicable(AttentionSpec.from_arrays(q, q, None, None, scale=None,
                                                   is_causal=True), "cpu"):
      return tokens
  return None


@pytest.mark.slow
def test_lm_loss_and_gradients_match_the_unswapped_model_with_every_kernel():
  def loss_and_grad(graphdef, batch):
    return lambda state: jax.value_and_grad(
        lambda s: lm_loss(nnx.merge(graphdef, s), batch))(state)

  ran = []
  for kernel in tj.autotune.kernels("attention"):
    tokens = _tokens_for(kernel)
    if tokens is None:  # a GPU or TPU kernel
      continue
    config = {**TINY, "tokens": tokens}
    batch = {k: jnp.asarray(v) for k, v in lm_data(1, 2, tokens, vocab=32, seed=1).items()}
    graphdef, state = nnx.split(TransformerLM(**config))
    want_loss, want_grads = jax.jit(loss_and_grad(graphdef, batch))(state)
    model = TransformerLM(**config)
    swap = tj.use_tuned_attention(model)
    tuned_graphdef, tuned_state = nnx.split(model)
    assert jax.tree.structure(tuned_state) == jax.tree.structure(state)
    name = kernel.name
    step = tj.jit(loss_and_grad(tuned_graphdef, batch))
    with tj.config_context({"kernel": {"enable": True, "hints": {"attention": name}},
                            "cache": {"dir": None}}):
      loss, grads = step(tuned_state)
    choices = step.report(memory=False).last.kernel_report.of("attention")
    assert [(c.kernel, c.why, c.count) for c in choices] == [(name, "hint", 2)], choices
    assert _rel(loss, want_loss) < RTOL, (name, tokens)
    assert _rel(_flat(grads), _flat(want_grads)) < RTOL, (name, tokens)
    assert swap.tuned == ("blocks.0.attention", "blocks.1.attention")
    ran.append(name)
  assert {"xla", "einsum"} < set(ran) and any(n.startswith("blocked") for n in ran), ran


def _fit(autotune, cache_dir):
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  # payback off: 4 steps of this tiny model could not pay back tuning its attention.
  with tj.config_context({"cache": {"dir": str(cache_dir)}, "kernel": {"payback": False}}):
    trainer = tj.Trainer(TransformerLM(**TINY), optax.sgd(0.05), lm_loss, autotune=autotune,
                         mesh=mesh, progress=False)
    return trainer.fit(lm_data(4, 2, 64, vocab=32), batch_size=2, epochs=1)


@pytest.mark.slow
def test_trainer_tunes_the_lm_attention_matches_untuned_losses_and_a_restart_tunes_nothing(
    tmp_path):
  plain = _fit(False, tmp_path)
  tuned = _fit(True, tmp_path)
  np.testing.assert_allclose(tuned.losses, plain.losses, rtol=1e-5)
  assert len(tuned.losses) == 4
  kernels = tuned.tuning["kernels"]
  attention = {k: n for k, n in kernels.items() if k.startswith("attention ")}
  assert any(k.endswith("(tuned)") for k in attention), kernels
  report = tuned.tuning["attention"]
  assert report["tuned"] == ["blocks.0.attention", "blocks.1.attention"]
  assert report["fallbacks"] == {}
  (bucket,) = report["buckets"]  # both layers: one bucket
  assert bucket["count"] == 2 and bucket["kernel"] in bucket["candidates"]
  assert "64x64" in bucket["bucket"] and "causal" in bucket["bucket"]

  again = _fit(True, tmp_path)  # a restart: a new Trainer, the same cache folder
  assert again.tuning["kernel_cache_misses"] == 0 and again.tuning["kernel_cache_hits"] > 0
  assert all(k.endswith("(hit)") for k in again.tuning["kernels"]), again.tuning["kernels"]
  assert again.tuning["attention"]["buckets"][0]["kernel"] == bucket["kernel"]
  np.testing.assert_allclose(again.losses, tuned.losses, rtol=1e-5)
