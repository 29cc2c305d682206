"""`explain`: which kernel each bucket of a program gets, for every op family, and why.

Reads the tuning cache only: it never tunes, so it answers "what would run,
and how much faster did it measure" for a function traced once.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from typing import Any

import jax

from tunedjax import _tuning
from tunedjax._config import get_config
from tunedjax.autotune import _registry, _result
from tunedjax.autotune import _select
from tunedjax.autotune._bucket import bucket_key
from tunedjax import rewrite
from tunedjax.rewrite import iter_equations


@dataclasses.dataclass(frozen=True)
class BucketChoice:
  """One shape bucket of a program's kernel sites and what the cache holds for it.

  Attributes:
    bucket: the bucket's name (``"conv 128x32x32x32 * 3x3x1x32 float32 s1x1 fg32"``).
    count: how many sites of the program fall in it (forward and gradient
      convolutions are counted apart: they are different shapes).
    candidates: the kernels that can run it.
    kernel: the cached winner; the default (``"xla"``) when only it applies;
      None when the bucket is not in the cache (not tuned yet).
    xla_ms: the default kernel's median time when tuned, in milliseconds
      (for a bucket kept because tuning could not pay back: the time that
      decision was made from, its fastest call).
    kernel_ms: the winner's median time when tuned, in milliseconds.
    speedup: xla's time over the winner's (the median of per-round ratios).
    tuning_s: seconds tuning this bucket took.
    reason: the tuner's one-line reason.
    op: the op family (``"conv"``, ``"attention"``).
    temp_bytes: ``{kernel: bytes}``: the temporaries each candidate's
      compiled program needed when tuned (empty where not measured).
    horizon: for a bucket kept on its default untuned because tuning it
      could not pay back (`reason` starts with ``"cannot pay back"``), the
      tuning horizon (program runs) that was decided for; a run with a
      longer one tunes it. None otherwise.
    decided: how the cached decision was made: ``"predicted"`` (only the
      candidates a prediction said could win were compiled and timed),
      ``"timed"`` (every candidate), ``"kept"`` (tuning could not pay
      back); None when not in the cache or only the default applies.
    regret: the predicted winner's measured time over the best measured
      time (1.0: the prediction picked the fastest), where both are known.
    compiled: how many candidates were compiled for the decision (None
      where not known: an entry written before compile times were kept).
    compile_s: seconds compiling them took, in all.
    matched: for sites an op family's pattern found written out (a batch
      norm in primitive ops), each one's spelling and source line
      (``"two-pass rsqrt affine at net.py:12 (bn)"``).
    error_ratios: ``{kernel: ratio}``: each checked candidate's error against
      the bucket's high-precision reference (float64 where the platform has
      it) over the default's; above 3 it was rejected (empty where nothing
      was checked, or in entries written before the rule).
    predicted: the candidates in the order the tuner would predict them
      now, fastest first, for the platform asked about: from that platform's
      measurements (its device's cache), the family's priors for its machine
      class, else the family's rule for the platform (`OpFamily.presumed`),
      then those nothing predicts; empty for a family without features.
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
  op: str = ""
  temp_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  horizon: int | None = None
  decided: str | None = None
  regret: float | None = None
  compiled: int | None = None
  compile_s: float = 0.0
  matched: tuple[str, ...] = ()
  error_ratios: Mapping[str, float] = dataclasses.field(default_factory=dict)
  predicted: tuple[str, ...] = ()


def _kept_for(value: Mapping[str, Any]) -> int | None:
  """The horizon a "cannot pay back" entry was decided for, else None."""
  record = value.get("payback") or {}
  return int(record["horizon"]) if record.get("kept") else None


def _matched_by_bucket(selection: Any) -> dict[str, list[str]]:
  """``{bucket: ["<spelling> at <where>", ...]}`` of the sites patterns found."""
  matched: dict[str, list[str]] = {}
  for m in selection.tally.report().matched:
    matched.setdefault(m.bucket, []).append(f"{m.spelling} at {m.where}")
  return matched


def explain(f: Callable[..., Any], *args: Any, cache: Any = None, platform: str | None = None,
            **kwargs: Any) -> list[BucketChoice]:
  """What the tuning cache says about each convolution bucket of ``f(*args)``.

  Traces `f` (nothing runs, nothing is tuned), groups its kernel sites (the
  equations of a family's primitive, calls of `dispatch`, and computations
  a family's pattern finds written out) by the cache's bucket key, and
  looks each bucket up.

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
  selection = _select.new_selection(platform=platform, cache=cache, explain_only=True,
                                    session=_tuning.TuningSession("explain"))
  with _select.selecting(selection):  # call-site families report their buckets here
    # A fresh function: `make_jaxpr` reuses the trace of a function it traced before
    # with the same argument types, and then no call-site function runs.
    closed = jax.make_jaxpr(rewrite.transform(lambda *a, **kw: f(*a, **kw),
                                              _select.pattern_pass(cache=cache)))(
                                                  *args, **kwargs)
  by_primitive = {fam.primitive: fam for fam in _registry.op_families() if fam.primitive}
  bucket, objective = get_config().kernel.bucket, get_config().kernel.objective
  found: dict[str, list[Any]] = {}
  for eqn in iter_equations(closed):
    family = by_primitive.get(eqn.primitive.name)
    if family is None:
      continue
    spec = family.from_equation(eqn)
    candidates = _registry.applicable_kernels(spec, selection.platform, op=family.name)
    key = bucket_key(spec, candidates, bucket=bucket, family=family, objective=objective)
    entry = found.setdefault(family.label(key), [key, candidates, 0])
    entry[2] += 1
  for label, entry in selection.buckets.items():
    found.setdefault(label, [entry[0], entry[1], 0])[2] += entry[2]
  matched = _matched_by_bucket(selection)
  return [_bucket_row(name, key, candidates, count, tuple(matched.get(name, ())), selection)
          for name, (key, candidates, count) in found.items()]


def _bucket_row(name: str, key: dict[str, Any], candidates: Any, count: int,
                matched: tuple[str, ...], selection: Any) -> BucketChoice:
  """One bucket's `BucketChoice`: what the cache holds for it, if anything."""
  op = key["op"]
  family = _registry.op_family(op)
  default = family.default
  names = tuple(k.name for k in candidates)
  if names == (default,):
    return BucketChoice(name, count, names, default, reason=f"only {default} applies",
                        op=op, matched=matched, predicted=names)
  prediction = _select.predict_bucket(family, key, candidates, selection)
  predicted = prediction.order() if prediction is not None else ()
  value = _tuning.current_session().lookup(selection.cache, op, key,
                                           platform=selection.platform)
  if value is None:
    return BucketChoice(name, count, names, None, reason="not in the cache", op=op,
                        matched=matched, predicted=predicted)
  winner, timings = value["winner"], value.get("timings", {})
  base = timings.get(default) or ()
  won = timings.get(winner) or ()
  ratio = value.get("ratios", {}).get(winner)
  return BucketChoice(
      name, count, names, winner,
      xla_ms=(1e3 * value["payback"]["default_s"] if _kept_for(value) is not None
              else 1e3 * statistics.median(base) if base else None),
      kernel_ms=1e3 * statistics.median(won) if won else None,
      speedup=(1.0 / ratio) if ratio else None,
      tuning_s=float(value.get("tuning_s", 0.0)), reason=value.get("reason", ""), op=op,
      temp_bytes=dict(value.get("temp_bytes", {})), horizon=_kept_for(value),
      decided=_result.decided(value), regret=_result.regret(value),
      compiled=len(value["compile_s"]) if value.get("compile_s") else None,
      compile_s=float(sum((value.get("compile_s") or {}).values())), matched=matched,
      predicted=predicted, error_ratios=dict(value.get("error_ratios") or {}))
