"""Part (b) of `benchmarks/gpu.py`: causal self-attention, forward and backward.

bfloat16 ``[batch, tokens, heads, head_dim]``, `jax.value_and_grad` of
``sum(out * g)`` with respect to query, key and value, at each length.
Workers: ``attention.jax`` (the hand-written attention under `jax.jit` and
``jax.nn.dot_product_attention(implementation="cudnn")``, interleaved per
length), ``attention.tj_attention`` (`tj.jit` over ``tj.attention(is_causal=True)``)
and ``attention.tj_hand_written`` (`tj.jit` over the hand-written one), each
`tj.jit` worker with ``set_config(None)`` and an empty tuning cache. The
PyTorch row is in `_gpu_torch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tunedjax as tj
from _gpu_measure import Deadline, Runner, Sizes, compare, configure
from _gpu_names import CUDNN, HAND, TJ_ATTENTION, TJ_HAND
from harness.workers import emit, say



def hand_written(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal attention as tutorials write it: einsum, a `jnp.tril` mask, softmax, einsum."""
  t = q.shape[1]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def tuned(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  return tj.attention(q, k, v, is_causal=True)


def forward_backward(attention: Callable[..., jax.Array]) -> Callable[..., Any]:
  """``(q, k, v, g) -> (sum(out * g), (dq, dk, dv))``."""
  def fn(q, k, v, g):
    def loss(q, k, v):
      return jnp.sum(attention(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  return fn


def flops(sizes: Sizes, tokens: int) -> float:
  """Forward and backward of causal attention: 3.5 x the forward's 4 B N T^2 D / 2
  (FlashAttention's convention: the backward counted as 2.5 forwards)."""
  forward = 4 * sizes.attn_batch * sizes.attn_heads * tokens**2 * sizes.attn_head_dim / 2
  return 3.5 * forward


def operands(sizes: Sizes, tokens: int) -> tuple[jax.Array, ...]:
  rng = np.random.default_rng(tokens)
  shape = (sizes.attn_batch, tokens, sizes.attn_heads, sizes.attn_head_dim)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
               for _ in range(4))


def worker(which: str, sizes: Sizes, deadline: Deadline) -> None:
  """``jax``: the hand-written attention and cuDNN's (its first call is the shorter: first),
  interleaved per length; else `tj.jit` with ``set_config(None)`` over ``tj.attention``
  (``tj_attention``) or over the hand-written one."""
  if which == "jax":
    variants = {CUDNN: cudnn, HAND: hand_written}
    if jax.default_backend() != "gpu":
      del variants[CUDNN]
      emit("row", variant=CUDNN, note="not run: cuDNN attention needs a GPU")
      say(f"  {CUDNN}: not run (needs a GPU)")
    jit = jax.jit
  else:
    variants = {TJ_ATTENTION: tuned} if which == "tj_attention" else {TJ_HAND: hand_written}
    configure(None, sizes)
    jit = tj.jit
  for tokens in sizes.attn_tokens:
    builds = {n: (lambda a=a, t=tokens: Runner(jit(forward_backward(a)), *operands(sizes, t)))
              for n, a in variants.items()}
    compare(builds, HAND, deadline, sizes, tuned=(TJ_ATTENTION, TJ_HAND), tokens=tokens,
            last=lambda name, runner: {"value": float(runner.out[0])},
            rate=("tflops", flops(sizes, tokens) / 1e12))


WORKERS = {w: (lambda s, d, w=w: worker(w, s, d)) for w in ("jax", "tj_attention",
                                                           "tj_hand_written")}
