"""Conv kernels name themselves in the compiled program's op names (`_conv_layout.kernel_scope`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tunedjax import autotune


@pytest.mark.parametrize("kernel,rhs_shape,groups", [("depthwise", (3, 3, 1, 4), 4),
                                                     ("matmul_1x1", (1, 1, 4, 6), 1),
                                                     ("im2col", (3, 3, 4, 6), 1)])
def test_a_chosen_kernels_instructions_carry_its_scope(kernel, rhs_shape, groups, tmp_path,
                                                       rng):
  def loss(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=groups,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(y ** 2)

  x = jnp.asarray(rng.normal(size=(2, 6, 6, 4)), jnp.float32)
  w = jnp.asarray(rng.normal(size=rhs_shape), jnp.float32)
  with autotune.hint(conv=kernel):
    fn = jax.jit(autotune.select_kernels(loss, cache=str(tmp_path)))
    text = fn.lower(x, w).compile().as_text()
  assert f"tj_conv_{kernel}/" in text
  np.testing.assert_allclose(fn(x, w), loss(x, w), rtol=1e-5)
