"""What autocast hands each platform: a GPU's convolutions take and return the
compute dtype (forward and backward), matmuls keep float32 accumulation, an
explicit ``accumulate_dtype`` wins, and each value is cast once.

The GPU program is exported for CUDA on CPU (`jax.export`) and its rewritten
function is also run on CPU, against float64, within the bounds
tests/mixed_precision/test_autocast.py holds a CNN's gradients to.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tunedjax import mixed_precision as mp
from tunedjax.mixed_precision import _autocast

NHWC = ("NHWC", "HWIO", "NHWC")


def _loss(params, x):
  h = lax.conv_general_dilated(x, params["w1"], (1, 1), "SAME", dimension_numbers=NHWC)
  h = jax.nn.relu(h)
  h = lax.conv_general_dilated(h, params["w2"], (2, 2), "SAME", dimension_numbers=NHWC)
  logits = h.mean(axis=(1, 2)) @ params["head"]
  return jnp.mean(jax.nn.log_softmax(logits) ** 2)


@functools.cache
def _case():
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(3, 3, 4, 8)) * 0.3, "w2": rng.normal(size=(3, 3, 8, 8)) * 0.2,
            "head": rng.normal(size=(8, 5)) * 0.5}
  x = rng.normal(size=(2, 8, 8, 4))
  return params, x


def _f32(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def _grad_fn(platform, **kwargs):
  return jax.jit(_autocast.autocast_transform(jax.grad(_loss), "mixed_bfloat16",
                                              platform=platform, **kwargs))


def _ops(text, op):
  """(operand dtypes, result dtype) of each `op` in a StableHLO module."""
  found = []
  for line in text.splitlines():
    if f"stablehlo.{op}" in line or (op == "dot_general" and "stablehlo.dot" in line):
      types = re.findall(r"tensor<[^>]*?x?([a-z]+[0-9]+)>", line.split(":")[-1])
      if types:
        found.append((tuple(types[:-1]), types[-1]))
  return found


@functools.cache
def _exported(platform, accumulate):
  params, x = _case()
  kwargs = {} if accumulate == "default" else {"accumulate_dtype": accumulate}
  fn = _grad_fn(platform, **kwargs)
  exported = jax.export.export(fn, platforms=[{"gpu": "cuda"}.get(platform, platform)])(
      _f32(params), _f32(x))
  return exported.mlir_module()


def test_gpu_convolutions_forward_and_backward_return_the_compute_dtype():
  text = _exported("gpu", "default")
  convs = _ops(text, "convolution")
  assert len(convs) == 5  # two forward, w1's and w2's kernel gradients, w2's input gradient
  assert all(c == (("bf16", "bf16"), "bf16") for c in convs), convs
  dots = _ops(text, "dot_general")
  assert dots and all(d[0] == ("bf16", "bf16") and d[1] == "f32" for d in dots), dots


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_cpu_and_tpu_convolutions_accumulate_in_float32(platform):
  convs = _ops(_exported(platform, "default"), "convolution")
  assert convs and all(c == (("bf16", "bf16"), "f32") for c in convs), convs


def test_an_explicit_accumulate_dtype_overrides_the_platform():
  convs = _ops(_exported("gpu", jnp.float32), "convolution")
  assert convs and all(c[1] == "f32" for c in convs), convs
  convs = _ops(_exported("cpu", None), "convolution")
  assert convs and all(c[1] == "bf16" for c in convs), convs


def test_each_weight_is_cast_once_on_gpu():
  """The backward convolution's reversed kernel is the cast kernel, reversed."""
  casts = [line for line in _exported("gpu", "default").splitlines()
           if "stablehlo.convert" in line and "3x3x8x8xf32" in line.split("->")[0]]
  assert len(casts) == 1, casts


def test_native_accumulate_dtype_by_platform():
  conv, dot = "conv_general_dilated", "dot_general"
  assert _autocast.native_accumulate_dtype(conv, "gpu") is None
  assert _autocast.native_accumulate_dtype(conv, "cuda") is None
  assert _autocast.native_accumulate_dtype(dot, "gpu") == np.float32
  assert _autocast.native_accumulate_dtype(conv, "tpu") == np.float32
  assert _autocast.native_accumulate_dtype(conv, "cpu") == np.float32


def test_a_bad_accumulate_dtype_names_the_valid_ones():
  with pytest.raises(mp.PolicyError, match="int8.*'platform'"):
    mp.autocast_pass("mixed_bfloat16", accumulate_dtype="int8")


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_gradients_against_float64_within_the_cnn_bound(platform):
  params, x = _case()
  with jax.enable_x64(True):
    want = jax.jit(jax.grad(_loss))(params, x)
  got = _grad_fn(platform)(_f32(params), _f32(x))
  for name in want:
    g, w = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
    assert np.linalg.norm(g - w) / np.linalg.norm(w) < 5e-2, name
