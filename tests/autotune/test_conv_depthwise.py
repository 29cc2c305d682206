"""The ``depthwise_unpadded`` conv kernel: against lax in float64, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax

from tunedjax.autotune import _registry as reg
from tunedjax.autotune._conv_depthwise import _tap_range

from .test_kernels import _grad_conv_specs, _spec, check_kernel, conv_cases


@settings(max_examples=12, deadline=None)
@given(conv_cases(depthwise=True))
def test_unpadded_matches_lax(case):
  # Any dimension numbers, padding (negative too), strides, lhs and rhs dilation.
  check_kernel("depthwise_unpadded", case)


@pytest.mark.parametrize("stride", [1, 2])
def test_unpadded_matches_lax_on_a_train_steps_forms(stride):
  # The forward conv and its input gradient (lhs-dilated when strided), 3x3 as in MobileNet.
  fwd, _, input_grad = _grad_conv_specs(
      (2, 9, 9, 4), (3, 3, 1, 4), window_strides=(stride, stride),
      padding=((1, 1), (1, 1)), feature_group_count=4,
      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  for spec in (fwd, input_grad):
    case = (spec.lhs_shape, spec.rhs_shape, spec.params())
    check_kernel("depthwise_unpadded", case, seed=stride)


def test_unpadded_taps_that_meet_only_padding():
  # One input pixel, padded by 3 each side, read every 4th position: every
  # output's window lies in the padding, so every tap is skipped.
  kwargs = {"window_strides": (4,), "padding": ((3, 3),), "lhs_dilation": (1,),
            "rhs_dilation": (1,), "dimension_numbers": ("NHC", "HIO", "NHC"),
            "feature_group_count": 3, "batch_group_count": 1}
  check_kernel("depthwise_unpadded", ((2, 1, 3), (3, 1, 3), kwargs))
  # Some taps meet the input, some only padding (rhs dilation 3 over 2 pixels).
  kwargs.update(window_strides=(1,), padding=((3, 3),), rhs_dilation=(3,))
  check_kernel("depthwise_unpadded", ((2, 2, 3), (3, 1, 3), kwargs))


def test_tap_range_is_the_set_of_outputs_that_meet_the_input():
  for out, size, offset, lo, stride, dil in [(7, 4, 2, 1, 1, 2), (5, 9, 0, 2, 2, 1),
                                             (6, 5, 1, 0, 3, 2), (3, 1, 0, 3, 4, 1)]:
    got = _tap_range(out, size, offset, lo, stride, dil)
    hits = [(o, (o * stride + offset - lo) // dil) for o in range(out)
            if (o * stride + offset - lo) % dil == 0
            and 0 <= (o * stride + offset - lo) // dil < size]
    if not hits:
      assert got is None
      continue
    o0, o_step, count, i0, i_step = got
    assert [(o0 + j * o_step, i0 + j * i_step) for j in range(count)] == hits


def test_unpadded_applies_to_the_channel_form_only():
  kernel = reg.get_kernel("conv", "depthwise_unpadded")
  forward, weight_grad, input_grad = _grad_conv_specs(
      (2, 9, 9, 4), (3, 3, 1, 4), window_strides=(2, 2), padding="SAME",
      feature_group_count=4, dimension_numbers=("NHWC", "HWIO", "NHWC"))
  assert kernel.applicable(forward, "cpu") and kernel.applicable(input_grad, "cpu")
  assert not kernel.applicable(weight_grad, "cpu")  # that is depthwise's scan
  for spec in (_spec((2, 8, 8, 4), (3, 3, 4, 4)),  # dense
               _spec((2, 8, 8, 4), (3, 3, 1, 8), feature_group_count=4),  # multiplier 2
               _spec((2, 32, 32, 4), (11, 11, 1, 4), feature_group_count=4),  # 121 taps
               _spec((2, 8, 8, 4), (3, 3, 1, 4), dtype="int32", feature_group_count=4)):
    assert not kernel.applicable(spec, "cpu"), spec


def test_unpadded_bfloat16_accumulates_in_float32(rng):
  kernel = reg.get_kernel("conv", "depthwise_unpadded")
  kwargs = {"window_strides": (1, 1), "padding": "SAME", "feature_group_count": 8,
            "dimension_numbers": ("NHWC", "HWIO", "NHWC"),
            "preferred_element_type": jnp.float32}
  lhs = jnp.asarray(rng.normal(size=(2, 5, 5, 8)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(3, 3, 1, 8)), jnp.bfloat16)
  spec = _spec((2, 5, 5, 8), (3, 3, 1, 8), dtype="bfloat16", **kwargs)
  got = jax.jit(kernel.fn, static_argnums=2)(lhs, rhs, spec)
  want = lax.conv_general_dilated(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                                  **{k: v for k, v in kwargs.items()
                                     if k != "preferred_element_type"})
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
