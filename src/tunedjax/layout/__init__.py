"""NHWC or NCHW: convolutions in the layout that is fastest for their dtype and device.

`optimize(f)` rewrites `f`'s jaxpr so that its convolutions and pooling run
in the preferred layout (`preferred(dtype, platform)`), carrying that layout
through the ops between them so that transposes appear only at the edges of
a region; the function's inputs and outputs keep their layout. `explain`
shows what it does for given arguments.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import layout
  >>> layout.preferred(jnp.float32, "cpu")
  'NHWC'
  >>> net = lambda x, w: jax.nn.relu(jax.lax.conv(x, w, (1, 1), "SAME"))
  >>> x, w = jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
  >>> bool(jnp.allclose(jax.jit(layout.optimize(net))(x, w), net(x, w)))
  True
"""

from tunedjax.layout._explain import explain as explain
from tunedjax.layout._optimize import Optimized as Optimized
from tunedjax.layout._optimize import optimize as optimize
from tunedjax.layout._prefer import preferred as preferred
from tunedjax.layout._report import LayoutReport as LayoutReport

__all__ = [
    "LayoutReport",
    "Optimized",
    "explain",
    "optimize",
    "preferred",
]
