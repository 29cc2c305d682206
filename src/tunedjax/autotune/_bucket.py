"""Bucket keys: the cache key under which a site's kernel choice is kept.

A bucket key is a plain JSON dict naming everything a timing depends on: the
op family and a key version, the family's own fields (shapes, exact or
rounded up to powers of two with ``kernel.bucket = "pow2"``, dtypes, every
parameter: `OpFamily.key`), and the source hash of every candidate kernel, so
that editing a kernel's code makes its old timings miss. The cache stores the
whole key, never a bare hash (Paddle's hash-only key can return a wrong
algorithm on a collision).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tunedjax._config import BUCKETS
from tunedjax._errors import BAD_CHOICE, ConfigError, format_choices

KEY_VERSION = 1


def pow2(n: int) -> int:
  """The smallest power of two >= n (n >= 1).

  Example:
    >>> [pow2(n) for n in (1, 3, 8, 9)]
    [1, 4, 8, 16]
  """
  return 1 << max(int(n) - 1, 0).bit_length()


def last_axis_exact(shape: Iterable[int], bucket: str) -> list[int]:
  """A shape as a bucket key holds it: exact, or with ``bucket="pow2"`` every axis but
  the last (channels, features) rounded up to a power of two.

  Raises:
    ConfigError: `bucket` is not one of `tunedjax._config.BUCKETS`.

  Example:
    >>> last_axis_exact((3, 5, 6, 10), "pow2"), last_axis_exact((3, 5), "exact")
    ([4, 8, 8, 10], [3, 5])
  """
  if bucket not in BUCKETS:
    raise ConfigError(BAD_CHOICE.format(key="kernel.bucket",
                                        choices=format_choices(BUCKETS), value=bucket))
  shape = [int(d) for d in shape]
  return [pow2(d) for d in shape[:-1]] + shape[-1:] if bucket == "pow2" else shape


def others_presumed(key: Mapping[str, Any], ratio: float | None,
                    default: str = "xla") -> dict[str, float]:
  """A family's rule that presumes every candidate but `default` takes `ratio` times its
  time (none where `ratio` is None): the default first until something is measured.

  Example:
    >>> others_presumed({"candidates": {"xla": "", "fused": ""}}, 1.5)
    {'fused': 1.5}
  """
  if ratio is None:
    return {}
  return {name: ratio for name in key.get("candidates", {}) if name != default}


def plain(value: Any) -> Any:
  """Turns tuples, enums, dtypes and numpy scalars into JSON-ready values.

  Example:
    >>> plain((1, (2, 3), np.int64(4)))
    [1, [2, 3], 4]
  """
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value)
  if isinstance(value, enum.Enum):
    return value.name
  if isinstance(value, Mapping):
    return {str(k): plain(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [plain(v) for v in value]
  if hasattr(value, "lhs_spec"):  # lax.ConvDimensionNumbers
    return [plain(value.lhs_spec), plain(value.rhs_spec), plain(value.out_spec)]
  return str(value)


def bucket_key(spec: Any, candidates: Iterable[Any], *, bucket: str = "exact",
               family: Any = None, objective: str = "time") -> dict[str, Any]:
  """The JSON-serializable cache key of a site's shape bucket.

  Args:
    spec: the site's spec (a `ConvSpec`, ...).
    candidates: the `Kernel`s that may run it; their names and source hashes
      are part of the key, so a changed kernel re-tunes.
    bucket: ``"exact"`` or ``"pow2"`` (the config's ``kernel.bucket``).
    family: the `OpFamily` (default: the one whose spec type `spec` has).
    objective: the config's ``kernel.objective``; a choice made for
      ``"memory"`` is kept apart (an ``"objective"`` field; ``"time"``
      keys have none, as before the option existed).

  Returns:
    A dict of plain JSON values, deterministic for equal inputs.

  Example:
    >>> import numpy as np, types
    >>> from tunedjax.ops.conv._spec import ConvSpec
    >>> spec = ConvSpec.from_arrays(np.ones((2, 4, 8, 8), np.float32),
    ...                             np.ones((4, 4, 3, 3), np.float32), padding="SAME")
    >>> xla = types.SimpleNamespace(name="xla", source_hash="abc")
    >>> key = bucket_key(spec, [xla])
    >>> key["op"], key["lhs_shape"], key["candidates"]
    ('conv', [2, 4, 8, 8], {'xla': 'abc'})
  """
  from tunedjax.autotune import _registry  # pylint: disable=import-outside-toplevel
  family = _registry.family_of(spec) if family is None else family
  key = {
      "version": KEY_VERSION,
      "op": family.name,
      "bucket": bucket,
      **plain(dict(family.key(spec, bucket))),
      "candidates": {k.name: str(k.source_hash)
                     for k in sorted(candidates, key=lambda k: k.name)},
  }
  if objective != "time":
    key["objective"] = objective
  return key

