"""Every attention kernel against JAX's attention in float64: output and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunedjax import autotune
from tunedjax.rewrite import _compat
from tunedjax.ops.attention import _kernels as K
from tunedjax.ops.attention._spec import AttentionSpec, split_operands

from .helpers import draw, kernel_call, reference64, rel, vjp_of

# Largest error against float64, relative to the largest reference value, by dtype:
# (output, gradients). bfloat16 keeps 8 bits; its gradients sum many rounded products.
BOUNDS = {"float32": (2e-5, 2e-4), "bfloat16": (3e-2, 8e-2), "float16": (5e-3, 2e-2)}


def _chunked(chunk):
  def fn(*operands):
    *ops, spec = operands
    return K.query_chunked_attention(chunk, *split_operands(tuple(ops), spec), spec)
  return fn


# Small blocks, so that short lengths span several blocks (and end in a partial one).
SMALL = {"xla": K.xla, "einsum": K.einsum, "blocked_8": K.blocked(8),
         "blocked_16": K.blocked(16), "query_chunked_8": _chunked(8)}


def _check(fns, q, k, v, bias, mask, ct, *, dtype="float32", **kw):
  """Each kernel of `fns` ({name: fn}) against the float64 reference."""
  want, want_grads = reference64(q, k, v, bias, mask, ct, **kw)
  fwd_bound, grad_bound = BOUNDS[dtype]
  for kernel, fn in fns.items():
    out, grads = vjp_of(kernel_call(fn), q, k, v, bias, mask, ct, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape, kernel
    assert rel(out, want) < fwd_bound, kernel
    for name, got, w, x in zip(("dq", "dk", "dv", "dbias"), grads, want_grads,
                               (q, k, v, bias)):
      assert got.dtype == x.dtype and got.shape == x.shape, (kernel, name)
      assert rel(got, w) < grad_bound, (kernel, name)


# Bias and mask shapes by the axes they vary along ("b..s": [B, 1, 1, S]). A bias
# constant along the keys has a zero gradient (softmax is shift-invariant): left out,
# its relative error would compare rounding noise.
def _shape(axes, b, n, t, s):
  return None if axes is None else tuple(d if c != "." else 1 for c, d in zip(axes, (b, n, t, s)))


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("causal,bias_axes,mask_axes", [
    (False, None, None), (True, "..ts", "b..s"),
    pytest.param(True, None, None, marks=_SLOW), pytest.param(False, "bnts", None, marks=_SLOW),
    pytest.param(False, None, "bnts", marks=_SLOW),
    pytest.param(True, "b..s", ".n.s", marks=_SLOW)])
def test_kernels_match_float64(causal, bias_axes, mask_axes, rng):
  b, t, s, kv_heads, groups, h = 2, 19, 37, 2, 3, 8  # 37 keys: blocks of 8 and 16 end partial
  n = kv_heads * groups
  q, k, v, bias, mask, ct = draw(rng, b, t, s, kv_heads, groups, h,
                                 bias_shape=_shape(bias_axes, b, n, t, s),
                                 mask_shape=_shape(mask_axes, b, n, t, s))
  _check(SMALL, q, k, v, bias, mask, ct, is_causal=causal)


@pytest.mark.slow
@settings(max_examples=7, deadline=None)
@given(data=st.data(), b=st.integers(1, 2), t=st.integers(1, 40), s=st.integers(1, 40),
       kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2, 4]),
       h=st.sampled_from([4, 8]), causal=st.booleans(),
       bias_axes=st.sampled_from([None, "bnts", "..ts", "b..s", ".n.s"]),
       mask_axes=st.sampled_from([None, "padding", "bnts", "b.ts", ".n.s"]),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**16))
def test_every_kernel_matches_float64_on_random_shapes(data, b, t, s, kv_heads, groups, h,
                                                       causal, bias_axes, mask_axes, scale,
                                                       seed):
  # Lengths on both sides of the block sizes 8 and 16 (multiples or not), GQA, causal,
  # padding and random masks (random ones may mask whole rows: those must match too).
  del data
  n = kv_heads * groups
  padding = mask_axes == "padding"
  q, k, v, bias, mask, ct = draw(
      np.random.default_rng(seed), b, t, s, kv_heads, groups, h,
      bias_shape=_shape(bias_axes, b, n, t, s),
      mask_shape=(b, 1, 1, s) if padding else _shape(mask_axes, b, n, t, s), padding=padding)
  _check(SMALL, q, k, v, bias, mask, ct, is_causal=causal, scale=scale)


def test_a_fully_masked_row_averages_the_values_as_jax_does(rng):
  b, t, s = 1, 12, 20
  q, k, v, _, _, ct = draw(rng, b, t, s, 2, 1, 8)
  mask = np.ones((b, 1, t, s), bool)
  mask[0, 0, 3] = False  # query 3 attends nothing
  mask = jnp.asarray(mask)
  _check(SMALL, q, k, v, None, mask, ct)
  for name, fn in SMALL.items():
    out = jax.jit(kernel_call(fn))(q, k, v, None, mask)
    np.testing.assert_allclose(out[0, 3], np.mean(np.asarray(v[0]), axis=0), atol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=_SLOW)])
def test_low_precision_within_its_bound(dtype, rng):
  b, t, s = 1, 24, 40
  q, k, v, bias, mask, ct = draw(rng, b, t, s, 2, 2, 8, dtype=jnp.dtype(dtype),
                                 bias_shape=(1, 4, t, s), mask_shape=(b, 1, 1, s),
                                 padding=True)
  _check(SMALL, q, k, v, bias, mask, ct, dtype=dtype, is_causal=True)


# -- the registered kernels, at lengths where they apply ----------------------------------

# (blocked_causal_*: causal without bias or mask only, in test_causal_kernels.py;
# native_flash: no bias, in test_native_flash.py.)
CPU_KERNELS = [k.name for k in autotune.kernels("attention")
               if k.name not in ("cudnn", "pallas_gpu", "pallas_tpu", "native_flash")
               and not k.name.startswith("blocked_causal")]


def _applicable_shape(name):
  """(t, s) where kernel `name` applies on CPU: two blocks or chunks and a partial one."""
  if name.startswith("blocked_"):
    return 8, 2 * int(name.split("_")[1]) + 5
  if name == "query_chunked":
    return 2 * K.QUERY_CHUNK + 3, 24
  return 30, 40


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_KERNELS)
def test_registered_kernel_applies_and_matches_float64(name, rng):
  t, s = _applicable_shape(name)
  q, k, v, bias, mask, ct = draw(rng, 1, t, s, 1, 2, 16, bias_shape=(1, 1, t, s),
                                 mask_shape=(1, 1, 1, s), padding=True)
  spec = AttentionSpec.from_arrays(q, k, bias, mask, is_causal=True)
  kernel = {k.name: k for k in autotune.kernels("attention")}[name]
  assert kernel.applicable(spec, "cpu")
  _check({name: kernel.fn}, q, k, v, bias, mask, ct, is_causal=True)


def test_applicability_rules():
  spec = functools.partial(AttentionSpec, 1, 1024, 1024, 8, 8, 64)
  names = lambda s, p: [k.name for k in autotune.kernels("attention")  # native_flash:
                        if k.applicable(s, p) and k.name != "native_flash"]  # its own tests
  assert names(spec("float32"), "cpu") == ["xla", "einsum", "blocked_128", "blocked_256",
                                           "blocked_512", "query_chunked"]
  # (pallas_gpu needs JAX's Pallas GPU attention, which jax 0.12.1 removed.)
  assert ("pallas_gpu" in names(spec("float32"), "gpu")) == (
      _compat.pallas_gpu_attention() is not None)
  assert "cudnn" not in names(spec("float32"), "gpu")  # cuDNN: float16/bfloat16 only
  pallas_gpu = {"pallas_gpu"} if _compat.pallas_gpu_attention() is not None else set()
  assert {"cudnn", *pallas_gpu} <= set(names(spec("bfloat16"), "gpu"))
  assert "pallas_tpu" in names(spec("bfloat16"), "tpu")
  gqa = AttentionSpec(1, 1024, 1024, 8, 2, 64, "bfloat16")
  assert "pallas_gpu" not in names(gqa, "gpu") and "cudnn" in names(gqa, "gpu")
  masked = AttentionSpec(1, 1024, 1024, 8, 8, 64, "bfloat16", mask_shape=(1, 1, 1, 1024))
  assert not {"cudnn", "pallas_gpu"} & set(names(masked, "gpu"))
  short = AttentionSpec(1, 200, 200, 8, 8, 64, "float32")
  assert names(short, "cpu") == ["xla", "einsum"]  # one block, one chunk: nothing to gain


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_pallas_gpu_kernel_in_interpret_mode_matches_float64(causal, rng):
  # The Triton kernel itself needs a GPU; Pallas's interpret mode runs its code on CPU.
  if _compat.pallas_gpu_attention() is None:
    pytest.skip(f"jax {jax.__version__} ships no Pallas GPU attention (removed in 0.12.1)")
  q, k, v, _, _, ct = draw(rng, 1, 128, 128, 2, 1, 32)
  fn = functools.partial(K.pallas_gpu, interpret=True)
  _check({"pallas_gpu": fn}, q, k, v, None, None, ct, is_causal=causal)
