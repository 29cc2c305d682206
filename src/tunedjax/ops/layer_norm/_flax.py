"""`route_layer_norm`: Flax's `LayerNorm` layers onto the ``"layer_norm"`` op family.

Inside `route_layer_norm()` (a context manager that also decorates), a
``flax.nnx.LayerNorm`` or ``flax.linen.LayerNorm`` computes its output
through `_ln_family.layer_norm` rather than Flax's own statistics and
normalisation; the parameters, the state tree and the output's dtype are
Flax's. Only while kernel selection is active (under `tunedjax.jit` with
``kernel.enable``, or `select_kernels`), and only where kernel selection
has measured or been told something (`_select.leaves_as_written`):
elsewhere each layer runs Flax's own code.

A call that the family does not cover runs Flax's own code as well: a mask,
normalisation or features over axes other than the last alone, a
cross-device ``axis_name``, an input, parameter or computation dtype other
than float32, linen's initialisation, or a subclass that overrides
``__call__``. The family computes the variance in two passes (the mean of
squared deviations), where Flax by default takes ``E[x^2] - E[x]^2``
(``use_fast_variance``): the routed layer agrees with Flax's to float32
rounding and is the nearer of the two to float64 when a row's mean is large
against its spread.

The swap is made when the function is traced (the Trainer's train step is
traced inside it), so it costs nothing per step. nnx layers are routed by a
wrapper on ``nnx.LayerNorm.__call__`` installed while any thread is inside
the context (and removed after), which routes only calls made in a thread
that is inside it; linen layers by `flax.linen.intercept_methods`, which is
per-thread itself.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> ln = nnx.LayerNorm(8, rngs=nnx.Rngs(0))
  >>> x = jax.random.normal(jax.random.key(0), (4, 8)) * 2.0 + 1.0
  >>> with route_layer_norm():
  ...   y = ln(x)  # kernel selection is off here: Flax's own code
  >>> bool(jnp.allclose(y.mean(-1), 0.0, atol=1e-5))
  True
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from tunedjax.autotune import _layer_route


def _last_axis_only(axes: Any, ndim: int) -> bool:
  """Whether `axes` (an int or a sequence of ints) names the last axis and no other."""
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return (ndim >= 1 and len(axes) == 1 and isinstance(axes[0], int)
          and -ndim <= axes[0] < ndim and axes[0] % ndim == ndim - 1)


def _float32(*dtypes: Any) -> bool:
  """Whether every dtype given (None: unset, skipped) is float32."""
  return all(d is None or jnp.dtype(d) == jnp.float32 for d in dtypes)


def _covered(x: Any, reduction_axes: Any, feature_axes: Any, axis_name: Any,
             *dtypes: Any) -> bool:
  """Whether the family computes this layer's call: float32, the last axis alone, no
  ``axis_name``, and kernel selection routes it (measured, hinted or cached)."""
  ndim = jnp.ndim(x)
  if not (_ROUTE.routing() and axis_name is None and _float32(jnp.result_type(x), *dtypes)
          and _last_axis_only(reduction_axes, ndim) and _last_axis_only(feature_axes, ndim)):
    return False
  from tunedjax.autotune import _select  # pylint: disable=import-outside-toplevel
  from tunedjax.ops.layer_norm._spec import LayerNormSpec  # pylint: disable=import-outside-toplevel
  spec = LayerNormSpec(tuple(jnp.shape(x)), "float32")
  return not _select.leaves_as_written("layer_norm", spec)


def _family_call(x: Any, scale: Any, bias: Any, epsilon: float) -> Any:
  from tunedjax.ops.layer_norm import _family as _ln_family  # pylint: disable=import-outside-toplevel
  c = jnp.shape(x)[-1]
  scale = jnp.ones((c,), jnp.float32) if scale is None else jnp.reshape(scale, (c,))
  bias = jnp.zeros((c,), jnp.float32) if bias is None else jnp.reshape(bias, (c,))
  return _ln_family.layer_norm(jnp.asarray(x), scale, bias, epsilon=float(epsilon))


# -- nnx ----------------------------------------------------------------------------------------


def _nnx_call(self: Any, x: Any, *, mask: Any = None) -> Any:
  original = _ROUTE.original
  if mask is not None:
    return original(self, x, mask=mask)
  scale = self.scale[...] if self.scale else None
  bias = self.bias[...] if self.bias else None
  xp, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
  if not _covered(xp, self.reduction_axes, self.feature_axes, self.axis_name, self.dtype,
                  None if scale is None else scale.dtype,
                  None if bias is None else bias.dtype):
    return original(self, x, mask=mask)
  return _family_call(xp, scale, bias, self.epsilon)


# -- linen --------------------------------------------------------------------------------------


def _linen_interceptor(next_fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       context: Any) -> Any:
  from flax import linen as nn  # pylint: disable=import-outside-toplevel
  module = context.module
  if (context.method_name != "__call__" or not isinstance(module, nn.LayerNorm)
      or type(module).__call__ is not nn.LayerNorm.__call__ or len(args) != 1
      or kwargs.get("mask") is not None or not _ROUTE.routing() or module.is_initializing()):
    return next_fun(*args, **kwargs)
  x = jnp.asarray(args[0])
  if not _covered(x, module.reduction_axes, module.feature_axes, module.axis_name,
                  module.dtype, module.param_dtype):
    return next_fun(*args, **kwargs)
  c = jnp.shape(x)[-1]
  scale = (module.param("scale", module.scale_init, [c], module.param_dtype)
           if module.use_scale else None)
  bias = (module.param("bias", module.bias_init, [c], module.param_dtype)
          if module.use_bias else None)
  return _family_call(x, scale, bias, module.epsilon)


# -- the context --------------------------------------------------------------------------------


def _nnx_class() -> type:
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return nnx.LayerNorm


_ROUTE = _layer_route.LayerRoute(_nnx_class, _nnx_call, _linen_interceptor)


class route_layer_norm(_layer_route.RouteContext):  # pylint: disable=invalid-name
  """Routes Flax's `LayerNorm` layers to the tuned layer-norm family.

  Inside it (or inside a function it decorates), each ``flax.nnx.LayerNorm``
  and ``flax.linen.LayerNorm`` over the last axis, float32, computes its
  output through `tunedjax.ops.layer_norm.layer_norm`'s kernels (the fused
  backward, or on CPU forward and backward in C++, when they measure
  faster) while kernel selection is active: under `tunedjax.jit` with
  ``kernel.enable``. The outputs and the parameters are Flax's, to float32
  rounding. The `tunedjax.Trainer` routes its train step this way.

  Decorate the function `tunedjax.jit` compiles (the swap happens while it
  is traced); other calls, other threads, and layers the family does not
  cover run Flax's own code.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> model = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)),
    ...                        nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
    >>> graphdef, params = nnx.split(model)
    >>> @tj.ops.layer_norm.route_layer_norm()
    ... def loss(params, x):
    ...   return jnp.mean(nnx.merge(graphdef, params)(x) ** 3)
    >>> x = jax.random.normal(jax.random.key(1), (16, 3))
    >>> config = {"kernel": {"enable": True, "hints": {"layer_norm": "fused"}}}
    >>> with tj.config_context(config):
    ...   f = tj.jit(jax.grad(loss))
    ...   grads = f(params, x)
    >>> [str(c) for c in f.report(memory=False).last.kernel_report.of("layer_norm")]
    ['layer_norm fused (hint)']
  """

  route = _ROUTE
