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
from _gpu_measure import (Deadline, Runner, Sizes, anatomy, configure, first_call, guarded,
                          out_of_time, steady_state, timing_fields)
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


def _row(name: str, sizes: Sizes, tokens: int, first: float, runner: Runner,
         measured: Any) -> None:
  fields: dict[str, Any] = {"tokens": tokens, "first_call_s": first,
                            "value": float(runner.out[0])}
  if measured is not None:
    fields.update(timing_fields(*measured, name))
    fields["tflops"] = flops(sizes, tokens) / (fields["ms"] / 1e3) / 1e12
  emit("row", variant=name, **fields)
  say(f"  {name}, {tokens} tokens: " + ", ".join(
      f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()))


def _variants() -> list[tuple[str, Callable[..., Any]]]:
  """cuDNN's first (its first call is the shorter), then the hand-written one."""
  if jax.default_backend() == "gpu":
    return [(CUDNN, cudnn), (HAND, hand_written)]
  emit("row", variant=CUDNN, note="not run: cuDNN attention needs a GPU")
  say(f"  {CUDNN}: not run (needs a GPU)")
  return [(HAND, hand_written)]


def worker_jax(sizes: Sizes, deadline: Deadline) -> None:
  """The hand-written attention and cuDNN's, per length: first calls, then interleaved."""
  for tokens in sizes.attn_tokens:
    args = operands(sizes, tokens)
    runners, firsts = {}, {}
    for name, attention in _variants():
      if out_of_time(f"{name}, {tokens} tokens", deadline):
        continue
      runner = Runner(jax.jit(forward_backward(attention)), *args)
      first = guarded(name, lambda n=name, r=runner: first_call(f"{n}, {tokens}", r),
                      tokens=tokens)
      if first is not None:
        runners[name], firsts[name] = runner, first
        emit("row", variant=name, tokens=tokens, first_call_s=first)
    if runners:
      base = HAND if HAND in runners else next(iter(runners))
      measured = steady_state(runners, base, deadline, sizes)
      for name, runner in runners.items():
        _row(name, sizes, tokens, firsts[name], runner, measured)


def worker_tj(which: str, sizes: Sizes, deadline: Deadline) -> None:
  """`tj.jit` with ``set_config(None)`` over ``tj.attention`` or the hand-written one."""
  name, attention = ((TJ_ATTENTION, tuned) if which == "tj_attention" else
                     (TJ_HAND, hand_written))
  configure(None, sizes)
  for tokens in sizes.attn_tokens:
    if out_of_time(f"{name}, {tokens} tokens", deadline):
      continue

    def run(tokens=tokens) -> None:
      runner = Runner(tj.jit(forward_backward(attention)), *operands(sizes, tokens))
      first = first_call(f"{name}, {tokens}", runner)
      emit("row", variant=name, tokens=tokens, first_call_s=first)
      anatomy(f"{name}, {tokens} tokens", runner.fn)
      _row(name, sizes, tokens, first, runner, steady_state({name: runner}, name, deadline,
                                                             sizes))

    guarded(name, run, tokens=tokens)


WORKERS = {"jax": worker_jax,
           "tj_attention": lambda s, d: worker_tj("tj_attention", s, d),
           "tj_hand_written": lambda s, d: worker_tj("tj_hand_written", s, d)}
