"""`route_batch_norm`: Flax's `BatchNorm` layers onto the ``"batch_norm"`` op family.

Inside `route_batch_norm()` (a context manager that also decorates), a
``flax.nnx.BatchNorm`` or ``flax.linen.BatchNorm`` called in training mode
(batch statistics) computes its output, and the batch mean and variance its
running averages take in, through `_bn_family.batch_norm_stats` rather than
Flax's own statistics and normalisation; everything else (the running
averages' update, the parameters, the state tree, the output's dtype) is
Flax's code path written out the same way. Only while kernel selection is
active (under `tunedjax.jit` with ``kernel.enable``, or `select_kernels`):
elsewhere each layer runs Flax's own code.

A call that the family does not cover runs Flax's own code as well: running
averages (evaluation), a mask, a feature axis other than the last, a
cross-device ``axis_name``, a computation dtype other than float32, linen's
initialisation, or a subclass that overrides ``__call__``.

The swap is made when the function is traced (the Trainer's train step is
traced inside it), so it costs nothing per step. nnx layers are routed by a
wrapper on ``nnx.BatchNorm.__call__`` installed while any thread is inside
the context (and removed after), which routes only calls made in a thread
that is inside it; linen layers by `flax.linen.intercept_methods`, which is
per-thread itself.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import tunedjax as tj
  >>> bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  >>> x = jax.random.normal(jax.random.key(0), (8, 3, 3, 4)) * 2.0 + 1.0
  >>> with route_batch_norm():
  ...   y = bn(x)  # kernel selection is off here: Flax's own code
  >>> bool(jnp.allclose(y.mean((0, 1, 2)), 0.0, atol=1e-5))
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tunedjax.autotune import _layer_route


def _as_written(x: Any, epsilon: float) -> bool:
  """Whether kernel selection would keep this layer's default without having
  measured anything (`_select.leaves_as_written`): Flax's own code then runs."""
  from tunedjax.autotune import _select  # pylint: disable=import-outside-toplevel
  from tunedjax.ops.batch_norm._spec import BatchNormSpec  # pylint: disable=import-outside-toplevel
  spec = BatchNormSpec(tuple(jnp.shape(x)), jnp.dtype(x.dtype).name, float(epsilon))
  return _select.leaves_as_written("batch_norm", spec)


def _feature_last(axis: Any, ndim: int) -> bool:
  axes = axis if isinstance(axis, (tuple, list)) else (axis,)
  return ndim >= 2 and len(axes) == 1 and isinstance(axes[0], int) and \
      axes[0] % ndim == ndim - 1


# -- nnx ----------------------------------------------------------------------------------------


def _nnx_call(self: Any, x: Any, use_running_average: bool | None = None, *,
              mask: Any = None) -> Any:
  original = _ROUTE.original
  use_ra = use_running_average if use_running_average is not None \
      else self.use_running_average
  if (use_ra is not False or mask is not None or not _ROUTE.routing()
      or self.axis_name is not None or not _feature_last(self.axis, jnp.ndim(x))):
    return original(self, x, use_running_average, mask=mask)
  scale = self.scale[...] if self.scale is not None else None
  bias = self.bias[...] if self.bias is not None else None
  xp, _, _, scale, bias = self.promote_dtype(
      (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype)
  if xp.dtype != jnp.float32 or (self.dtype is not None
                                 and jnp.dtype(self.dtype) != jnp.float32) \
      or _as_written(xp, self.epsilon):
    return original(self, x, use_running_average, mask=mask)
  y, mean, var = _stats_call(xp, scale, bias, self.epsilon)
  # Flax's running-average update, as Flax writes it.
  if self.mean._can_update or self.var._can_update:  # pylint: disable=protected-access
    stop_gradient = jax.lax.stop_gradient
  else:
    stop_gradient = lambda v: v  # pylint: disable=unnecessary-lambda-assignment
  self.mean[...] = stop_gradient(self.momentum * self.mean[...] + (1 - self.momentum) * mean)
  self.var[...] = stop_gradient(self.momentum * self.var[...] + (1 - self.momentum) * var)
  return y


def _stats_call(x: Any, scale: Any, bias: Any, epsilon: float) -> tuple[Any, Any, Any]:
  from tunedjax.ops.batch_norm import _family as _bn_family  # pylint: disable=import-outside-toplevel
  c = x.shape[-1]
  scale = jnp.ones((c,), x.dtype) if scale is None else scale.reshape(c)
  bias = jnp.zeros((c,), x.dtype) if bias is None else bias.reshape(c)
  return _bn_family.batch_norm_stats(x, scale, bias, epsilon=float(epsilon))


# -- linen --------------------------------------------------------------------------------------


def _linen_interceptor(next_fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       context: Any) -> Any:
  from flax import linen as nn  # pylint: disable=import-outside-toplevel
  module = context.module
  if (context.method_name != "__call__" or not isinstance(module, nn.BatchNorm)
      or type(module).__call__ is not nn.BatchNorm.__call__ or not _ROUTE.routing()):
    return next_fun(*args, **kwargs)
  x, *rest = args
  use_running_average = rest[0] if rest else kwargs.get("use_running_average")
  use_ra = nn.module.merge_param("use_running_average", module.use_running_average,
                                 use_running_average)
  if (use_ra or kwargs.get("mask") is not None or len(rest) > 1
      or module.is_initializing() or module.axis_name is not None
      or not _feature_last(module.axis, jnp.ndim(x))
      or jnp.result_type(x) != jnp.float32
      or jnp.dtype(module.param_dtype) != jnp.float32
      or (module.dtype is not None and jnp.dtype(module.dtype) != jnp.float32)
      or _as_written(jnp.asarray(x), module.epsilon)):
    return next_fun(*args, **kwargs)
  c = jnp.shape(x)[-1]
  stat_dtype = jnp.float32 if module.force_float32_reductions else module.param_dtype
  ra_mean = module.variable("batch_stats", "mean", lambda s: jnp.zeros(s, stat_dtype), [c])
  ra_var = module.variable("batch_stats", "var", lambda s: jnp.ones(s, stat_dtype), [c])
  scale = (module.param("scale", module.scale_init, [c], module.param_dtype)
           if module.use_scale else None)
  bias = (module.param("bias", module.bias_init, [c], module.param_dtype)
          if module.use_bias else None)
  y, mean, var = _stats_call(jnp.asarray(x), scale, bias, module.epsilon)
  ra_mean.value = module.momentum * ra_mean.value + (1 - module.momentum) * mean
  ra_var.value = module.momentum * ra_var.value + (1 - module.momentum) * var
  return y


# -- the context --------------------------------------------------------------------------------


def _nnx_class() -> type:
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return nnx.BatchNorm


_ROUTE = _layer_route.LayerRoute(_nnx_class, _nnx_call, _linen_interceptor)


class route_batch_norm(_layer_route.RouteContext):  # pylint: disable=invalid-name
  """Routes Flax's `BatchNorm` layers in training mode to the tuned batch-norm family.

  Inside it (or inside a function it decorates), each ``flax.nnx.BatchNorm``
  and ``flax.linen.BatchNorm`` called on batch statistics, float32, channels
  last, computes its output and the batch statistics its running averages
  take in through `tunedjax.autotune.batch_norm`'s kernels (one-pass
  statistics and the fused backward, when they measure faster), while
  kernel selection is active: under `tunedjax.jit` with ``kernel.enable``.
  The outputs, the running averages and the state tree are Flax's, to
  float32 rounding. The `tunedjax.Trainer` routes its train step this way.

  Decorate the function `tunedjax.jit` compiles (the swap happens while it
  is traced); other calls, other threads, and layers on running averages
  run Flax's own code.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(8, rngs=nnx.Rngs(0)))
    >>> graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    >>> @tj.ops.batch_norm.route_batch_norm()
    ... def loss(params, stats, x):
    ...   m = nnx.merge(graphdef, params, stats, copy=True)
    ...   return jnp.mean(m(x) ** 3), nnx.state(m, nnx.BatchStat)
    >>> x = jax.random.normal(jax.random.key(1), (16, 3))
    >>> config = {"kernel": {"enable": True, "hints": {"batch_norm": "fused"}}}
    >>> with tj.config_context(config):
    ...   f = tj.jit(jax.grad(loss, has_aux=True))
    ...   grads, new_stats = f(params, stats, x)
    >>> [str(c) for c in f.report(memory=False).last.kernel_report.of("batch_norm")]
    ['batch_norm fused (hint)']
  """

  route = _ROUTE
