"""The built-in ``"conv"`` op family: every `conv_general_dilated` equation is a site.

Its spec is `ConvSpec`; its bucket key holds the operand shapes (exact, or
batch and spatial sizes rounded up to powers of two with ``kernel.bucket =
"pow2"``), the dtypes and every convolution parameter; its kernels are
``xla`` (the equation as written, the reference), ``matmul_1x1``, ``im2col``,
``window_matmul``, ``fft``, ``depthwise``, ``depthwise_native`` (C++, CPU,
where the native library builds), ``pallas``, ``direct_native`` (C++,
CPU: dense windows up to 7x7 and their weight gradients) and
``matmul_1x1_native`` (C++, CPU: 1x1 convolutions and their gradients).

Example:
  >>> from tunedjax import autotune
  >>> family = autotune.op_family("conv")
  >>> family.default, family.primitive
  ('xla', 'conv_general_dilated')
"""

from __future__ import annotations

import importlib
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax import lax

from tunedjax._config import BUCKETS
from tunedjax._errors import BAD_CHOICE, ConfigError, format_choices
from tunedjax._tuning import random_array
from tunedjax import autotune
from tunedjax.autotune._bucket import pow2, plain
from tunedjax.ops.conv._spec import ConvSpec

NAME = "conv"
PRIMITIVE = "conv_general_dilated"
_KERNEL_MODULES = ("_xla", "_matmul", "_fft", "_depthwise", "_native_depthwise", "_pallas",
                   "_native_direct", "_native_1x1")


def bucket_shapes(spec: Any, bucket: str = "exact") -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The (lhs, rhs) shapes that stand for `spec` in its bucket.

  With ``"pow2"`` the batch and spatial dimensions of the input are rounded
  up to powers of two; the channels and the whole kernel shape stay exact
  (they decide which kernels apply), and so does the input's batch
  dimension when ``batch_group_count > 1`` (a weight-gradient convolution,
  whose "batch" is a channel dimension).

  Args:
    spec: a `ConvSpec`.
    bucket: ``"exact"`` or ``"pow2"``.

  Returns:
    ``(lhs_shape, rhs_shape)`` as tuples of ints.

  Example:
    >>> import types
    >>> spec = types.SimpleNamespace(lhs_shape=(3, 30, 30, 8), rhs_shape=(3, 3, 8, 16),
    ...     dimension_numbers=((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)), batch_group_count=1)
    >>> bucket_shapes(spec, "pow2")
    ((4, 32, 32, 8), (3, 3, 8, 16))
  """
  if bucket not in BUCKETS:
    raise ConfigError(BAD_CHOICE.format(key="kernel.bucket",
                                        choices=format_choices(BUCKETS), value=bucket))
  lhs = tuple(int(d) for d in spec.lhs_shape)
  rhs = tuple(int(d) for d in spec.rhs_shape)
  if bucket == "exact":
    return lhs, rhs
  lhs_spec = tuple(plain(spec.dimension_numbers)[0])
  rounded = list(lhs)
  batch_dim, spatial = lhs_spec[0], lhs_spec[2:]
  dims = list(spatial) + ([batch_dim] if spec.batch_group_count == 1 else [])
  for d in dims:
    rounded[d] = pow2(rounded[d])
  return tuple(rounded), rhs


def conv_key(spec: Any, bucket: str = "exact") -> dict[str, Any]:
  """What a convolution's timing depends on: shapes (bucketed), dtypes, parameters.

  Args:
    spec: a `ConvSpec` (the equation's shapes, dtypes and parameters).
    bucket: ``"exact"`` or ``"pow2"`` (see `bucket_shapes`).

  Returns:
    A dict of plain JSON values, deterministic for equal inputs.

  Example:
    >>> import types
    >>> spec = types.SimpleNamespace(lhs_shape=(2, 8, 8, 4), rhs_shape=(3, 3, 4, 4),
    ...     lhs_dtype="float32", rhs_dtype="float32", out_dtype="float32",
    ...     window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(1, 1),
    ...     rhs_dilation=(1, 1), dimension_numbers=((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2)),
    ...     feature_group_count=1, batch_group_count=1, preferred_element_type=None,
    ...     precision=None)
    >>> key = conv_key(spec)
    >>> key["lhs_shape"], key["padding"]
    ([2, 8, 8, 4], [[1, 1], [1, 1]])
  """
  lhs, rhs = bucket_shapes(spec, bucket)
  return {
      "lhs_shape": list(lhs),
      "rhs_shape": list(rhs),
      "lhs_dtype": _dtype_name(spec.lhs_dtype),
      "rhs_dtype": _dtype_name(spec.rhs_dtype),
      "out_dtype": _dtype_name(spec.out_dtype),
      "window_strides": plain(spec.window_strides),
      "padding": plain(spec.padding),
      "lhs_dilation": plain(spec.lhs_dilation),
      "rhs_dilation": plain(spec.rhs_dilation),
      "dimension_numbers": plain(spec.dimension_numbers),
      "feature_group_count": int(spec.feature_group_count),
      "batch_group_count": int(spec.batch_group_count),
      "preferred_element_type": _dtype_name(spec.preferred_element_type),
      "precision": plain(spec.precision),
  }


def describe_conv(key: Mapping[str, Any]) -> str:
  """A short human-readable name of a bucket, for logs and reports.

  Example:
    >>> describe_conv({"lhs_shape": [8, 56, 56, 128], "rhs_shape": [3, 3, 1, 128],
    ...           "lhs_dtype": "float32", "window_strides": [1, 1],
    ...           "feature_group_count": 128, "batch_group_count": 1})
    'conv 8x56x56x128 * 3x3x1x128 float32 s1x1 fg128'
  """
  parts = [
      f"{key.get('op', 'conv')} " + "x".join(map(str, key["lhs_shape"])),
      "* " + "x".join(map(str, key["rhs_shape"])),
      str(key["lhs_dtype"]),
      "s" + "x".join(map(str, key["window_strides"])),
  ]
  if key.get("lhs_dilation") and any(d != 1 for d in key["lhs_dilation"]):
    parts.append("ld" + "x".join(map(str, key["lhs_dilation"])))
  if key.get("feature_group_count", 1) != 1:
    parts.append(f"fg{key['feature_group_count']}")
  if key.get("batch_group_count", 1) != 1:
    parts.append(f"bg{key['batch_group_count']}")
  return " ".join(parts)


def _dtype_name(dtype: Any) -> str | None:
  if dtype is None:
    return None
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)


def conv_operands(spec: ConvSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """Random input and kernel of the spec's shapes and dtypes."""
  return (random_array(spec.lhs_shape, spec.lhs_dtype, rng),
          random_array(spec.rhs_shape, spec.rhs_dtype, rng))


def _log2(n: float) -> float:
  return math.log2(max(float(n), 1.0))


def conv_features(key: Mapping[str, Any]) -> dict[str, float]:
  """Numbers that describe a convolution bucket, for predicting its kernels' times.

  Sizes on a log2 scale (batch, spatial side, channels in and out, window
  side, stride), so that doubling one is a distance of 1; the kinds of
  convolution the kernels treat differently (depthwise, grouped, a weight
  gradient's batch groups, an input gradient's dilated input, a dilated
  window, channels-last or not, the dtype's size) as flags of weight 3, so
  that a depthwise bucket is never a close neighbour of a dense one.

  Example:
    >>> key = {"lhs_shape": [8, 32, 32, 64], "rhs_shape": [3, 3, 1, 64],
    ...        "dimension_numbers": [[0, 3, 1, 2], [3, 2, 0, 1], [0, 3, 1, 2]],
    ...        "window_strides": [1, 1], "lhs_dilation": [1, 1], "rhs_dilation": [1, 1],
    ...        "feature_group_count": 64, "batch_group_count": 1, "lhs_dtype": "float32"}
    >>> f = conv_features(key)
    >>> f["depthwise"], f["cin"], f["spatial"], f["window"]
    (3.0, 6.0, 5.0, 1.584962500721156)
  """
  lhs, rhs = key["lhs_shape"], key["rhs_shape"]
  lhs_spec, rhs_spec, _ = key["dimension_numbers"]
  spatial = [lhs[d] for d in lhs_spec[2:]] or [1]
  window = [rhs[d] for d in rhs_spec[2:]] or [1]
  groups, batch_groups = int(key["feature_group_count"]), int(key["batch_group_count"])
  depthwise = groups > 1 and rhs[rhs_spec[1]] == 1
  flag = lambda b: 3.0 if b else 0.0  # pylint: disable=unnecessary-lambda-assignment
  return {
      "batch": _log2(lhs[lhs_spec[0]]),
      "spatial": sum(map(_log2, spatial)) / len(spatial),
      "cin": _log2(lhs[lhs_spec[1]]),
      "cout": _log2(rhs[rhs_spec[0]]),
      "window": sum(map(_log2, window)) / len(window),
      "stride": _log2(max(key["window_strides"] or [1])),
      "depthwise": flag(depthwise),
      "grouped": flag(groups > 1 and not depthwise),
      "batch_groups": flag(batch_groups > 1),
      "lhs_dilated": flag(any(d > 1 for d in key.get("lhs_dilation") or ())),
      "rhs_dilated": flag(any(d > 1 for d in key.get("rhs_dilation") or ())),
      "channels_last": flag(lhs_spec[1] == len(lhs) - 1),
      "itemsize": 2.0 * _log2(np.dtype(key["lhs_dtype"]).itemsize),
  }


def conv_precise(lhs: Any, rhs: Any, spec: ConvSpec) -> Any:
  """The accuracy reference (`OpFamily.precise`): the equation at `Precision.HIGHEST`,
  its output in the operands' dtype (no narrower ``preferred_element_type``).

  Example:
    >>> x, w = np.ones((1, 4, 4, 2)), np.ones((3, 3, 2, 5))
    >>> spec = ConvSpec.from_arrays(x.astype(np.float32), w.astype(np.float32),
    ...                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> float(conv_precise(x.astype(np.float32), w.astype(np.float32), spec)[0, 0, 0, 0])
    18.0
  """
  highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
  return lax.conv_general_dilated_p.bind(
      lhs, rhs, **{**spec.params(), "precision": highest, "preferred_element_type": None})


# Each kernel's time over xla's as presumed on a platform that has measured
# nothing near a bucket (no entries in its device's cache, no priors for its
# machine class). On a GPU, xla's convolution is cuDNN's, its algorithm chosen by
# XLA's own autotuner: xla comes first and every other kernel (the Pallas one, the
# matmul rewrites) is presumed slower, so none is compiled until the GPU's own
# measurements or priors (`benchmarks/kernel_priors.py` run on a GPU) say
# otherwise. No GPU measurement of them exists yet. Platforms not named have no
# rule: their unmeasured kernels are compiled and timed.
PRESUMED = {"gpu": 1.5}


def conv_presumed(key: Mapping[str, Any], platform: str) -> dict[str, float]:
  """The family's rule for a platform with nothing measured near a bucket (`PRESUMED`).

  Example:
    >>> conv_presumed({"candidates": {"xla": "", "pallas": ""}}, "gpu")
    {'pallas': 1.5}
    >>> conv_presumed({"candidates": {"xla": "", "pallas": ""}}, "cpu")
    {}
  """
  ratio = PRESUMED.get(platform)
  if ratio is None:
    return {}
  return {name: ratio for name in key.get("candidates", {}) if name != "xla"}


FAMILY = autotune.OpFamily(
    name=NAME, spec_type=ConvSpec, key=conv_key, operands=conv_operands, default="xla",
    primitive=PRIMITIVE, from_equation=ConvSpec.from_equation, describe=describe_conv,
    features=conv_features, priors=pathlib.Path(__file__).resolve().parent / "priors",
    presumed=conv_presumed, precise=conv_precise)


def register() -> None:
  """Registers the family and its built-in kernels, in order (xla first)."""
  autotune.register_op_family(FAMILY, replace=True)
  for module_name in _KERNEL_MODULES:
    module = importlib.import_module(f"{__package__}.{module_name}")
    for name, fn, applicable in module.KERNELS:
      autotune.register_kernel(NAME, name, fn, applicable=applicable, replace=True)
