"""Loss scaling: pytrees that scale a loss up and its gradients back down.

float16 has 5 exponent bits: gradients below 2**-24 flush to zero. Scaling the
loss by S before differentiating scales every gradient by S; unscaling after
gives the true gradient with the small values preserved. `DynamicLossScale`
finds S on its own (as Paddle's `GradScaler`, PyTorch's `GradScaler` and
jmp do): it backs off when a step overflows and grows after a run of finite
steps. bfloat16 has float32's exponent range and needs no scaling.

Unlike jmp, every field is part of the pytree, so nothing resets under `jit`
(jmp PR #44: `min_loss_scale` was dropped by `tree_flatten`), and the scale is
always kept in float32, whatever dtype it was given in (jmp issue #47: a
float16 scale broke `adjust` and would overflow when grown past 2**15).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax._config import LOSS_SCALES, get_config
from tunedjax._errors import ConfigError, format_choices
from tunedjax._policy import PolicyLike, get_policy


def _is_floating(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _as_f32(value: Any) -> Any:
  """Python numbers and arrays become float32; anything else (the sentinels
  that pytree utilities put in leaves) is kept."""
  if isinstance(value, (int, float, np.ndarray, np.generic, jax.Array)):
    return jnp.asarray(value, jnp.float32)
  return value


def _as_i32(value: Any) -> Any:
  if isinstance(value, (int, np.ndarray, np.generic, jax.Array)):
    return jnp.asarray(value, jnp.int32)
  return value


def _check_scalar(owner: str, name: str, value: Any, *, integer: bool = False,
                  low: float = 0.0, strict: bool = True) -> None:
  """Raises `ConfigError` unless `value` is a finite real scalar above `low`
  (at or above it when not `strict`); a traced value is checked by type only."""
  kind = "an integer" if integer else "a number"
  bound = f"{'>' if strict else '>='} {low:g}"
  ok_types = (int, np.integer) if integer else (int, float, np.integer, np.floating)
  if isinstance(value, (bool, np.bool_)):
    ok = False
  elif isinstance(value, ok_types):
    limit = 2**31 - 1 if integer else float(np.finfo(np.float32).max)  # stored as int32/float32
    ok = (math.isfinite(value) and abs(value) <= limit
          and (value > low if strict else value >= low))
  elif isinstance(value, (np.ndarray, jax.Array)):
    dtype_ok = (jnp.issubdtype(value.dtype, jnp.integer) if integer else
                jnp.issubdtype(value.dtype, jnp.integer)
                or jnp.issubdtype(value.dtype, jnp.floating))
    ok = value.shape == () and dtype_ok
    if ok and not isinstance(value, jax.core.Tracer):
      number = float(value)
      ok = math.isfinite(number) and (number > low if strict else number >= low)
  else:
    ok = False
  if not ok:
    shown = (f"an array {value.dtype}{list(value.shape)}"
             if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) else repr(value))
    stored = "int32" if integer else "float32"
    raise ConfigError(f"{owner}({name}=...) must be {kind} {bound} (a finite scalar that "
                      f"fits {stored}), got {shown}.")


def _finite_number(value: Any) -> bool:
  """Whether `value` is a finite Python or NumPy real number (not a bool)."""
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, (bool, np.bool_)) and math.isfinite(value))


def _check_finite_flag(owner: str, grads_finite: Any) -> Any:
  """`grads_finite` as a boolean scalar array, or a ValueError naming it."""
  flag = grads_finite
  if not isinstance(flag, (jax.Array, np.ndarray, np.generic)):
    try:
      flag = jnp.asarray(flag)
    except (TypeError, ValueError, OverflowError):
      flag = None
  if flag is None or np.shape(flag) != () or flag.dtype != jnp.bool_:
    got = (f"{flag.dtype}{list(np.shape(flag))}" if flag is not None
           else f"{grads_finite!r} (type {type(grads_finite).__name__})")
    raise ValueError(
        f"{owner}.adjust(grads_finite=...) expects a boolean scalar, got {got}: pass "
        "mp.all_finite(grads), not a per-element jnp.isfinite(grads), which would "
        "turn the loss scale into an array.")
  return flag


def _scale_tree(tree: Any, factor: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x: (x.astype(jnp.float32) * factor).astype(x.dtype) if _is_floating(x) else x,
      tree)


def _register(cls: type, data: tuple[str, ...], meta: tuple[str, ...]) -> type:
  """Registers a frozen dataclass as a pytree whose unflatten skips __init__
  (pytree utilities put arbitrary objects in leaves)."""

  def flatten_with_keys(obj: Any) -> tuple[Any, Any]:
    children = [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data]
    return children, tuple(getattr(obj, n) for n in meta)

  def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
    obj = object.__new__(cls)
    for n, v in zip(data, children):
      object.__setattr__(obj, n, v)
    for n, v in zip(meta, aux):
      object.__setattr__(obj, n, v)
    return obj

  jax.tree_util.register_pytree_with_keys(
      cls, flatten_with_keys, unflatten,
      flatten_func=lambda obj: ([getattr(obj, n) for n in data],
                                tuple(getattr(obj, n) for n in meta)))
  return cls


@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale:
  """No loss scaling: `scale` and `unscale` return their input.

  Example:
    >>> NoOpLossScale().scale(2.0)
    2.0
  """

  def scale(self, tree: Any) -> Any:
    """Returns `tree` unchanged."""
    return tree

  def unscale(self, tree: Any) -> Any:
    """Returns `tree` unchanged."""
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    """Returns `self`: nothing to adjust."""
    del grads_finite
    return self

  @property
  def loss_scale(self) -> jax.Array:
    """The factor, 1.0 (float32)."""
    return jnp.float32(1.0)


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticLossScale:
  """A fixed loss scale.

  Attributes:
    loss_scale: the factor, a float32 scalar array.

  Example:
    >>> ls = StaticLossScale(128.0)
    >>> float(ls.unscale(ls.scale(jnp.float16(3.0))))
    3.0
  """

  loss_scale: jax.Array

  def __init__(self, value: float | jax.Array):
    _check_scalar("StaticLossScale", "value", value)
    object.__setattr__(self, "loss_scale", _as_f32(value))

  def scale(self, tree: Any) -> Any:
    """Multiplies the floating leaves of `tree` by the scale (in float32,
    then back to each leaf's dtype)."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: Any) -> Any:
    """Divides the floating leaves of `tree` by the scale."""
    return _scale_tree(tree, 1.0 / self.loss_scale)

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    """Returns `self`: a static scale never changes."""
    del grads_finite
    return self

  def __repr__(self) -> str:
    return f"StaticLossScale({_show(self.loss_scale)})"


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicLossScale:
  """A loss scale that backs off on overflow and grows after finite steps.

  After a step whose gradients are not all finite, the scale is multiplied by
  `backoff_factor` (never below `min_scale`) and the run of good steps
  restarts; after `growth_interval` finite steps in a row it is multiplied by
  `growth_factor`. The scale is stored in float32.

  Attributes:
    loss_scale: the current factor (float32 scalar array).
    counter: finite steps since the last change (int32 scalar array).
    growth_interval, growth_factor, backoff_factor, min_scale: the schedule,
      static pytree metadata (changing them recompiles a jitted step).

  Example:
    >>> ls = DynamicLossScale(initial_scale=2.0**15, growth_interval=2)
    >>> float(ls.adjust(jnp.bool_(False)).loss_scale)
    16384.0
    >>> float(ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True)).loss_scale)
    65536.0
  """

  loss_scale: jax.Array
  counter: jax.Array
  growth_interval: int
  growth_factor: float
  backoff_factor: float
  min_scale: float

  def __init__(self, initial_scale: float | jax.Array = 2.0**15, *,
               growth_interval: int = 2000, growth_factor: float = 2.0,
               backoff_factor: float = 0.5, min_scale: float = 1.0,
               counter: int | jax.Array = 0):
    owner = "DynamicLossScale"
    _check_scalar(owner, "initial_scale", initial_scale)
    _check_scalar(owner, "counter", counter, integer=True, strict=False)
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
        or not 1 <= growth_interval < 2**31:
      raise ConfigError(f"DynamicLossScale growth_interval must be an integer in "
                        f"[1, 2**31), got {growth_interval!r}.")
    if not (_finite_number(growth_factor) and growth_factor >= 1.0):
      raise ConfigError(f"DynamicLossScale growth_factor must be a finite number >= 1, got "
                        f"{growth_factor!r}.")
    if not (_finite_number(backoff_factor) and 0.0 < backoff_factor < 1.0):
      raise ConfigError(
          f"DynamicLossScale backoff_factor must be a number in (0, 1), got {backoff_factor!r}.")
    _check_scalar(owner, "min_scale", min_scale)
    if not isinstance(initial_scale, jax.core.Tracer) and float(initial_scale) < min_scale:
      raise ConfigError(f"DynamicLossScale min_scale={min_scale!r} is above "
                        f"initial_scale={float(initial_scale)!r}: backing off would raise "
                        "the scale. Pass a min_scale <= initial_scale.")
    object.__setattr__(self, "loss_scale", _as_f32(initial_scale))
    object.__setattr__(self, "counter", _as_i32(counter))
    object.__setattr__(self, "growth_interval", growth_interval)
    object.__setattr__(self, "growth_factor", float(growth_factor))
    object.__setattr__(self, "backoff_factor", float(backoff_factor))
    object.__setattr__(self, "min_scale", float(min_scale))

  def scale(self, tree: Any) -> Any:
    """Multiplies the floating leaves of `tree` by the scale (in float32,
    then back to each leaf's dtype)."""
    return _scale_tree(tree, self.loss_scale)

  def unscale(self, tree: Any) -> Any:
    """Divides the floating leaves of `tree` by the scale."""
    return _scale_tree(tree, 1.0 / self.loss_scale)

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """Returns the loss scale for the next step.

    Args:
      grads_finite: a boolean scalar, e.g. `all_finite(grads)`.

    Raises:
      ValueError: if `grads_finite` is not a boolean scalar (a per-element
        ``jnp.isfinite(grads)`` would silently make the scale an array; jmp
        asserts the same).
    """
    grads_finite = _check_finite_flag("DynamicLossScale", grads_finite)
    grow = self.counter >= self.growth_interval - 1
    grown = self.loss_scale * self.growth_factor
    grown = jnp.where(grow & jnp.isfinite(grown), grown, self.loss_scale)
    backed_off = jnp.maximum(self.loss_scale * self.backoff_factor,
                             jnp.float32(self.min_scale))
    new_scale = jnp.where(grads_finite, grown, backed_off).astype(jnp.float32)
    new_counter = jnp.where(grads_finite & ~grow, self.counter + 1, 0).astype(jnp.int32)
    return self._with(loss_scale=new_scale, counter=new_counter)

  def __repr__(self) -> str:
    return (f"DynamicLossScale(loss_scale={_show(self.loss_scale)}, "
            f"counter={_show(self.counter)}, growth_interval={self.growth_interval}, "
            f"growth_factor={self.growth_factor}, backoff_factor={self.backoff_factor}, "
            f"min_scale={self.min_scale})")

  def _with(self, **changes: Any) -> DynamicLossScale:
    """A copy with some fields replaced (`dataclasses.replace` would call
    `__init__`, which takes `initial_scale`)."""
    new = object.__new__(DynamicLossScale)
    for f in dataclasses.fields(self):
      object.__setattr__(new, f.name, changes.get(f.name, getattr(self, f.name)))
    return new


def _show(x: Any) -> str:
  try:
    return repr(x.item())
  except Exception:  # A tracer.
    return repr(x)


_register(StaticLossScale, ("loss_scale",), ())
_register(DynamicLossScale, ("loss_scale", "counter"),
          ("growth_interval", "growth_factor", "backoff_factor", "min_scale"))
_register(NoOpLossScale, (), ())

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree: Any) -> jax.Array:
  """Whether every floating leaf of `tree` is free of inf and NaN.

  Returns:
    A boolean scalar array (True for a tree without floating leaves).

  Example:
    >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  leaves = [jnp.isfinite(x).all() for x in jax.tree_util.tree_leaves(tree)
            if _is_floating(x)]
  if not leaves:
    return jnp.bool_(True)
  return jnp.stack(leaves).all()


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
  """Picks `on_true` where the scalar `pred` holds, else `on_false`, leaf by leaf.

  Args:
    pred: a boolean scalar.
    on_true, on_false: pytrees of the same structure, shapes and dtypes.

  Example:
    >>> select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"]
    Array([0., 0.], dtype=float32)
  """
  ta = jax.tree_util.tree_structure(on_true)
  tb = jax.tree_util.tree_structure(on_false)
  if ta != tb:
    raise ValueError(
        "select_tree needs two pytrees of the same structure, got\n"
        f"  on_true:  {ta}\n  on_false: {tb}")
  pred = jnp.asarray(pred)
  if pred.shape != () or pred.dtype != jnp.bool_:
    raise ValueError(f"select_tree needs a boolean scalar pred, got {pred.dtype}{list(pred.shape)}.")
  return jax.tree_util.tree_map(lambda a, b: jax.lax.select(pred, a, b), on_true, on_false)


def scaled_value_and_grad(loss_fn: Callable[..., Any], *, has_aux: bool = False,
                          argnums: int | tuple[int, ...] = 0) -> Callable[..., Any]:
  """`jax.value_and_grad` with loss scaling: returns the unscaled gradients.

  The returned function takes the loss scale first, then `loss_fn`'s
  arguments: `fn(loss_scale, *args, **kwargs)`. It differentiates
  `loss_scale.scale(loss_fn(*args))`, unscales the gradients in float32, and
  checks them for inf/NaN.

  Args:
    loss_fn: returns a scalar loss, or `(loss, aux)` with `has_aux=True`.
    has_aux: as in `jax.value_and_grad`.
    argnums: which of `loss_fn`'s arguments to differentiate.

  Returns:
    A function returning `(value, grads, grads_finite)`: `value` is the
    unscaled loss (or `(loss, aux)`), `grads` the unscaled gradients and
    `grads_finite` a boolean scalar to pass to `loss_scale.adjust` and to
    skip the step on (`skip_nonfinite` does that for an optax optimizer).

  Example:
    >>> grad_fn = scaled_value_and_grad(lambda w: jnp.sum(w ** 2))
    >>> loss, g, ok = grad_fn(DynamicLossScale(2.0**10), jnp.array([1.0, 2.0]))
    >>> float(loss), g.tolist(), bool(ok)
    (5.0, [2.0, 4.0], True)
  """

  def scaled(loss_scale: LossScale, *args: Any, **kwargs: Any) -> Any:
    out = loss_fn(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    return loss_scale.scale(loss), (loss, aux)

  grad_fn = jax.value_and_grad(scaled, argnums=_shift(argnums), has_aux=True)

  @functools.wraps(loss_fn)
  def fn(loss_scale: LossScale, *args: Any, **kwargs: Any) -> Any:
    (_, (loss, aux)), grads = grad_fn(loss_scale, *args, **kwargs)
    grads = loss_scale.unscale(grads)
    value = (loss, aux) if has_aux else loss
    return value, grads, all_finite(grads)

  return fn


def _shift(argnums: int | tuple[int, ...]) -> int | tuple[int, ...]:
  if isinstance(argnums, int):
    return argnums + 1
  return tuple(a + 1 for a in argnums)


def loss_scale_for(policy: PolicyLike | None = None, config_value: str | None = None, *,
                   static_value: float = 2.0**15) -> LossScale:
  """The loss scale that the config's ``mixed_precision.loss_scale`` names.

  Args:
    policy: the `Policy` (or its string or name) being trained with; None
      reads ``mixed_precision.policy`` from `tunedjax.get_config()`.
    config_value: "auto" (dynamic for float16 compute, none otherwise: bfloat16
      has float32's range, as Paddle does), "dynamic", "static" or "none";
      None reads ``mixed_precision.loss_scale`` from the config.
    static_value: the factor for "static".

  Example:
    >>> type(loss_scale_for("mixed_float16", "auto")).__name__
    'DynamicLossScale'
    >>> type(loss_scale_for("mixed_bfloat16", "auto")).__name__
    'NoOpLossScale'
  """
  if policy is None or config_value is None:
    section = get_config().mixed_precision
    policy = section.policy if policy is None else policy
    config_value = section.loss_scale if config_value is None else config_value
  policy = get_policy(policy)
  if not isinstance(config_value, str) or config_value not in LOSS_SCALES:
    raise ConfigError(f"mixed_precision.loss_scale (config_value=...) must be one of "
                      f"{format_choices(LOSS_SCALES)}, got {config_value!r}.")
  if config_value == "auto":
    config_value = "dynamic" if policy.compute_dtype == jnp.float16 else "none"
  if config_value == "dynamic":
    return DynamicLossScale()
  if config_value == "static":
    return StaticLossScale(static_value)
  if config_value == "none":
    return NoOpLossScale()
  raise ConfigError(f"mixed_precision.loss_scale must be one of "
                    f"{format_choices(LOSS_SCALES)}, got {config_value!r}.")

