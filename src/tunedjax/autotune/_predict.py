"""Predicting a bucket's kernel times before anything is compiled.

Every candidate of a bucket used to be compiled and timed. A prediction
ranks them first, so that only the ones that could win are compiled: the
predicted best, the default, and any whose prediction is too uncertain to
rule out. Nothing here is specific to an op family: a family describes a
bucket by numbers (`OpFamily.features`, computed from its bucket key: sizes
on a log2 scale, flags for the kinds of site that behave differently), and
the predictor compares buckets by those numbers alone.

What a prediction is made from, all of it measurements:

* what this machine has measured: every bucket of the family in the tuning
  cache (their `TuneResult` values keep each candidate's time ratio to the
  default and its compile time), the buckets tuned earlier in this run among
  them;
* priors: the same kind of measurements made on another machine of the same
  class (`machine_class`: CPU ISA level, GPU generation), shipped with the
  family as JSON data (`OpFamily.priors`, ``<folder>/<class>.json``, with
  their provenance: date, machine, JAX version, the command that measured
  them). ``benchmarks/kernel_priors.py`` regenerates them. A class belongs
  to one platform: a GPU never reads a CPU's priors (`priors` refuses a
  file whose class is not the platform's).

Where neither is near a bucket, the family's rule for the platform
(`OpFamily.presumed`: data in the family, such as "on a GPU, cuDNN's fused
attention first") gives the candidates it names a wide estimate (`RULE_SPREAD`,
``Estimate.source == "rule"``) until that platform has measured them.

For each candidate, the measured buckets near this one (a Gaussian weight of
the feature distance; a prior counts `PRIOR_WEIGHT` of a local measurement)
give a weighted mean of the log time ratio and a spread: the neighbours'
disagreement, the timing noise (`BASE_SPREAD`) and how far the nearest one is
(`DISTANCE_SPREAD` per unit). A candidate no measured bucket is near is
*unknown* and always compiled. Two kernels timed side by side in near
buckets are also compared directly (`relative`): kernels of a kind move
together from bucket to bucket, so their ratio to each other is steadier
than either's ratio to the default. `Prediction.could_win` keeps a
candidate when its optimistic time (`Z` spreads below the mean) could beat
the default by the tuner's margin and the predicted best by more than
`TOLERANCE` (or the best might not beat the default at all); with a tuning
horizon the comparison is of what each would save within it, less its
predicted compile time (a kernel that compiles for 2 s must save more than
one that compiles for 20 ms).

A prediction is never taken alone: the tuner times whatever it keeps
against the default and checks it against the reference, as for every
candidate.

Example:
  >>> p = Point(features={"size": 5.0}, ratios={"xla": 1.0, "fast": 0.05},
  ...           compile_s={"xla": 0.1, "fast": 0.02})
  >>> pred = predict({"size": 5.0}, ["xla", "fast", "slow"], [p], default="xla")
  >>> pred.best(), round(pred.estimates["fast"].ratio, 2), pred.unknown
  ('fast', 0.05, ('slow',))
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import math
import pathlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tunedjax._errors import CacheWarning

logger = logging.getLogger("tunedjax.autotune")

PRIORS_FORMAT = "tunedjax-kernel-priors"
PRIORS_VERSION = 1
# How many spreads below its mean a candidate's time may still be.
Z = 1.5
# Feature distance at which a neighbour's weight falls to exp(-1/2).
BANDWIDTH = 2.0
# A prior (another machine of this class) counts this much of a local measurement.
PRIOR_WEIGHT = 0.5
# Below this total weight a candidate's prediction is unknown (it is compiled).
MIN_SUPPORT = 0.05
# Log-ratio spread of one measured ratio (timing noise), and its growth per
# unit of distance to the nearest measured bucket.
BASE_SPREAD = 0.10
DISTANCE_SPREAD = 0.10
# A candidate that could beat the predicted best by less than this fraction
# is not worth compiling: the most it could have saved over it.
TOLERANCE = 0.20
# Log-ratio spread of an estimate from a family's rule (`OpFamily.presumed`):
# an order, not a measurement (at Z spreads, a presumed 2x stays above 1.37x).
RULE_SPREAD = 0.25


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured bucket: its features, each candidate's time ratio to the
  default and compile seconds.

  Attributes:
    features: the family's numbers for the bucket (`OpFamily.features`).
    ratios: ``{kernel: time / default's time}`` of the candidates timed.
    compile_s: ``{kernel: seconds}`` compiling each took (may be empty).
    source: ``"measured"`` (this machine) or ``"prior"`` (shipped data).
  """

  features: Mapping[str, float]
  ratios: Mapping[str, float]
  compile_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
  source: str = "measured"


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A candidate's predicted time ratio to the default, with its spread.

  Attributes:
    ratio: predicted time / the default's time (geometric mean of the neighbours').
    spread: standard deviation of the log ratio.
    compile_s: predicted compile seconds, or None where no neighbour recorded one.
    support: the neighbours' total weight.
    source: ``"measured"`` (from measured buckets: this machine's or priors)
      or ``"rule"`` (the family's rule for a platform with nothing measured
      near, `OpFamily.presumed`).
  """

  ratio: float
  spread: float
  compile_s: float | None = None
  support: float = 0.0
  source: str = "measured"

  @property
  def low(self) -> float:
    """The optimistic ratio (`Z` spreads below the mean)."""
    return self.ratio * math.exp(-Z * self.spread)

  @property
  def high(self) -> float:
    """The pessimistic ratio (`Z` spreads above the mean)."""
    return self.ratio * math.exp(Z * self.spread)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Each candidate's `Estimate` for one bucket, or why it has none.

  Attributes:
    default: the family's default kernel (ratio 1 by definition).
    estimates: ``{kernel: Estimate}`` of the other candidates with a prediction.
    unknown: the other candidates no measured bucket is near.
    pairs: ``{(a, b): Estimate}``: kernel a's time over kernel b's, from
      the measured buckets that timed both (`relative`).
  """

  default: str
  estimates: Mapping[str, Estimate]
  unknown: tuple[str, ...] = ()
  pairs: Mapping[tuple[str, str], Estimate] = dataclasses.field(default_factory=dict)

  def best(self) -> str:
    """The candidate predicted fastest (the default unless one is predicted below 1)."""
    name = min(self.estimates, key=lambda n: self.estimates[n].ratio, default=self.default)
    return name if name != self.default and self.estimates[name].ratio < 1.0 else self.default

  def ratios(self) -> dict[str, float]:
    """``{kernel: predicted ratio}``, the default's 1.0 included."""
    return {self.default: 1.0, **{n: e.ratio for n, e in self.estimates.items()}}

  def order(self) -> tuple[str, ...]:
    """The candidates predicted fastest first (the default at 1.0), then the unknown.

    Example:
      >>> Prediction("xla", {"a": Estimate(2.0, 0.1), "b": Estimate(0.5, 0.1)}, ("c",)).order()
      ('b', 'xla', 'a', 'c')
    """
    ratios = self.ratios()
    return (*sorted(ratios, key=lambda n: (ratios[n], n != self.default)), *self.unknown)

  def could_win(self, *, margin: float, horizon_s: float | None = None,
                default_compile_s: float = 0.0) -> tuple[list[str], dict[str, str]]:
    """The candidates worth compiling, and why each other one is not.

    Args:
      margin: the tuner's margin: a kernel must take under ``1 / (1 + margin)``
        of the default's time to be chosen.
      horizon_s: the default's time x sites x horizon: the seconds the
        default would take within the tuning horizon (None: unbounded; the
        compile times then do not matter).
      default_compile_s: the stand-in for a candidate whose compile time
        no neighbour recorded.

    Returns:
      ``(kept, pruned)``: the names to compile (the default first), and
      ``{name: reason}`` for the others.

    Example:
      >>> pred = Prediction("xla", {"fast": Estimate(0.1, 0.1), "meh": Estimate(0.9, 0.1)})
      >>> pred.could_win(margin=0.1)
      (['xla', 'fast'], {'meh': 'predicted 0.9x xla (at best 0.77x), fast 0.1x'})
    """
    threshold = 1.0 / (1.0 + margin)

    def compile_of(name: str) -> float:
      if horizon_s is None or name == self.default:
        return 0.0
      est = self.estimates.get(name)
      return est.compile_s if est is not None and est.compile_s is not None else default_compile_s

    def value(name: str, ratio: float) -> float:  # higher is better
      if horizon_s is None:
        return -ratio
      return horizon_s * (1.0 - ratio) - compile_of(name)

    # The best: the fastest, or within a horizon the one that saves the most
    # after its compile.
    best = self.best() if horizon_s is None else max(
        [self.default, *self.estimates],
        key=lambda n: value(n, 1.0 if n == self.default else self.estimates[n].ratio))
    best_est = self.estimates.get(best)
    kept, pruned = [self.default], {}
    for name, est in self.estimates.items():
      if name == best:
        kept.append(name)
        continue
      if est.low >= threshold:
        pruned[name] = (f"{_verb(est)} {est.ratio:.2g}x {self.default} (at best "
                        f"{est.low:.2g}x, needs < {threshold:.2f}x)")
        continue
      if best_est is None:  # the default is predicted best: a candidate against it alone
        if value(name, est.low) >= value(self.default, 1.0):
          kept.append(name)
        else:
          pruned[name] = (f"{_verb(est)} {est.ratio:.2g}x {self.default} (at best "
                          f"{est.low:.2g}x): cannot save its compile "
                          f"({est.compile_s or default_compile_s:.2g} s) within the horizon")
        continue
      if self._worth(name, best, value, threshold, best_compile_s=compile_of(best)):
        kept.append(name)
      else:
        pruned[name] = (f"{_verb(est)} {est.ratio:.2g}x {self.default} (at best "
                        f"{est.low:.2g}x), {best} {best_est.ratio:.2g}x")
    return kept + list(self.unknown), pruned


  def _worth(self, name: str, best: str, value: Callable[[str, float], float],
             threshold: float, *, best_compile_s: float = 0.0) -> bool:
    """Whether candidate `name` could beat the predicted `best` by more than
    `TOLERANCE`, or win where the best might not beat the default.

    Within a horizon the best is compiled anyway: `name` is worth its own
    compile only if what it could save beyond the best's time pays for it
    (``value(name, low) >= value(best, high) + best_compile_s``)."""
    est, best_est = self.estimates[name], self.estimates[best]
    pair = self.pairs.get((name, best))
    if pair is not None:  # timed side by side before: their ratio to each other
      high = min(best_est.ratio, 1.0)
      low = high * pair.low
    else:  # their spreads combined: optimistic for this one, pessimistic for the best
      both = math.hypot(est.spread, best_est.spread) * Z
      low = est.ratio * math.exp(-both * est.spread / (est.spread + best_est.spread))
      high = min(best_est.ratio * math.exp(both * best_est.spread
                                           / (est.spread + best_est.spread)), 1.0)
    floor = value(self.default, 1.0)
    if value(name, low * (1.0 + TOLERANCE)) >= max(value(best, high) + best_compile_s, floor):
      return True
    # The best itself may fail to beat the default: then this one is a second chance.
    return best_est.high > threshold and est.low < threshold and value(name, est.low) >= floor


def _verb(est: Estimate) -> str:
  """How a pruned candidate's reason says it was ranked."""
  return ("presumed by the platform's rule (nothing measured)" if est.source == "rule"
          else "predicted")


def _distance(a: Mapping[str, float], b: Mapping[str, float]) -> float:
  return math.sqrt(sum((a.get(k, 0.0) - b.get(k, 0.0)) ** 2 for k in {*a, *b}))


def estimate(features: Mapping[str, float], name: str, points: Iterable[Point]
             ) -> Estimate | None:
  """Kernel `name`'s predicted ratio for a bucket with `features`, from measured `points`.

  Returns None (unknown) when no measured bucket near enough timed it.

  Example:
    >>> pts = [Point({"n": 4.0}, {"k": 0.5}), Point({"n": 6.0}, {"k": 0.5})]
    >>> round(estimate({"n": 5.0}, "k", pts).ratio, 3), estimate({"n": 50.0}, "k", pts)
    (0.5, None)
  """
  return _weighted(_near(features, points), lambda p: p.ratios.get(name),
                   lambda p: p.compile_s.get(name))


def relative(features: Mapping[str, float], name: str, other: str, points: Iterable[Point]
             ) -> Estimate | None:
  """Kernel `name`'s predicted time over kernel `other`'s, from the measured
  buckets that timed both (None where none near enough did).

  Kernels of a kind move together from bucket to bucket (two depthwise
  kernels are both 30x faster than the default here, both 10x there), so
  their ratio to each other is far steadier than either's ratio to the
  default: comparing them this way rules out many more candidates.

  Example:
    >>> pts = [Point({"n": 4.0}, {"a": 0.02, "b": 0.04}), Point({"n": 6.0}, {"a": 0.2, "b": 0.4})]
    >>> round(relative({"n": 5.0}, "a", "b", pts).ratio, 3)
    0.5
  """
  def ratio(p: Point) -> float | None:
    a, b = p.ratios.get(name), p.ratios.get(other)
    return a / b if a is not None and b is not None and a > 0 and b > 0 else None

  return _weighted(_near(features, points), ratio, lambda p: None)


def _near(features: Mapping[str, float], points: Iterable[Point]
          ) -> list[tuple[Point, float, float]]:
  """``(point, weight, distance)`` of the points with a weight worth counting."""
  near = []
  for p in points:
    d = _distance(features, p.features)
    w = math.exp(-0.5 * (d / BANDWIDTH) ** 2) * (PRIOR_WEIGHT if p.source == "prior" else 1.0)
    if w > 1e-12:
      near.append((p, w, d))
  return near


def _weighted(near: Iterable[tuple[Point, float, float]],
              ratio_of: Callable[[Point], float | None],
              compile_of: Callable[[Point], float | None]) -> Estimate | None:
  """The weighted geometric mean of `ratio_of` over the `near` points."""
  logs, compiles, weights, nearest = [], [], [], math.inf
  for p, w, d in near:
    r = ratio_of(p)
    if r is None or not r > 0:
      continue
    logs.append(math.log(r))
    weights.append(w)
    compiles.append(compile_of(p))
    nearest = min(nearest, d)
  support = sum(weights)
  if support < MIN_SUPPORT:
    return None
  mean = sum(w * x for w, x in zip(weights, logs)) / support
  var = sum(w * (x - mean) ** 2 for w, x in zip(weights, logs)) / support
  spread = math.sqrt(var + BASE_SPREAD ** 2 + (DISTANCE_SPREAD * nearest) ** 2)
  timed = [(w, c) for w, c in zip(weights, compiles) if c is not None and c > 0]
  compile_s = (math.exp(sum(w * math.log(c) for w, c in timed) / sum(w for w, _ in timed))
               if timed else None)
  return Estimate(math.exp(mean), spread, compile_s, support)


def predict(features: Mapping[str, float], candidates: Sequence[str], points: Sequence[Point],
            *, default: str, presumed: Mapping[str, float] | None = None) -> Prediction:
  """Each candidate's `Estimate` from measured `points` (see the module docstring).

  Args:
    features: the bucket's features.
    candidates: the applicable kernels' names (the default among them).
    points: the measured buckets (this machine's and the priors).
    default: the family's default kernel.
    presumed: ``{kernel: time ratio to the default}``: the family's rule for
      this platform (`OpFamily.presumed`), for the candidates no measured
      bucket is near; their estimates get `RULE_SPREAD` and ``source="rule"``.

  Returns:
    A `Prediction`.

  Example:
    >>> pred = predict({"n": 1.0}, ["xla", "fast", "other", "new"], [], default="xla",
    ...                presumed={"fast": 0.25, "other": 2.0})
    >>> pred.order(), pred.estimates["fast"].source, pred.could_win(margin=0.1)[0]
    (('fast', 'xla', 'other', 'new'), 'rule', ['xla', 'fast', 'new'])
  """
  near = _near(features, points)
  estimates, unknown = {}, []
  rule = {str(k): float(v) for k, v in (presumed or {}).items()
          if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}
  for name in candidates:
    if name == default:
      continue
    est = _weighted(near, lambda p, n=name: p.ratios.get(n),
                    lambda p, n=name: p.compile_s.get(n))
    if est is None and name in rule:
      est = Estimate(rule[name], RULE_SPREAD, source="rule")
    if est is None:
      unknown.append(name)
    else:
      estimates[name] = est

  def ratio(p: Point, a: str, b: str) -> float | None:
    x, y = p.ratios.get(a), p.ratios.get(b)
    return x / y if x is not None and y is not None and x > 0 and y > 0 else None

  pairs = {(a, b): e for a in estimates for b in estimates if a != b
           for e in [_weighted(near, lambda p, a=a, b=b: ratio(p, a, b), lambda p: None)]
           if e is not None}
  return Prediction(default, estimates, tuple(unknown), pairs)


# -- what has been measured -----------------------------------------------------


def point_from_value(features: Mapping[str, float], value: Mapping[str, Any], *,
                     default: str, source: str = "measured") -> Point | None:
  """The `Point` a tuning result (`TuneResult.to_value`) gives, or None when it
  timed nothing but the default (a bucket kept untuned, one candidate)."""
  ratios = {str(k): float(v) for k, v in (value.get("ratios") or {}).items()
            if isinstance(v, (int, float)) and v > 0}
  if not ratios:
    return None
  compile_s = {str(k): float(v) for k, v in (value.get("compile_s") or {}).items()
               if isinstance(v, (int, float)) and v > 0}
  return Point(dict(features), {default: 1.0, **ratios}, compile_s, source)


def measured_points(family: Any, entries: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]
                    ) -> list[Point]:
  """Points from ``(bucket key, value)`` pairs of the family's cache namespace.

  An entry whose key the family cannot describe (another version's) is left out.
  """
  points = []
  for key, value in entries:
    try:
      features = family.features(key)
    except Exception:  # pylint: disable=broad-except  # an old or foreign key
      continue
    point = point_from_value(features, value, default=family.default)
    if point is not None:
      points.append(point)
  return points


# -- priors shipped as data ------------------------------------------------------


def machine_class(fingerprint: Any) -> tuple[str, ...]:
  """The classes of machine whose priors fit this one, the closest first.

  CPUs by ISA level (``cpu-avx512``, ``cpu-avx2``, ``cpu-neon``, ``cpu``), GPUs by
  compute capability (``gpu-sm90``), TPUs by device kind; every class of a
  platform is named after it (`class_platform`), and only a CPU's classes
  are CPU classes (another platform, ``"METAL"``, gets its own name alone).

  Example:
    >>> import types
    >>> fp = types.SimpleNamespace(platform="cpu", cpu_features=("avx2", "avx512f", "fma"),
    ...                            compute_capability=None, device_kind="cpu")
    >>> machine_class(fp)
    ('cpu-avx512', 'cpu-avx2', 'cpu')
  """
  platform = fingerprint.platform
  if platform == "gpu" or fingerprint.compute_capability:
    cc = str(fingerprint.compute_capability or "").replace(".", "")
    return (f"gpu-sm{cc}", "gpu") if cc else ("gpu",)
  if platform == "tpu":
    kind = "".join(c if c.isalnum() else "-" for c in str(fingerprint.device_kind).lower())
    return (f"tpu-{kind}", "tpu")
  if platform != "cpu":
    return (str(platform).lower(),)
  features = set(fingerprint.cpu_features)
  classes = []
  if "avx512f" in features:
    classes.append("cpu-avx512")
  if "avx2" in features:
    classes.append("cpu-avx2")
  if features & {"neon", "asimd", "sve"}:
    classes.append("cpu-neon")
  return (*classes, "cpu")


def class_platform(name: str) -> str:
  """The platform a machine class belongs to: ``"gpu"`` for ``"gpu-sm90"``.

  Example:
    >>> class_platform("cpu-avx512"), class_platform("gpu")
    ('cpu', 'gpu')
  """
  return str(name).partition("-")[0]


def priors_file(folder: Any, classes: Sequence[str]) -> pathlib.Path | None:
  """The first ``<folder>/<class>.json`` that exists, or None."""
  for name in classes:
    path = pathlib.Path(folder) / f"{name}.json"
    if path.is_file():
      return path
  return None


def read_priors(path: Any, *, family: str, machine: str | None = None
                ) -> list[dict[str, Any]]:
  """The bucket records of a priors file; raises ValueError on a malformed one,
  or on one measured on another class of machine than `machine` (when given).

  A file is ``{"format": "tunedjax-kernel-priors", "version": 1, "family":
  ..., "machine_class": ..., "provenance": {...}, "buckets": [{"features":
  {...}, "ratios": {...}, "compile_s": {...}, ...}, ...]}``.
  """
  data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  if not isinstance(data, dict) or data.get("format") != PRIORS_FORMAT:
    raise ValueError(f"not a {PRIORS_FORMAT} file")
  if data.get("version") != PRIORS_VERSION:
    raise ValueError(f"version {data.get('version')!r}, expected {PRIORS_VERSION}")
  if data.get("family") != family:
    raise ValueError(f"priors of family {data.get('family')!r}, expected {family!r}")
  if machine is not None and data.get("machine_class") != machine:
    raise ValueError(f"measured on machine class {data.get('machine_class')!r}, not "
                     f"{machine!r} as its name says")
  buckets = data.get("buckets")
  if not isinstance(buckets, list):
    raise ValueError("'buckets' must be a list")
  for i, b in enumerate(buckets):
    ok = isinstance(b, dict) and all(
        isinstance(b.get(f), dict) and all(isinstance(v, (int, float)) and math.isfinite(v)
                                           for v in b[f].values())
        for f in ("features", "ratios"))
    if not ok or not isinstance(b.get("compile_s", {}), dict):
      raise ValueError(f"bucket {i} needs numeric 'features' and 'ratios' dicts")
  return buckets


@functools.lru_cache(maxsize=64)
def _load_priors(folder: str, classes: tuple[str, ...], family: str, default: str
                 ) -> tuple[Point, ...]:
  path = priors_file(folder, classes)
  if path is None:
    logger.info("autotune: no %s priors for %s in %s; unmeasured candidates are compiled",
                family, "/".join(classes), folder)
    return ()
  try:
    buckets = read_priors(path, family=family, machine=path.stem)
  except (OSError, ValueError) as e:
    warnings.warn(f"tunedjax: the {family} kernel priors {path} cannot be read ({e}); "
                  "tuning without them (every unmeasured candidate is compiled).",
                  CacheWarning, stacklevel=3)
    return ()
  return tuple(p for p in (point_from_value(b["features"], b, default=default, source="prior")
                           for b in buckets) if p is not None)


def priors(family: Any, fingerprint: Any, platform: str | None = None) -> tuple[Point, ...]:
  """The family's priors for this machine's class, as `Point`s; none when the
  family ships none, or (with a `CacheWarning`) when its file is unreadable.

  Args:
    family: the `OpFamily`.
    fingerprint: the device's `DeviceFingerprint` (its `machine_class`), or
      a tuple of machine classes (for a platform this process has no device
      of: ``("gpu",)``).
    platform: the platform the priors are for (default: the fingerprint's);
      a class of another platform is never read, so a GPU's decisions never
      rest on a CPU's measurements.
  """
  folder = getattr(family, "priors", None)
  if folder is None or getattr(family, "features", None) is None:
    return ()
  classes = tuple(fingerprint) if isinstance(fingerprint, tuple) else machine_class(fingerprint)
  if platform is None and not isinstance(fingerprint, tuple):
    platform = "gpu" if fingerprint.compute_capability else fingerprint.platform
  if platform is not None:
    classes = tuple(c for c in classes if class_platform(c) == str(platform).lower())
  return _load_priors(str(folder), classes, family.name, family.default) if classes else ()


def provenance(*, machine: str, jax_version: str, command: str) -> dict[str, str]:
  """The provenance record a priors file carries (``date`` is now, UTC)."""
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": machine, "jax_version": jax_version, "command": command}
