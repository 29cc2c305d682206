"""float64 attention stays float64, the softmax included; half precision keeps its
float32 softmax.

Every kernel that takes float64 (small blocks, so short lengths span several)
and `tunedjax.attention` itself, against a float64 NumPy reference, output and
gradients: JAX's own attention casts the logits to float32 before its softmax,
which shows here as an error near 1e-8 where float64 is near 1e-15.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax.ops.attention import _kernels as K

from .helpers import draw, kernel_call, reference64, rel, vjp_of

FLOAT64_BOUND = 1e-12

KERNELS = {"xla": K.xla, "einsum": K.einsum, "blocked_8": K.blocked(8),
           "blocked_causal_8": K.blocked_causal(8),
           "query_chunked_8": lambda *o: K.query_chunked_attention(8, *K.split_operands(
               tuple(o[:-1]), o[-1]), o[-1])}


def _operands(causal):
  b, t, s, kv_heads, groups, h = 2, 19, 19 if causal else 23, 2, 2, 8
  n = kv_heads * groups
  return draw(np.random.default_rng(3), b, t, s, kv_heads, groups, h, dtype=np.float64,
              bias_shape=None if causal else (b, 1, t, s),
              mask_shape=None if causal else (b, 1, 1, s), padding=True)


@pytest.mark.parametrize("causal", [False, True])
def test_kernels_keep_float64(causal):
  with jax.enable_x64(True):
    q, k, v, bias, mask, ct = _operands(causal)
    assert q.dtype == jnp.float64
    want, want_grads = reference64(q, k, v, bias, mask, ct, is_causal=causal)
    fns = {name: kernel_call(fn) for name, fn in KERNELS.items()
           if causal or name != "blocked_causal_8"}  # that one: causal, no bias or mask
    fns["tj.attention"] = lambda q, k, v, b, m, is_causal: tj.attention(
        q, k, v, b, m, is_causal=is_causal)
    for name, call in fns.items():
      out, grads = vjp_of(call, q, k, v, bias, mask, ct, is_causal=causal)
      assert out.dtype == jnp.float64, name
      assert rel(out, want) < FLOAT64_BOUND, (name, rel(out, want))
      for g, w in zip(grads, want_grads):
        assert g.dtype == jnp.float64, name
        assert rel(g, w) < FLOAT64_BOUND, (name, rel(g, w))


def _exp_dtypes(fn, *args):
  """The dtypes every `exp` in ``fn(*args)``'s jaxpr (sub-jaxprs too) computes in."""
  return {np.dtype(e.outvars[0].aval.dtype).name
          for e in tj.rewrite.iter_equations(jax.make_jaxpr(fn)(*args))
          if e.primitive.name == "exp"}


@pytest.mark.parametrize("dtype,softmax", [("float64", "float64"), ("bfloat16", "float32"),
                                           ("float16", "float32"), ("float32", "float32")])
def test_softmax_dtype(dtype, softmax):
  """Each kernel's softmax (its `exp`, forward and backward) runs in `softmax`."""
  with jax.enable_x64(True):
    q, k, v, _, _, ct = draw(np.random.default_rng(0), 1, 17, 17, 2, 1, 8, dtype=dtype)
    for name, fn in KERNELS.items():
      call = kernel_call(fn)
      f = lambda q, k, v: jax.vjp(lambda *x: call(*x, None, None, is_causal=True),
                                  q, k, v)[1](ct)
      assert _exp_dtypes(f, q, k, v) == {softmax}, (name, dtype)
