"""Attention written by hand reaches ``native_flash`` through the attention pattern.

A function of einsums (or ``@``) and a softmax, its scores scaled and masked
(causal by ``jnp.tril`` or an ``iota`` comparison under ``jnp.where``, or a
key-padding mask given as an input), under `tj.jit` with a hint pinning
attention to ``native_flash``: the site is found, its forward (and, under
``jax.grad`` inside the ``tj.jit``, its backward) runs the C++ handlers (the
FFI custom calls are in the rewritten program, with the causal attribute the
mask implies), and the values equal the untransformed function's, forward and
gradient, on random data, in float32 and bfloat16.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import _native
from tunedjax.ops.attention import _native_flash as nf

needs_native = pytest.mark.skipif(not _native.available(nf.SOURCE),
                                  reason="no native library here (no C++ compiler?)")

# Largest difference over the largest value: (forward, gradients), by dtype. In bfloat16
# the function as written rounds its probabilities to bfloat16, the kernel never does.
# Measured over these cases (and the others of CASES x dtypes) with seeds 0-3: float32
# <= 7.5e-7 forward, <= 6.2e-7 gradients; bfloat16 <= 1.3e-2 and <= 2.1e-2.
BOUNDS = {"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 5e-2)}


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def einsum_tril(q, k, v):
  """[b, t, h, d] einsums, the scale a division, causal by ``jnp.tril`` under ``where``."""
  t, s = q.shape[1], k.shape[1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
  logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def matmul_iota(q, k, v):
  """PyTorch's layout ([b, h, t, d], ``@``), causal by an ``iota`` comparison, the
  softmax in float32 and the probabilities cast back."""
  q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  t, s = q.shape[2], k.shape[2]
  logits = (q @ k.swapaxes(-1, -2)).astype(jnp.float32) * q.shape[-1] ** -0.5
  i = jax.lax.broadcasted_iota(jnp.int32, (t, s), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (t, s), 1)
  logits = jnp.where(i >= j, logits, -jnp.inf)
  out = jax.nn.softmax(logits, axis=-1).astype(v.dtype) @ v
  return out.transpose(0, 2, 1, 3)


def einsum_padding(q, k, v, keep):
  """Not causal; `keep` ``[b, 1, 1, s]`` (an input of the program) masks keys."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / np.sqrt(q.shape[-1])).astype(q.dtype)
  logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


CASES = {"einsum_tril": (einsum_tril, True), "matmul_iota": (matmul_iota, True),
         "einsum_padding": (einsum_padding, False)}


def _args(name, dtype, rng):
  # 100 tokens: a whole block of 64 and a tail; 4 heads of 32.
  b, t, h, d = 2, 100, 4, 32
  q, k, v, ct = (jnp.asarray(rng.normal(size=(b, t, h, d)), dtype) for _ in range(4))
  if name != "einsum_padding":
    return (q, k, v), ct
  keep = rng.random((b, 1, 1, t)) < 0.7
  keep[..., 0] = True
  return (q, k, v, jnp.asarray(keep)), ct


def _handlers(f, args):
  """The FFI targets the rewritten program calls, and the causal attribute of each."""
  text = str(f.jaxpr(*args))
  targets = re.findall(r"target_name=tunedjax_(TjFlashAttn\w+)", text)
  causal = [int(c) for c in re.findall(r"\('causal', np\.int64\((\d)\)\)", text)]
  return targets, causal


@needs_native
@pytest.mark.parametrize("name,dtype", [("einsum_tril", "float32"), ("einsum_tril", "bfloat16"),
                                        ("matmul_iota", "bfloat16"),
                                        ("einsum_padding", "float32")])
def test_hand_written_attention_runs_native_flash(tmp_path, rng, name, dtype):
  fn, causal = CASES[name]
  args, ct = _args(name, dtype, rng)
  fwd_bound, grad_bound = BOUNDS[dtype]
  suffix = nf._SUFFIX[dtype]

  def loss(q, k, v, *rest):
    return jnp.sum((fn(q, k, v, *rest) * ct).astype(jnp.float32))

  grad = jax.grad(loss, argnums=(0, 1, 2))
  config = {"cache": {"dir": str(tmp_path)}, "mixed_precision": {"enable": False},
            "kernel": {"enable": True, "hints": {"attention": "native_flash"}}}
  with tj.config_context(config):
    forward, inside = tj.jit(fn), tj.jit(grad)
    out, grads = forward(*args), inside(*args)
    reports = [f.report(memory=False).last.kernel_report for f in (forward, inside)]
    calls = [_handlers(forward, args), _handlers(inside, args)]
  assert [[(m.op, m.kernel, m.replaced) for m in r.matched] for r in reports] == [
      [("attention", "native_flash", "forward")],
      [("attention", "native_flash", "forward+backward")]]
  assert calls[0] == ([f"TjFlashAttnFwd{suffix}"], [int(causal)])
  assert calls[1] == ([f"TjFlashAttnFwd{suffix}", f"TjFlashAttnBwd{suffix}"], [int(causal)] * 2)

  assert out.dtype == dtype
  assert _rel(out, jax.jit(fn)(*args)) < fwd_bound
  for got, want in zip(grads, jax.jit(grad)(*args)):
    assert got.dtype == dtype
    assert _rel(got, want) < grad_bound
