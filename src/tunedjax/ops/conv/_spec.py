"""`ConvSpec`: everything that defines one `conv_general_dilated` equation.

The spec of the ``"conv"`` op family: hashable (a dict key), JSON-able, and
rebuildable into the equation's params.

Example:
  >>> import numpy as np
  >>> spec = ConvSpec.from_arrays(
  ...     np.ones((1, 8, 8, 4), np.float32), np.ones((1, 1, 4, 6), np.float32),
  ...     window_strides=(1, 1), padding="VALID",
  ...     dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> spec.out_shape
  (1, 8, 8, 6)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax import lax

from tunedjax._errors import AutotuneError, format_choices

_PRECISION_TYPES = {"Precision": lax.Precision}
if hasattr(lax, "DotAlgorithmPreset"):
  _PRECISION_TYPES["DotAlgorithmPreset"] = lax.DotAlgorithmPreset


def _dtype_name(dtype: Any) -> str:
  return np.dtype(dtype).name


def _precision_repr(precision: Any) -> str | None:
  """The string stored in a ConvSpec for an equation's precision param."""
  if precision is None:
    return None
  if isinstance(precision, tuple) and all(p is None for p in precision):
    return None
  return repr(precision)


def _parse_one_precision(text: str) -> Any:
  text = text.strip()
  if text == "None":
    return None
  kind, _, member = text.partition(".")
  enum = _PRECISION_TYPES.get(kind)
  if enum is None or member not in enum.__members__:
    raise AutotuneError(
        f"ConvSpec.precision {text!r} is not a precision tunedjax can rebuild; "
        "expected None, 'Precision.DEFAULT', 'Precision.HIGH', "
        "'Precision.HIGHEST' or a pair of them."
    )
  return enum[member]


def _parse_precision(text: str | None) -> Any:
  """Inverts `_precision_repr`: None, one precision, or a pair of them."""
  if text is None:
    return None
  stripped = text.strip()
  if stripped.startswith("(") and stripped.endswith(")"):
    parts = [p for p in stripped[1:-1].split(",") if p.strip()]
    return tuple(_parse_one_precision(p) for p in parts)
  return _parse_one_precision(stripped)


def _ints(values: Any) -> tuple[int, ...]:
  return tuple(int(v) for v in values)


@dataclasses.dataclass(frozen=True)
class ConvSpec:
  """Everything that defines one `conv_general_dilated` equation.

  Hashable (a dict key), and JSON-able through `to_dict` / `from_dict`. Dtypes
  are NumPy dtype names ("float32", "bfloat16"); `dimension_numbers` holds the
  three index tuples of `lax.ConvDimensionNumbers` (lhs, rhs, out); `precision`
  is the repr of the equation's precision param (None when default).

  Example:
    >>> import numpy as np
    >>> spec = ConvSpec.from_arrays(
    ...     np.ones((2, 3, 9, 9), np.float32), np.ones((5, 3, 3, 3), np.float32),
    ...     window_strides=(2, 2), padding="SAME")
    >>> spec.out_shape, spec.padding
    ((2, 5, 5, 5), ((1, 1), (1, 1)))
    >>> ConvSpec.from_dict(spec.to_dict()) == spec
    True
  """

  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  lhs_dtype: str
  rhs_dtype: str
  out_dtype: str
  window_strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  dimension_numbers: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
  feature_group_count: int
  batch_group_count: int
  preferred_element_type: str | None
  precision: str | None

  def __post_init__(self):
    # Normalise lists (from JSON) to tuples so equal specs hash equally.
    set_ = object.__setattr__
    set_(self, "lhs_shape", _ints(self.lhs_shape))
    set_(self, "rhs_shape", _ints(self.rhs_shape))
    set_(self, "window_strides", _ints(self.window_strides))
    set_(self, "padding", tuple((int(lo), int(hi)) for lo, hi in self.padding))
    set_(self, "lhs_dilation", _ints(self.lhs_dilation))
    set_(self, "rhs_dilation", _ints(self.rhs_dilation))
    set_(self, "dimension_numbers",
         tuple(_ints(d) for d in self.dimension_numbers))
    set_(self, "feature_group_count", int(self.feature_group_count))
    set_(self, "batch_group_count", int(self.batch_group_count))
    for name in ("lhs_dtype", "rhs_dtype", "out_dtype"):
      set_(self, name, _dtype_name(getattr(self, name)))
    if self.preferred_element_type is not None:
      set_(self, "preferred_element_type",
           _dtype_name(self.preferred_element_type))
    if len(self.dimension_numbers) != 3:
      raise AutotuneError(
          "ConvSpec.dimension_numbers must be (lhs_spec, rhs_spec, out_spec), "
          f"got {self.dimension_numbers!r}."
      )

  @classmethod
  def from_equation(cls, eqn: Any) -> ConvSpec:
    """Reads the spec of a jaxpr `conv_general_dilated` equation.

    Args:
      eqn: a `jax.extend.core.JaxprEqn` whose primitive is
        `conv_general_dilated`.

    Returns:
      The equation's ConvSpec.
    """
    name = getattr(eqn.primitive, "name", eqn.primitive)
    if name != "conv_general_dilated":
      raise AutotuneError(
          f"ConvSpec.from_equation expects a conv_general_dilated equation, "
          f"got primitive {name!r}."
      )
    p = eqn.params
    lhs, rhs = (v.aval for v in eqn.invars)
    pet = p.get("preferred_element_type")
    return cls(
        lhs_shape=lhs.shape,
        rhs_shape=rhs.shape,
        lhs_dtype=_dtype_name(lhs.dtype),
        rhs_dtype=_dtype_name(rhs.dtype),
        out_dtype=_dtype_name(eqn.outvars[0].aval.dtype),
        window_strides=p["window_strides"],
        padding=p["padding"],
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["rhs_dilation"],
        dimension_numbers=tuple(p["dimension_numbers"]),
        feature_group_count=p["feature_group_count"],
        batch_group_count=p["batch_group_count"],
        preferred_element_type=None if pet is None else _dtype_name(pet),
        precision=_precision_repr(p.get("precision")),
    )

  @classmethod
  def from_arrays(cls, lhs: Any, rhs: Any, **conv_kwargs: Any) -> ConvSpec:
    """The spec of `lax.conv_general_dilated(lhs, rhs, **conv_kwargs)`.

    Args:
      lhs: the input (an array or anything with `.shape` and `.dtype`).
      rhs: the kernel, likewise.
      **conv_kwargs: the keyword arguments of `lax.conv_general_dilated`
        (`window_strides` defaults to all ones, `padding` to "VALID").

    Returns:
      The ConvSpec of that call (padding strings resolved, dimension numbers
      normalised), as the equation in a jaxpr would have it.
    """
    nspatial = len(lhs.shape) - 2
    conv_kwargs.setdefault("window_strides", (1,) * nspatial)
    conv_kwargs.setdefault("padding", "VALID")
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (lhs, rhs)]
    closed = jax.make_jaxpr(
        lambda l, r: lax.conv_general_dilated(l, r, **conv_kwargs))(*args)
    eqns = [e for e in closed.jaxpr.eqns
            if e.primitive.name == "conv_general_dilated"]
    return cls.from_equation(eqns[0])

  def params(self) -> dict[str, Any]:
    """The keyword params of the equation, for `conv_general_dilated_p.bind`."""
    pet = self.preferred_element_type
    return dict(
        window_strides=self.window_strides,
        padding=self.padding,
        lhs_dilation=self.lhs_dilation,
        rhs_dilation=self.rhs_dilation,
        dimension_numbers=lax.ConvDimensionNumbers(*self.dimension_numbers),
        feature_group_count=self.feature_group_count,
        batch_group_count=self.batch_group_count,
        precision=_parse_precision(self.precision),
        preferred_element_type=None if pet is None else np.dtype(
            jax.numpy.dtype(pet)),
        out_sharding=None,
    )

  @property
  def out_shape(self) -> tuple[int, ...]:
    """The shape of the equation's output."""
    return _out_aval(self).shape

  @property
  def num_spatial(self) -> int:
    """The number of spatial dimensions (2 for images)."""
    return len(self.lhs_shape) - 2

  def to_dict(self) -> dict[str, Any]:
    """A JSON-able dict (lists and strings only) that `from_dict` reads back."""
    d = dataclasses.asdict(self)
    return {k: _listify(v) for k, v in d.items()}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ConvSpec:
    """Rebuilds a spec from `to_dict`'s output; rejects unknown or missing keys.

    Args:
      d: a dict as written by `to_dict` (possibly after a JSON round-trip).

    Returns:
      The ConvSpec.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, dict) or set(d) != set(names):
      got = sorted(d) if isinstance(d, dict) else type(d).__name__
      raise AutotuneError(
          f"A ConvSpec dict must have exactly the keys {format_choices(names)}; "
          f"got {got!r}.")
    problem = _check_types(d)
    if problem is None:
      try:
        spec = cls(**d)
        _parse_precision(spec.precision)
        return spec
      except (TypeError, ValueError, AutotuneError) as e:
        problem = str(e)
    raise AutotuneError(f"Invalid ConvSpec dict {d!r}: {problem}")


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_ints(v: Any, depth: int = 1) -> bool:
  if not isinstance(v, (list, tuple)):
    return False
  if depth == 1:
    return all(_is_int(x) for x in v)
  return all(_is_ints(x, depth - 1) for x in v)


def _check_types(d: dict[str, Any]) -> str | None:
  """Says what is wrong with the field types of a ConvSpec dict, or None."""
  for key in ("lhs_shape", "rhs_shape", "window_strides", "lhs_dilation",
              "rhs_dilation"):
    if not _is_ints(d[key]):
      return f"{key} must be a list of integers, got {d[key]!r}"
  for key in ("padding", "dimension_numbers"):
    if not _is_ints(d[key], depth=2):
      return f"{key} must be a list of lists of integers, got {d[key]!r}"
  for key in ("feature_group_count", "batch_group_count"):
    if not _is_int(d[key]) or d[key] < 1:
      return f"{key} must be a positive integer, got {d[key]!r}"
  for key in ("lhs_dtype", "rhs_dtype", "out_dtype", "preferred_element_type",
              "precision"):
    optional = key in ("preferred_element_type", "precision")
    if not (isinstance(d[key], str) or (optional and d[key] is None)):
      return f"{key} must be a string{' or None' if optional else ''}, " \
             f"got {d[key]!r}"
  return None


def _listify(value: Any) -> Any:
  if isinstance(value, (tuple, list)):
    return [_listify(v) for v in value]
  return value


@functools.lru_cache(maxsize=4096)
def _out_aval(spec: ConvSpec) -> jax.ShapeDtypeStruct:
  args = (jax.ShapeDtypeStruct(spec.lhs_shape, jax.numpy.dtype(spec.lhs_dtype)),
          jax.ShapeDtypeStruct(spec.rhs_shape, jax.numpy.dtype(spec.rhs_dtype)))
  params = spec.params()
  return jax.eval_shape(
      lambda l, r: lax.conv_general_dilated_p.bind(l, r, **params), *args)
