"""The ``"attention"`` op family: `jax.nn.dot_product_attention`'s function, tuned per bucket.

`attention` (also ``tunedjax.attention``) is its call site; `use_tuned_attention`
swaps it into Flax's attention modules (`AttentionSwap` says which modules
took it and why the others did not). Its kernels: ``xla`` (the reference),
the blocked and causal-blocked kernels, and on GPU ``cudnn`` and
``pallas_gpu``. Importing this package registers the family.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from tunedjax.ops.attention import attention
  >>> q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 4)), jnp.float32)
  >>> attention(q, q, q, is_causal=True).shape
  (1, 8, 2, 4)
"""

from tunedjax.autotune import _routes
from tunedjax.ops.attention import _family
from tunedjax.ops.attention import _flax
from tunedjax.ops.attention._flax import AttentionSwap as AttentionSwap
from tunedjax.ops.attention._flax import use_tuned_attention as use_tuned_attention
from tunedjax.ops.attention._function import attention as attention
from tunedjax.ops.attention._spec import AttentionSpec as AttentionSpec

_family.register()
_routes.register_route(_family.NAME, _flax.route_attention, replace=True)

__all__ = ["AttentionSpec", "AttentionSwap", "attention", "use_tuned_attention"]
