"""`wrap`: mixed precision for a whole Flax nnx or linen model in one line.

Where the parameters are stored (``params=``; Paddle's AMP calls these O1
and O2, words `tunedjax.jit` uses for its own levels):

- ``"master"`` (default; Paddle's O1): parameters stay stored in
  `param_dtype` (float32 master weights); the module's call runs through the
  `autocast` pass, so each matmul and convolution casts its weight to
  `compute_dtype` right where it is used (no second copy of the model), with
  float32 accumulation.
- ``"compute"`` (Paddle's O2): parameters are stored in `compute_dtype`
  except those of normalization layers (converted in place by `wrap` for
  nnx, by `init` for linen); inputs are cast to `compute_dtype`; keep a
  float32 master copy in the optimizer with `master_weights`.

Normalization layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm) run in
float32 either way, as in Paddle's O2; `overrides` gives any module class
its own compute dtype. Outputs are cast to `output_dtype`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from tunedjax._errors import did_you_mean, format_choices
from tunedjax.mixed_precision._autocast import autocast_transform, precision_region
from tunedjax._policy import (Policy, PolicyError, PolicyLike,
                                              get_policy)

PARAM_STORAGE = ("master", "compute")
_PADDLE_LEVELS = {"O1": "master", "O2": "compute"}
NNX_NORMS = (nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm)
LINEN_NORMS = (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)

Overrides = Mapping[type, PolicyLike]


def _resolve_overrides(overrides: Overrides | None, norms: tuple[type, ...]
                       ) -> tuple[tuple[type, np.dtype], ...]:
  """(class, compute dtype) pairs, the user's first, then the norm defaults."""
  pairs = []
  for cls, value in (overrides or {}).items():
    if not isinstance(cls, type):
      raise PolicyError(f"wrap: overrides keys must be module classes (e.g. "
                        f"nnx.LayerNorm), got {cls!r}.")
    pairs.append((cls, get_policy(value).compute_dtype))
  pairs += [(cls, jnp.dtype(jnp.float32)) for cls in norms]
  return tuple(pairs)


def _dtype_for(obj: Any, regions: tuple[tuple[type, np.dtype], ...]) -> np.dtype | None:
  for cls, dtype in regions:
    if isinstance(obj, cls):
      return dtype
  return None


def _split_static(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
  """The array leaves of `tree`, and a function putting new ones back (other
  leaves, like a `train=True` flag, stay Python values)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]

  def rebuild(new_arrays: list[Any]) -> Any:
    it = iter(new_arrays)
    return jax.tree_util.tree_unflatten(
        treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])

  return arrays, rebuild


def _check_params(params: str, level: str | None) -> str:
  if level is not None:  # Paddle's words, accepted for code written against them
    if level not in _PADDLE_LEVELS:
      raise PolicyError(f"wrap: level must be one of {format_choices(_PADDLE_LEVELS)} "
                        f"(Paddle's names; prefer params= with "
                        f"{format_choices(PARAM_STORAGE)}), got {level!r}.")
    return _PADDLE_LEVELS[level]
  if params not in PARAM_STORAGE:
    raise PolicyError(f"wrap: params must be one of {format_choices(PARAM_STORAGE)} "
                      f"(where the parameters are stored), got {params!r}"
                      f"{did_you_mean(str(params), PARAM_STORAGE)}.")
  return params


# nnx


@functools.cache
def _region_class(cls: type, dtype_name: str) -> type:
  """A subclass of `cls` whose `__call__` runs in a `precision_region`."""

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with precision_region(dtype_name):
      return cls.__call__(self, *args, **kwargs)

  return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                     "__qualname__": cls.__qualname__})


def _mark_nnx_regions(model: nnx.Module, regions: tuple[tuple[type, np.dtype], ...]) -> None:
  for _, sub in nnx.iter_modules(model):
    dtype = _dtype_for(sub, regions)
    if dtype is not None:
      sub.__class__ = _region_class(type(sub), dtype.name)


def _nnx_owner_dtypes(model: nnx.Module, regions: tuple[tuple[type, np.dtype], ...]
                      ) -> dict[tuple[Any, ...], np.dtype | None]:
  return {tuple(path): _dtype_for(sub, regions) for path, sub in nnx.iter_modules(model)}


class MixedPrecision(nnx.Module):
  """An nnx module run under a mixed-precision policy (made by `wrap`).

  Attributes:
    module: the wrapped module (the same object: its parameters are shared).
  """

  def __init__(self, module: nnx.Module, policy: Policy, regions: Any, params: str):
    self.module = module
    self._policy_text = str(policy)
    self._regions = regions
    self._params = params

  @property
  def policy(self) -> Policy:
    return Policy.parse(self._policy_text)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    policy, regions = self.policy, self._regions
    if self._params == "compute":
      args, kwargs = policy.cast_to_compute((args, kwargs))
    graphdef, state = nnx.split(self.module)
    arrays, rebuild = _split_static((args, kwargs))

    def pure(state: Any, arrays: list[Any]) -> Any:
      model = nnx.merge(graphdef, state)  # fresh objects over the same arrays
      _mark_nnx_regions(model, regions)
      call_args, call_kwargs = rebuild(arrays)
      out = model(*call_args, **call_kwargs)
      return out, nnx.state(model, nnx.Not(nnx.Param))  # batch stats, RNG counts

    out, new_state = autocast_transform(pure, policy)(state, arrays)
    nnx.update(self.module, new_state)
    return policy.cast_to_output(out)


def _wrap_nnx(module: nnx.Module, policy: Policy, regions: Any, params: str) -> MixedPrecision:
  if params == "compute":  # parameters stored in the compute dtype, norms excepted
    owners = _nnx_owner_dtypes(module, regions)
    for path, var in nnx.iter_graph(module):
      if isinstance(var, nnx.Param) and jnp.issubdtype(var.get_value().dtype, jnp.floating):
        owner = max((p for p in owners if tuple(path[:len(p)]) == p), key=len, default=())
        dtype = owners.get(owner) or policy.compute_dtype
        var.set_value(var.get_value().astype(dtype))
  return MixedPrecision(module, policy, regions, params)


# linen


def _region_interceptor(regions: tuple[tuple[type, np.dtype], ...]) -> Callable[..., Any]:
  def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    dtype = _dtype_for(context.module, regions) if context.method_name == "__call__" else None
    if dtype is None:
      return next_fun(*args, **kwargs)
    with precision_region(dtype):
      return next_fun(*args, **kwargs)
  return interceptor


@dataclasses.dataclass(frozen=True)
class LinenMixedPrecision:
  """A linen module run under a mixed-precision policy (made by `wrap`).

  Use it as the module: `init(rngs, *args)` and `apply(variables, *args,
  mutable=..., rngs=...)` take what `module.init` and `module.apply` take.

  Attributes:
    module: the wrapped linen module.
    policy: the `Policy`.
    params: where the parameters are stored: ``"master"`` or ``"compute"``.
  """

  module: nn.Module
  policy: Policy
  regions: tuple[tuple[type, np.dtype], ...]
  params: str

  def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
    """`module.init`; with ``params="compute"`` the parameters come back in the compute dtype,
    those of normalization layers (and float32 overrides) excepted."""
    owners: dict[tuple[str, ...], np.dtype | None] = {}

    def record(next_fun, args, kwargs, context):
      owners[tuple(context.module.scope.path)] = _dtype_for(context.module, self.regions)
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
      variables = self.module.init(rngs, *args, **kwargs)
    if self.params != "compute":
      return variables

    def cast(path: Any, x: Any) -> Any:
      keys = tuple(getattr(k, "key", k) for k in path)
      if keys[0] != "params" or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
      owner = max((p for p in owners if keys[1:1 + len(p)] == p), key=len, default=())
      return x.astype(owners.get(owner) or self.policy.compute_dtype)

    return jax.tree_util.tree_map_with_path(cast, variables)

  def apply(self, variables: Any, *args: Any, mutable: Any = False, **kwargs: Any) -> Any:
    """`module.apply` under the policy; with `mutable`, returns `(out,
    updated collections)` as linen does (only `out` is cast)."""
    policy = self.policy
    if self.params == "compute":
      args = policy.cast_to_compute(args)
    arrays, rebuild = _split_static((args, kwargs))

    def pure(variables: Any, arrays: list[Any]) -> Any:
      call_args, call_kwargs = rebuild(arrays)
      with nn.intercept_methods(_region_interceptor(self.regions)):
        return self.module.apply(variables, *call_args, mutable=mutable, **call_kwargs)

    out = autocast_transform(pure, policy)(variables, arrays)
    if mutable:
      return policy.cast_to_output(out[0]), out[1]
    return policy.cast_to_output(out)


def wrap(module: Any, policy: PolicyLike = "mixed_bfloat16", *,
         overrides: Overrides | None = None, params: str = "master",
         level: str | None = None) -> Any:
  """Runs a Flax nnx or linen module in mixed precision.

  Args:
    module: an `nnx.Module` or a `linen.Module`.
    policy: a `Policy`, a policy string or a named policy.
    overrides: `{module class: policy or dtype}`, e.g. `{nnx.Linear:
      "float32"}`: instances of the class run in that compute dtype. The
      normalization layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm) run in
      float32 unless overridden.
    params: ``"master"`` (parameters stay float32, each op cast by the
      autocast op lists; Paddle's O1) or ``"compute"`` (parameters stored in
      the compute dtype, norms excepted; pair it with `master_weights` in the
      optimizer; Paddle's O2).
    level: Paddle's name for the same choice, ``"O1"`` or ``"O2"``, for code
      written against Paddle's AMP (it wins over `params` when given).

  Returns:
    For nnx, a `MixedPrecision` module wrapping `module` (same parameters);
    call it as the module. For linen, a `LinenMixedPrecision` with `init`
    and `apply`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> model = wrap(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    >>> model(jnp.ones((3, 4))).dtype, model.module.kernel.get_value().dtype
    (dtype('float32'), dtype('float32'))
  """
  policy = get_policy(policy)
  params = _check_params(params, level)
  if isinstance(module, nnx.Module):
    return _wrap_nnx(module, policy, _resolve_overrides(overrides, NNX_NORMS), params)
  if isinstance(module, nn.Module):
    return LinenMixedPrecision(module, policy, _resolve_overrides(overrides, LINEN_NORMS), params)
  raise PolicyError(f"wrap expects a flax nnx.Module or linen.Module, got {module!r} "
                    f"(type {type(module).__name__}).")
