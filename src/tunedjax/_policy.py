"""`Policy`: which dtype parameters are stored in, computed in, and returned in.

The vocabulary is jmp's and Flax's (`param_dtype`, `compute_dtype`,
`output_dtype`); a policy has a string form that `Policy.parse` reads and
`str(policy)` writes back.

Short forms follow jmp's documented shorthand, so that code ported from jmp
keeps its numerics: a missing ``params`` is float32, a missing ``compute``
follows ``params`` and a missing ``output`` follows ``compute``. So
``"c=bf16"`` is ``params=float32,compute=bfloat16,output=bfloat16`` and
``"p=f16"`` is float16 throughout; the constructor's omitted (or None)
arguments follow the same rule. One difference is kept: ``"half"`` is always
float16 here (jmp picks bfloat16 on TPU), because a pass may rewrite for a
platform other than the one it runs on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax._errors import TunedJaxError, did_you_mean, format_choices


class PolicyError(TunedJaxError, ValueError):
  """A mixed-precision policy, dtype or policy string is not valid.

  Example:
    >>> from tunedjax import mixed_precision as mp
    >>> try:
    ...   mp.Policy.parse("p=f32,compute=int8")
    ... except mp.PolicyError as e:
    ...   print("floating" in str(e))
    True
  """


# Spellings accepted for each dtype, canonical name first.
_DTYPE_ALIASES: dict[str, tuple[str, ...]] = {
    "float32": ("f32", "fp32", "float", "full", "single"),
    "bfloat16": ("bf16",),
    "float16": ("f16", "fp16", "half"),
    "float64": ("f64", "fp64", "double"),
}
_DTYPE_NAMES = {alias: name for name, aliases in _DTYPE_ALIASES.items()
                for alias in (name, *aliases)}
# Policy-string keys and their short forms.
_KEYS = {"params": "param_dtype", "param": "param_dtype", "p": "param_dtype",
         "compute": "compute_dtype", "c": "compute_dtype",
         "output": "output_dtype", "o": "output_dtype"}
_KEY_WRITTEN = {"param_dtype": "params", "compute_dtype": "compute",
                "output_dtype": "output"}
_VALID_DTYPES = "float32 (f32), bfloat16 (bf16), float16 (f16) or float64 (f64)"
GRAMMAR = (
    "a policy string is either one dtype for all three (e.g. 'bfloat16'), or "
    "comma-separated key=dtype pairs with keys params|p, compute|c, "
    "output|o (as in jmp, a missing params is float32, a missing compute follows "
    "params and a missing output follows compute: 'c=bf16' means "
    "'params=float32,compute=bfloat16,output=bfloat16'), e.g. "
    "'params=float32,compute=bfloat16,output=float32' or 'p=f32,c=bf16,o=f32'; "
    f"dtypes: {_VALID_DTYPES}")

NAMED_POLICIES = {
    "float32": "params=float32,compute=float32,output=float32",
    "mixed_bfloat16": "params=float32,compute=bfloat16,output=float32",
    "mixed_float16": "params=float32,compute=float16,output=float32",
    "bfloat16": "params=bfloat16,compute=bfloat16,output=bfloat16",
    "float16": "params=float16,compute=float16,output=float16",
}

DTypeLike = Union[str, type, np.dtype, Any]
PolicyLike = Union["Policy", str]


def canonical_dtype(value: DTypeLike, *, what: str = "dtype") -> np.dtype:
  """Returns `value` as a floating NumPy dtype, or raises `PolicyError`.

  Args:
    value: a dtype, a dtype name or one of its short forms ("bf16", "f32").
    what: how the error message names the value (e.g. "compute_dtype").

  Example:
    >>> canonical_dtype("bf16")
    dtype(bfloat16)
  """
  if isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
    return jnp.dtype(_DTYPE_NAMES[value.strip().lower()])
  if value is None or isinstance(value, (bool, int, float, complex)):
    # jnp.dtype(None) is float64 and jnp.dtype(1.0) float64: never a silent guess.
    raise PolicyError(f"{what} must be a dtype or a dtype name, got {value!r}. Valid "
                      f"dtypes: {_VALID_DTYPES}.")
  try:
    dtype = jnp.dtype(value)
  except (TypeError, ValueError) as e:
    hint = did_you_mean(value, _DTYPE_NAMES) if isinstance(value, str) else ""
    raise PolicyError(f"Unknown {what} {value!r}{hint}. Valid dtypes: "
                      f"{_VALID_DTYPES}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise PolicyError(
        f"{what} must be a floating dtype, got {dtype.name} (from {value!r}): "
        f"mixed precision casts floating values only. Valid dtypes: "
        f"{_VALID_DTYPES}.")
  return dtype


def _cast_floating(tree: Any, dtype: np.dtype) -> Any:
  def cast(x: Any) -> Any:
    if (isinstance(x, (jax.Array, np.ndarray, np.generic))
        and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype):
      return x.astype(dtype)
    return x
  return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Mixed-precision policy: the dtypes of parameters, computation and outputs.

  Attributes:
    param_dtype: the dtype parameters are stored in (the master weights).
    compute_dtype: the dtype matrix multiplies, convolutions and the ops
      that follow them run in.
    output_dtype: the dtype the function's floating outputs are cast to.

  Each field accepts a dtype or a name ("bfloat16", "bf16", "f32", ...) and
  is stored as a NumPy dtype; only floating dtypes are valid. A field left
  out (or None) follows jmp's rule: `param_dtype` defaults to float32,
  `compute_dtype` to `param_dtype` and `output_dtype` to `compute_dtype`.

  Example:
    >>> p = Policy.parse("p=f32,c=bf16,o=f32")
    >>> str(p)
    'params=float32,compute=bfloat16,output=float32'
    >>> Policy.parse(str(p)) == p
    True
    >>> str(Policy(compute_dtype="bf16"))  # the output follows the compute dtype
    'params=float32,compute=bfloat16,output=bfloat16'
  """

  param_dtype: np.dtype = None  # type: ignore[assignment]
  compute_dtype: np.dtype = None  # type: ignore[assignment]
  output_dtype: np.dtype = None  # type: ignore[assignment]

  def __post_init__(self) -> None:
    follows = {"param_dtype": np.dtype("float32"), "compute_dtype": None,
               "output_dtype": None}
    previous = None
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if value is None:
        value = follows[f.name] if follows[f.name] is not None else previous
      previous = canonical_dtype(value, what=f.name)
      object.__setattr__(self, f.name, previous)

  @classmethod
  def parse(cls, text: str) -> Policy:
    """Reads a policy string (see `GRAMMAR`).

    Args:
      text: "params=float32,compute=bfloat16,output=float32", the short
        form "p=f32,c=bf16,o=f32", or one dtype for all three ("bf16").
        Keys may be left out, as in jmp: params defaults to float32, compute
        to params, output to compute ("c=bf16" computes and returns
        bfloat16; "p=f16" is float16 throughout).

    Returns:
      The `Policy`.

    Raises:
      PolicyError: naming the string, the bad part and the grammar.

    Example:
      >>> Policy.parse("bf16").output_dtype
      dtype(bfloat16)
      >>> str(Policy.parse("c=bf16,o=f32"))
      'params=float32,compute=bfloat16,output=float32'
    """
    if not isinstance(text, str):
      raise PolicyError(f"A policy string must be a str, got {text!r} "
                        f"(type {type(text).__name__}); {GRAMMAR}.")
    stripped = text.strip()
    if "=" not in stripped and "," not in stripped:
      try:
        dtype = canonical_dtype(stripped)
      except PolicyError as e:
        raise PolicyError(f"Cannot parse policy {text!r}: {e} Grammar: "
                          f"{GRAMMAR}.") from None
      return cls(dtype, dtype, dtype)
    fields: dict[str, np.dtype] = {}
    for part in stripped.split(","):
      key, sep, value = (s.strip() for s in part.partition("="))
      if not sep:
        raise PolicyError(f"Cannot parse policy {text!r}: {part.strip()!r} is "
                          f"not a key=dtype pair; {GRAMMAR}.")
      field = _KEYS.get(key.lower())
      if field is None:
        raise PolicyError(
            f"Cannot parse policy {text!r}: unknown key {key!r}"
            f"{did_you_mean(key, _KEYS)}; {GRAMMAR}.")
      if field in fields:
        raise PolicyError(f"Cannot parse policy {text!r}: {key!r} sets "
                          f"{field} twice; {GRAMMAR}.")
      try:
        fields[field] = canonical_dtype(value, what=field)
      except PolicyError as e:
        raise PolicyError(f"Cannot parse policy {text!r}: {e} Grammar: "
                          f"{GRAMMAR}.") from None
    return cls(**fields)

  def __str__(self) -> str:
    return ",".join(f"{_KEY_WRITTEN[f.name]}={getattr(self, f.name).name}"
                    for f in dataclasses.fields(self))

  def with_dtypes(self, **dtypes: DTypeLike) -> Policy:
    """Returns a copy with some dtypes replaced (`param_dtype=...`, ...)."""
    return dataclasses.replace(self, **dtypes)

  def cast_to_param(self, tree: Any) -> Any:
    """Casts the floating leaves of `tree` to `param_dtype`."""
    return _cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    """Casts the floating leaves of `tree` to `compute_dtype`.

    Example:
      >>> get_policy("mixed_bfloat16").cast_to_compute(
      ...     {"w": jnp.ones(2), "step": jnp.int32(1)})["w"].dtype
      dtype(bfloat16)
    """
    return _cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    """Casts the floating leaves of `tree` to `output_dtype`."""
    return _cast_floating(tree, self.output_dtype)


def get_policy(name: PolicyLike) -> Policy:
  """Returns a named policy, parses a policy string, or passes a Policy through.

  Args:
    name: "float32", "mixed_bfloat16", "mixed_float16", "bfloat16",
      "float16", any string `Policy.parse` reads, or a `Policy`.

  Example:
    >>> str(get_policy("mixed_float16"))
    'params=float32,compute=float16,output=float32'
  """
  if isinstance(name, Policy):
    return name
  if isinstance(name, str) and name.strip() in NAMED_POLICIES:
    return Policy.parse(NAMED_POLICIES[name.strip()])
  if isinstance(name, str) and ("=" in name or name.strip().lower() in _DTYPE_NAMES):
    return Policy.parse(name)
  raise PolicyError(
      f"Unknown policy {name!r}{did_you_mean(str(name), NAMED_POLICIES)}. Give "
      f"one of the named policies {format_choices(NAMED_POLICIES)}, a Policy, "
      f"or a policy string: {GRAMMAR}.")


def is_half(dtype: DTypeLike) -> bool:
  """Whether `dtype` is a 16-bit float (bfloat16 or float16)."""
  return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
