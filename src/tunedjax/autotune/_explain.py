"""`explain`: which kernel each convolution bucket of a program gets, and why.

Reads the tuning cache only: it never tunes, so it answers "what would run,
and how much faster did it measure" for a function traced once.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import jax

from tunedjax._config import get_config
from tunedjax.autotune import _registry
from tunedjax.autotune import _select
from tunedjax.autotune._bucket import bucket_key
from tunedjax.autotune._bucket import describe
from tunedjax.rewrite import iter_equations


@dataclasses.dataclass(frozen=True)
class BucketChoice:
  """One shape bucket of a program's convolutions and what the cache holds for it.

  Attributes:
    bucket: the bucket's name (``"conv 128x32x32x32 * 3x3x1x32 float32 s1x1 fg32"``).
    count: how many convolutions of the program fall in it (forward and
      gradient convolutions are counted apart: they are different shapes).
    candidates: the kernels that can run it.
    kernel: the cached winner; ``"xla"`` when only xla applies; None when the
      bucket is not in the cache (not tuned yet).
    xla_ms: xla's median time when tuned, in milliseconds.
    kernel_ms: the winner's median time when tuned, in milliseconds.
    speedup: xla's time over the winner's (the median of per-round ratios).
    tuning_s: seconds tuning this bucket took.
    reason: the tuner's one-line reason.
  """

  bucket: str
  count: int
  candidates: tuple[str, ...]
  kernel: str | None
  xla_ms: float | None = None
  kernel_ms: float | None = None
  speedup: float | None = None
  tuning_s: float = 0.0
  reason: str = ""


def explain(f: Callable[..., Any], *args: Any, cache: Any = None, platform: str | None = None,
            **kwargs: Any) -> list[BucketChoice]:
  """What the tuning cache says about each convolution bucket of ``f(*args)``.

  Traces `f` (nothing runs, nothing is tuned), groups its convolutions by
  the cache's bucket key, and looks each bucket up.

  Args:
    f: the function, as you would pass it to `select_kernels`.
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`).
    cache: the tuning cache (None: the config's).
    platform: the platform (default: JAX's default backend).
    **kwargs: keyword arguments for `f`.

  Returns:
    One `BucketChoice` per bucket, in the order the program first uses them.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp
    >>> conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
    >>> rows = explain(conv, jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3)),
    ...                cache=tempfile.mkdtemp())
    >>> rows[0].count, rows[0].kernel  # not tuned yet
    (1, None)
  """
  platform = _registry.canonical_platform(platform or jax.default_backend())
  bucket = get_config().kernel.bucket
  store = _select._resolve_cache(cache)  # pylint: disable=protected-access
  closed = jax.make_jaxpr(f)(*args, **kwargs)
  counts: dict[str, int] = collections.Counter()
  found: dict[str, tuple[dict[str, Any], list[Any]]] = {}
  for eqn in iter_equations(closed):
    if eqn.primitive.name != _select.PRIMITIVE:
      continue
    spec = _registry.ConvSpec.from_equation(eqn)
    candidates = _registry.applicable_kernels(spec, platform)
    key = bucket_key(spec, candidates, bucket=bucket, op=_select.OP)
    name = describe(key)
    counts[name] += 1
    found.setdefault(name, (key, candidates))
  rows = []
  for name, (key, candidates) in found.items():
    names = tuple(k.name for k in candidates)
    if names == ("xla",):
      rows.append(BucketChoice(name, counts[name], names, "xla", reason="only xla applies"))
      continue
    value = _select._lookup(store, key)  # pylint: disable=protected-access
    if value is None:
      rows.append(BucketChoice(name, counts[name], names, None, reason="not in the cache"))
      continue
    winner, timings = value["winner"], value.get("timings", {})
    xla = timings.get("xla") or ()
    won = timings.get(winner) or ()
    ratio = value.get("ratios", {}).get(winner)
    rows.append(BucketChoice(
        name, counts[name], names, winner,
        xla_ms=1e3 * statistics.median(xla) if xla else None,
        kernel_ms=1e3 * statistics.median(won) if won else None,
        speedup=(1.0 / ratio) if ratio else None,
        tuning_s=float(value.get("tuning_s", 0.0)), reason=value.get("reason", "")))
  return rows
