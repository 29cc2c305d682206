"""Mixed precision: policies, an autocast pass, a Flax wrapper, loss scaling.

Example:
  >>> import jax.numpy as jnp
  >>> from tunedjax import mixed_precision as mp
  >>> policy = mp.get_policy("mixed_bfloat16")
  >>> str(policy)
  'params=float32,compute=bfloat16,output=float32'
  >>> grad_fn = mp.scaled_value_and_grad(lambda w: jnp.sum(w ** 2))
  >>> loss, grads, finite = grad_fn(mp.DynamicLossScale(), jnp.ones(3))
  >>> float(loss), bool(finite)
  (3.0, True)
"""

from tunedjax.mixed_precision._allreduce import allreduce_gradients as allreduce_gradients
from tunedjax.mixed_precision._allreduce import (
    data_parallel_value_and_grad as data_parallel_value_and_grad)
from tunedjax.mixed_precision._autocast import DEFAULT_ALLOW as DEFAULT_ALLOW
from tunedjax.mixed_precision._autocast import DEFAULT_DENY as DEFAULT_DENY
from tunedjax.mixed_precision._autocast import DEFAULT_FOLLOW as DEFAULT_FOLLOW
from tunedjax.mixed_precision._autocast import OpLists as OpLists
from tunedjax.mixed_precision._autocast import autocast as autocast
from tunedjax.mixed_precision._autocast import autocast_pass as autocast_pass
from tunedjax.mixed_precision._scope import as_traced as as_traced
from tunedjax.mixed_precision._scope import precision_region as precision_region
from tunedjax.mixed_precision._scope import trace_compute_dtype as trace_compute_dtype
from tunedjax.mixed_precision._loss_scale import DynamicLossScale as DynamicLossScale
from tunedjax.mixed_precision._loss_scale import NoOpLossScale as NoOpLossScale
from tunedjax.mixed_precision._loss_scale import StaticLossScale as StaticLossScale
from tunedjax.mixed_precision._loss_scale import all_finite as all_finite
from tunedjax.mixed_precision._loss_scale import loss_scale_for as loss_scale_for
from tunedjax.mixed_precision._loss_scale import scaled_value_and_grad as scaled_value_and_grad
from tunedjax.mixed_precision._loss_scale import select_tree as select_tree
from tunedjax.mixed_precision._optax import MasterWeightsState as MasterWeightsState
from tunedjax.mixed_precision._optax import SkipNonFiniteState as SkipNonFiniteState
from tunedjax.mixed_precision._optax import master_weights as master_weights
from tunedjax.mixed_precision._optax import skip_nonfinite as skip_nonfinite
from tunedjax._policy import Policy as Policy
from tunedjax._policy import PolicyError as PolicyError
from tunedjax._policy import get_policy as get_policy
from tunedjax.mixed_precision._wrap import LinenMixedPrecision as LinenMixedPrecision
from tunedjax.mixed_precision._wrap import MixedPrecision as MixedPrecision
from tunedjax.mixed_precision._wrap import wrap as wrap

__all__ = [
    "DEFAULT_ALLOW",
    "DEFAULT_DENY",
    "DEFAULT_FOLLOW",
    "OpLists",
    "as_traced",
    "autocast",
    "autocast_pass",
    "data_parallel_value_and_grad",
    "precision_region",
    "DynamicLossScale",
    "LinenMixedPrecision",
    "MasterWeightsState",
    "MixedPrecision",
    "NoOpLossScale",
    "Policy",
    "PolicyError",
    "SkipNonFiniteState",
    "StaticLossScale",
    "all_finite",
    "allreduce_gradients",
    "get_policy",
    "loss_scale_for",
    "master_weights",
    "scaled_value_and_grad",
    "select_tree",
    "skip_nonfinite",
    "trace_compute_dtype",
    "wrap",
]
