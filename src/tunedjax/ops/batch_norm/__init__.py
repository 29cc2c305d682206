"""The ``"batch_norm"`` op family: batch norm on batch statistics, channels last.

`batch_norm` and `batch_norm_stats` are its call sites (plain `jax.jit` runs
the reference; `tunedjax.jit` with kernel selection on, the bucket's winner
among ``xla``, ``fused`` and, on CPU, ``native``, whose sums are C++ in
``csrc/``); `route_batch_norm` sends Flax's ``BatchNorm`` layers
to them. Importing this package registers the family.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from tunedjax.ops.batch_norm import batch_norm
  >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 4, 3)), jnp.float32)
  >>> batch_norm(x, jnp.ones(3), jnp.zeros(3)).shape
  (8, 4, 4, 3)
"""

from tunedjax.autotune import _routes
from tunedjax.ops.batch_norm import _family
from tunedjax.ops.batch_norm._family import batch_norm as batch_norm
from tunedjax.ops.batch_norm._family import batch_norm_stats as batch_norm_stats
from tunedjax.ops.batch_norm._flax import route_batch_norm as route_batch_norm
from tunedjax.ops.batch_norm._spec import BatchNormSpec as BatchNormSpec

_family.register()
_routes.register_route(_family.NAME, route_batch_norm, replace=True)

__all__ = ["BatchNormSpec", "batch_norm", "batch_norm_stats", "route_batch_norm"]
