"""The ``"layer_norm"`` op family: layer norm over the last axis.

`layer_norm` is its call site (plain `jax.jit` runs the reference; `tunedjax.jit`
with kernel selection on, the bucket's winner among ``xla``, ``fused`` and, on
CPU, ``native``, forward and backward in C++ in ``csrc/``); `route_layer_norm`
sends Flax's ``LayerNorm`` layers to it. Importing this package registers the
family.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from tunedjax.ops.layer_norm import layer_norm
  >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), jnp.float32)
  >>> layer_norm(x, jnp.ones(16), jnp.zeros(16)).shape
  (4, 16)
"""

from tunedjax.autotune import _routes
from tunedjax.ops.layer_norm import _family
from tunedjax.ops.layer_norm._family import layer_norm as layer_norm
from tunedjax.ops.layer_norm._flax import route_layer_norm as route_layer_norm
from tunedjax.ops.layer_norm._spec import LayerNormSpec as LayerNormSpec

_family.register()
_routes.register_route(_family.NAME, route_layer_norm, replace=True)

__all__ = ["LayerNormSpec", "layer_norm", "route_layer_norm"]
