"""The Pallas implicit-GEMM conv kernel, in interpret mode on CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax

from tests.ops.conv.test_kernels import _spec, check_kernel, conv_cases
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.autotune import _registry as reg
from tunedjax.ops.conv._pallas import conv_pallas


@pytest.mark.slow
@settings(max_examples=6)
@given(conv_cases(nsp=(2,), kernel=(1, 3), spatial=(1, 7), strides=(1, 3),
                  groups="none"))
def test_pallas_matches_lax_in_interpret_mode(case):
  check_kernel("pallas", case, platform="gpu", dtype=np.float32, rtol=1e-5)


def test_pallas_many_channels_spans_several_blocks():
  # 40 input channels -> two 32-wide channel blocks, 70 outputs -> two
  # 64-wide output blocks, 9x9 output rows -> two 64-position M blocks.
  lhs_shape, rhs_shape = (1, 9, 9, 40), (3, 3, 40, 70)
  kwargs = dict(window_strides=(1, 1), padding=((1, 1), (1, 1)),
                lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                dimension_numbers=jax.lax.ConvDimensionNumbers(
                    (0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
                feature_group_count=1, batch_group_count=1)
  check_kernel("pallas", (lhs_shape, rhs_shape, kwargs), platform="gpu",
               dtype=np.float32, rtol=1e-5)


def test_pallas_only_on_gpu():
  spec = _spec((8, 56, 56, 64), (3, 3, 64, 64), padding="SAME")
  pallas = reg.get_kernel("conv", "pallas")
  assert pallas.applicable(spec, "gpu")
  assert not pallas.applicable(spec, "cpu")
  assert not pallas.applicable(spec, "tpu")
  assert pallas.applicable(
      _spec((8, 224, 224, 3), (7, 7, 3, 64), window_strides=(2, 2)), "gpu")
  assert not pallas.applicable(
      _spec((8, 56, 56, 64), (3, 3, 32, 64), feature_group_count=2), "gpu")
  assert not pallas.applicable(
      _spec((8, 56, 56, 64), (9, 9, 64, 64)), "gpu")  # 81 taps
  assert not pallas.applicable(
      dataclasses.replace(spec, lhs_dtype="float64", rhs_dtype="float64"),
      "gpu")


def test_pallas_bfloat16_accumulates_in_float32(rng):
  kwargs = dict(window_strides=(1, 1), padding="SAME",
                dimension_numbers=("NCHW", "OIHW", "NHWC"),
                preferred_element_type=jnp.float32)
  lhs = jnp.asarray(rng.normal(size=(2, 24, 5, 5)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(20, 24, 3, 3)), jnp.bfloat16)
  spec = ConvSpec.from_arrays(lhs, rhs, **kwargs)
  assert reg.get_kernel("conv", "pallas").applicable(spec, "gpu")
  got = conv_pallas(lhs, rhs, spec, interpret=True)
  want = lax.conv_general_dilated(lhs.astype(jnp.float32),
                                  rhs.astype(jnp.float32), **kwargs)
  assert got.dtype == jnp.float32 and got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_pallas_strided_stem():
  # The 7x7 stride-2 ResNet stem (small), strides split into 4 phases.
  case = ((1, 11, 11, 3), (7, 7, 3, 4), dict(
      window_strides=(2, 2), padding=((3, 3), (3, 3)), lhs_dilation=(1, 1),
      rhs_dilation=(1, 1), dimension_numbers=("NHWC", "HWIO", "NHWC")))
  check_kernel("pallas", case, platform="gpu", dtype=np.float32, rtol=1e-5)
