"""Tuning one bucket: check every candidate kernel, time the survivors, pick one.

For a site of any op family the tuner draws random operands of the bucket's
shapes (`OpFamily.operands`; never zeros: a kernel that ignores its input
must not pass), computes the reference with the family's default kernel
(``xla``), and runs every other applicable candidate inside
try/except. A candidate that raises (XLA:CPU's YNNPACK failure in an im2col
backward is a real example) is logged and skipped; one whose result differs
from the reference beyond its dtype's tolerance is dropped. The survivors are
timed side by side with `time_interleaved` (the call that checks each result is
timed too, side by side, as a screening round that drops any that takes over
`SCREEN_FACTOR` times xla's time), and a candidate wins only if the
median of its per-round time ratios to ``xla`` beats ``xla`` by more than a
noise margin (10% by default): tuning can only make things faster. A
candidate 10x faster than xla in the screening round wins at once
(`decisive`); otherwise timing stops early once the choice is clear
(`clear_choice`), and a time budget bounds the whole bucket.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import logging
import math
import statistics
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tunedjax import _tuning
from tunedjax._errors import AutotuneError
from tunedjax.autotune import _accuracy, _registry
from tunedjax.autotune import _payback_plan
from tunedjax.autotune._payback import CANNOT_PAY_BACK, Payback
from tunedjax.autotune._payback_plan import AHEAD_COMPILE_S, WARM_SHARE  # noqa: F401
from tunedjax.autotune._predict import Prediction
from tunedjax.autotune._result import TuneResult

logger = logging.getLogger("tunedjax.autotune")

DEFAULT = "xla"
DEFAULT_ROUNDS = 5
DEFAULT_BUDGET_S = 15.0
DEFAULT_MARGIN = 0.10
# A candidate slower than this many times xla in one first call is not timed further.
SCREEN_FACTOR = 4.0
# Timing stops after MIN_ROUNDS rounds once one candidate beats xla's threshold
# and every other candidate by this factor in every round, or none comes within
# it of the threshold: more rounds could not change the choice.
CLEAR_FACTOR = 1.5
MIN_ROUNDS = 2
# Under the "memory" objective: candidates within this fraction of the fastest compete
# on their temporaries.
MEMORY_SLACK = 0.10
OBJECTIVES = ("time", "memory")
# A candidate at most this fraction of xla's time in the screening call, and
# CLEAR_FACTOR ahead of every other one, wins without more rounds: a first
# call's warm-up cannot hide a 10x gap (the demo's depthwise buckets run at
# 0.02-0.03x, and each further round would run xla's slow form again).
DECISIVE_RATIO = 0.1
# The screening round is each kernel's first call, which carries one-time
# costs (measured on CPU: ~3 ms for a fresh executable, ~60 ms for the
# process's first convolution). Below this many seconds of xla's call the
# round drops nothing and decides nothing: every candidate gets timed rounds.
SCREEN_MIN_S = 0.1
# Once a family has made a timed call on a platform in this process, the one-time
# costs left are a fresh executable's (~3 ms): a screening call of at least this
# many seconds then tells (a 10x gap cannot hide in them), so a slow default is
# not called again only to confirm it (the demo's depthwise buckets: 45-95 ms).
WARM_SCREEN_MIN_S = 0.03
# The (platform, family) pairs that made a timed call in this process.
_WARM: set[tuple[str, str]] = set()
# The clock the tuner's own bookkeeping reads (tests replace it).
_clock = time.perf_counter


@dataclasses.dataclass(frozen=True)
class TuneOptions:
  """How hard the tuner works on one bucket.

  Attributes:
    rounds: timed rounds per candidate (after one untimed warm-up call).
    budget_s: seconds one bucket's timing may take, from the first
      candidate's checking call on; at least the checking call of every
      candidate and one timed round always run. Compiling is not counted:
      each applicable candidate is compiled once, side by side in threads,
      so compile time is bounded by the number of candidates (and, with a
      horizon, by the `Payback` check before the others compile), not by a
      clock a loaded machine could spend on compiles alone.
    margin: a candidate must be faster than ``xla`` by more than this
      fraction (0.10: a time ratio below 1/1.1) to be chosen.
    seed: seed of the random tuning inputs.
    objective: ``"time"`` (the fastest), or ``"memory"`` (the fewest
      temporary bytes among those within `MEMORY_SLACK` of the fastest):
      the config's ``kernel.objective`` (see `choose`).
    predict: compile only the candidates a `Prediction` says could win
      (True, the default), or every applicable one (False: exhaustive, as
      for measuring a prediction's quality); the config's ``kernel.predict``
      can turn it off too.

  Example:
    >>> TuneOptions(rounds=3).margin
    0.1
  """

  rounds: int = DEFAULT_ROUNDS
  budget_s: float = DEFAULT_BUDGET_S
  margin: float = DEFAULT_MARGIN
  seed: int = 0
  objective: str = "time"
  predict: bool = True

  def __post_init__(self):
    if not (isinstance(self.rounds, int) and self.rounds >= 1):
      raise AutotuneError(f"TuneOptions.rounds must be an integer >= 1, got {self.rounds!r}.")
    if not (isinstance(self.budget_s, (int, float)) and self.budget_s > 0):
      raise AutotuneError(f"TuneOptions.budget_s must be a number > 0, got {self.budget_s!r}.")
    if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 10):
      raise AutotuneError(
          f"TuneOptions.margin must be a fraction >= 0 such as 0.1, got {self.margin!r}.")
    if not isinstance(self.predict, bool):
      raise AutotuneError(f"TuneOptions.predict must be True (compile the candidates that "
                          f"could win) or False (every candidate), got {self.predict!r}.")
    if self.objective not in OBJECTIVES:
      raise AutotuneError(f"TuneOptions.objective must be one of "
                          f"{', '.join(map(repr, OBJECTIVES))}, got {self.objective!r}.")


def _describe_error(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}"
  first = text.splitlines()[0] if text else type(e).__name__
  return first[:300]


def _ratio(times: Sequence[float], base: Sequence[float]) -> float:
  return float(statistics.median(t / b for t, b in zip(times, base) if b > 0))


def clear_choice(times: Mapping[str, Sequence[float]], margin: float = DEFAULT_MARGIN,
                 *, default: str = DEFAULT) -> bool:
  """Whether more timed rounds could not change which candidate wins.

  True after at least `MIN_ROUNDS` rounds when, in every round so far,
  either one candidate beats the winning threshold ``1 / (1 + margin)`` by
  `CLEAR_FACTOR` and every other candidate by `CLEAR_FACTOR` too, or no
  candidate comes within `CLEAR_FACTOR` of the threshold (``xla`` stays).
  Close calls get every round.

  Example:
    >>> clear_choice({"xla": [1.0, 1.0], "depthwise": [0.1, 0.12], "im2col": [0.9, 1.1]})
    True
    >>> clear_choice({"xla": [1.0, 1.0], "im2col": [0.85, 0.95]})
    False
  """
  base = times.get(default, ())
  if len(base) < MIN_ROUNDS or any(b <= 0 for b in base):
    return False
  ratios = {}
  for name, ts in times.items():
    if name != default:
      if len(ts) < len(base):
        return False
      ratios[name] = [t / b for t, b in zip(ts, base)]
  if not ratios:
    return True
  threshold = 1.0 / (1.0 + margin)
  best = min(ratios, key=lambda n: max(ratios[n]))
  worst_of_best = max(ratios[best])
  if worst_of_best < threshold / CLEAR_FACTOR:  # a clear winner, if clear of the others
    return all(min(r) > worst_of_best * CLEAR_FACTOR for n, r in ratios.items() if n != best)
  return all(min(r) > threshold * CLEAR_FACTOR for r in ratios.values())


def choose(ratios: Mapping[str, float], temp_bytes: Mapping[str, int] | None = None, *,
           objective: str = "time", margin: float = DEFAULT_MARGIN,
           default: str = DEFAULT) -> tuple[str, str]:
  """The winner among checked, timed candidates, and why.

  ``"time"``: the fastest candidate if it beats `default` by more than
  `margin` (a time ratio below ``1 / (1 + margin)``), else `default`.
  ``"memory"``: among the candidates (`default` included) whose time is within
  `MEMORY_SLACK` of the fastest's, the one with the fewest temporary bytes
  (ties: the faster); without temporaries for them, as ``"time"``.

  Args:
    ratios: each candidate's median time ratio to `default` (`default` may be
      left out: 1.0).
    temp_bytes: each candidate's temporaries in bytes.
    objective: ``"time"`` or ``"memory"``.
    margin: how much faster than `default` a candidate must be under "time".
    default: the reference kernel's name.

  Returns:
    ``(winner, reason)``.

  Example:
    >>> ratios = {"xla": 1.0, "blocked_256": 0.6, "query_chunked": 0.64}
    >>> temps = {"xla": 64e6, "blocked_256": 9e6, "query_chunked": 4e6}
    >>> choose(ratios, temps)[0], choose(ratios, temps, objective="memory")[0]
    ('blocked_256', 'query_chunked')
  """
  ratios = {default: 1.0, **ratios}
  others = [n for n in ratios if n != default]
  if objective == "memory":
    fastest = min(ratios.values())
    near = [n for n in ratios if ratios[n] <= fastest * (1.0 + MEMORY_SLACK)]
    temp_bytes = temp_bytes or {}
    if all(n in temp_bytes for n in near):
      winner = min(near, key=lambda n: (temp_bytes[n], ratios[n]))
      return winner, (f"{winner}: fewest temporaries ({temp_bytes[winner]} bytes) among "
                      f"{', '.join(sorted(near))}, within {MEMORY_SLACK:.0%} of the fastest "
                      f"({fastest:.2f}x {default}'s time)")
  if not others:
    return default, f"only {default} was timed"
  best = min(others, key=lambda n: ratios[n])
  if ratios[best] * (1.0 + margin) < 1.0:
    return best, (f"{best} took {ratios[best]:.2f}x {default}'s time (needs < "
                  f"{1 / (1 + margin):.2f}x)")
  return default, (f"best other candidate {best} took {ratios[best]:.2f}x {default}'s time, "
                   f"not below {1 / (1 + margin):.2f}x")


def _temp_bytes(executable: Any) -> int | None:
  """The temporaries a compiled executable needs, or None where not reported."""
  try:
    size = executable.memory_analysis().temp_size_in_bytes
  except (AttributeError, NotImplementedError, RuntimeError):  # a backend without it
    return None
  return int(size) if isinstance(size, (int, np.integer)) and size >= 0 else None


def decisive(times: Mapping[str, Sequence[float]], *, default: str = DEFAULT) -> bool:
  """Whether one round already settles the choice: a candidate at most
  `DECISIVE_RATIO` of the default's time and `CLEAR_FACTOR` ahead of the rest.

  Example:
    >>> decisive({"xla": [1.0], "depthwise": [0.03], "im2col": [0.9]})
    True
    >>> decisive({"xla": [1.0], "depthwise": [0.3]})
    False
  """
  base = times.get(default, ())
  if not base or base[0] <= 0:
    return False
  ratios = {n: t[0] / base[0] for n, t in times.items() if n != default and t}
  if not ratios:
    return False
  best = min(ratios, key=ratios.get)
  return ratios[best] <= DECISIVE_RATIO and all(
      r >= ratios[best] * CLEAR_FACTOR for n, r in ratios.items() if n != best)


def _timed_function(kernel: Any, spec: Any, timed: str) -> Callable[..., Any]:
  """What is checked and timed for `kernel`: ``f(*operands)``, or for
  ``"forward+backward"`` ``f(cotangent, *operands) -> (output, gradients of
  the floating operands)``."""
  forward = lambda *ops: kernel.fn(*ops, spec)  # pylint: disable=unnecessary-lambda-assignment
  if timed == "forward":
    return forward

  def forward_backward(cotangent: Any, *ops: Any) -> Any:
    floats = [i for i, x in enumerate(ops) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]

    def of_floats(*values: Any) -> Any:
      full = list(ops)
      for i, v in zip(floats, values):
        full[i] = v
      return forward(*full)

    out, vjp = jax.vjp(of_floats, *[ops[i] for i in floats])
    return out, vjp(cotangent)

  return forward_backward


def _timed_args(family: Any, spec: Any, operands: list[jax.Array], default: Any,
                rng: np.random.Generator, device: Any) -> list[jax.Array]:
  """The arguments of `_timed_function`: the operands, after a random cotangent if timed backward."""
  if family.timed == "forward":
    return operands
  out = jax.eval_shape(lambda *ops: default.fn(*ops, spec), *operands)
  cotangent = jax.tree_util.tree_map(
      lambda s: jax.device_put(_tuning.random_array(s.shape, s.dtype, rng), device), out)
  return [cotangent, *operands]


def _leaves_error(out: Any, ref: Any, scales: Sequence[float] | None = None) -> float:
  """The largest relative error over matching leaves (inf on a structure or dtype
  mismatch); `scales`: each reference leaf's ``max |leaf|``, where known."""
  outs, refs = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
  if len(outs) != len(refs):
    return math.inf
  scales = scales or [None] * len(refs)
  errors = [math.inf if np.dtype(o.dtype) != np.dtype(r.dtype)
            else _tuning.relative_error(o, r, s) for o, r, s in zip(outs, refs, scales)]
  return max(errors, default=0.0)


def _compile_all(functions: Mapping[str, Callable[..., Any]],
                 args: Sequence[jax.Array], times: dict[str, float] | None = None
                 ) -> dict[str, Any]:
  """Every candidate compiled for these arguments, side by side in threads.

  XLA compiles without holding the GIL, so a bucket's candidates compile in
  about the time of the slowest one on a machine with cores to spare.
  Returns ``{name: executable or the exception compiling it raised}``; each
  one's seconds (lowering and compiling, in its thread) go to `times`.
  """
  times = {} if times is None else times

  def compile_one(item: tuple[str, Callable[..., Any]]) -> Any:
    name, fn = item
    start = time.perf_counter()
    try:
      return jax.jit(fn).lower(*args).compile()
    except Exception as e:  # pylint: disable=broad-except  # reported when it runs
      return e
    finally:
      times[name] = time.perf_counter() - start

  workers = max(1, min(len(functions), _tuning.usable_cores()))
  with _tuning.first_call_stage("tune:compile"), \
      concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return dict(zip(functions, pool.map(compile_one, functions.items())))


def _runner(executable: Any, operands: Sequence[jax.Array]) -> Callable[[], Any]:
  """A zero-argument call of a compiled kernel; raises what compiling raised."""
  if isinstance(executable, BaseException):
    raise executable
  return lambda: executable(*operands)


def _keeping(outputs: dict[str, Any], name: str, run: Callable[[], Any]) -> Callable[[], None]:
  """`run` for timing, keeping its result (or what it raised) in ``outputs[name]``."""

  def call() -> None:
    try:
      outputs[name] = jax.block_until_ready(run())
    except Exception as e:  # pylint: disable=broad-except  # reported by the check
      outputs[name] = e

  return call


def _output(outputs: Mapping[str, Any], name: str, run: Callable[[], Any]) -> Any:
  """The screening call's result, or (when it was not made) a call's now; an
  exception is returned, not raised."""
  if name in outputs:
    return outputs[name]
  try:
    return jax.block_until_ready(run())
  except Exception as e:  # pylint: disable=broad-except  # reported by the check
    return e


def _failed(errors: dict[str, str], name: str, e: BaseException, label: str) -> None:
  errors[name] = _describe_error(e)
  logger.warning("autotune %s: candidate %r failed and is skipped: %s", label, name,
                 errors[name])


def tune_bucket(spec: Any, candidates: Sequence[Any], *, platform: str = "cpu",
                options: TuneOptions = TuneOptions(), label: str = "",
                family: _registry.OpFamily | None = None,
                payback: Payback | None = None,
                prediction: Prediction | None = None, prepared: _Bucket | None = None,
                beside: Any = None) -> TuneResult:
  """Measures `candidates` on one site and picks the fastest correct one.

  The stages, in order: prepare the operands (`_Bucket.prepare`); plan what
  to compile (`_payback_plan.plan`: with a horizon, whether tuning can pay back
  from the default's compile and first call; with a `prediction`, only the
  candidates that could win); compile them side by side
  (`_compile_all`); make one call each, which both screens and checks
  (`_start`, `_screen`, `_check`); time the survivors (`_time`); choose
  (`_choose`). Runs eagerly (`jax.ensure_compile_time_eval`: callable while a
  function is traced) on random operands (`OpFamily.operands`).

  With `payback` (a tuning horizon), when tuning the others cannot pay back
  (`Payback.pays`) nothing else is compiled and the result keeps the default
  (``result.kept``, its reason starting with `CANNOT_PAY_BACK`). With a
  `prediction` (and ``options.predict``) the candidates it rules out
  (`Prediction.could_win`) are never compiled (``result.pruned``); the
  default always is, and what wins is timed and checked against it.

  Args:
    spec: the site's spec (a `ConvSpec`, ...).
    candidates: the applicable `Kernel`s; must include the family's default.
    platform: the platform the inputs live on.
    options: rounds, budget, margin and seed.
    label: a bucket name for the log lines.
    family: the `OpFamily` (default: the one whose spec type `spec` has).
    payback: the tuning horizon and the bucket's sites, or None (unbounded).
    prediction: the candidates' predicted times, or None: compile them all.
    prepared: operands and compiled default made ahead (`prepared_default`).
    beside: a `_prefetch.Prefetcher` on a spare core: timings exclude its
      work (`timing`).

  Returns:
    A `TuneResult`; its winner is the default (``xla``) unless a candidate
    matched the reference and beat it by more than ``options.margin``.

  Example:
    >>> import jax, jax.numpy as jnp, types
    >>> from jax import lax
    >>> from tunedjax.ops.conv._spec import ConvSpec
    >>> spec = ConvSpec.from_arrays(jnp.ones((1, 6, 6, 2)), jnp.ones((3, 3, 2, 2)),
    ...     padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> conv = lambda l, r, s: lax.conv_general_dilated(
    ...     l, r, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> xla = types.SimpleNamespace(name="xla", fn=conv)
    >>> wrong = types.SimpleNamespace(name="wrong", fn=lambda l, r, s: 2 * conv(l, r, s))
    >>> r = tune_bucket(spec, [xla, wrong], options=TuneOptions(rounds=1))
    >>> r.winner, sorted(r.rejected)
    ('xla', ['wrong'])
  """
  bucket = _begin(spec, candidates, platform, options, label, family, prepared)
  bucket.quiet = beside.timing if beside else bucket.quiet
  bucket.prediction = prediction if options.predict else None
  with jax.ensure_compile_time_eval():
    planned = _payback_plan.plan(bucket, payback, _steps())
    if isinstance(planned, TuneResult):
      return planned
    compiled, default_screen = planned
    runs = _start(bucket, _compile_rest(bucket, compiled))
    screen = _screen(bucket, runs, default_screen)
    runners = _check(bucket, runs)
    if bucket.skipped:
      logger.info("autotune %s: time budget (%.1fs) spent; not tried: %s",
                  bucket.label, options.budget_s, ", ".join(bucket.skipped))
    if len(runners) == 1:
      return bucket.finish(bucket.default, bucket.none_passed(), {}, {})
    try:
      timings, slow = _time(bucket, runners, screen)
    except Exception as e:  # pylint: disable=broad-except
      logger.warning("autotune %s: timing failed (%s); keeping %s.", bucket.label,
                     _describe_error(e), bucket.default)
      return bucket.finish(bucket.default, f"timing failed: {_describe_error(e)}", {}, {})
  return _choose(bucket, timings, slow)


@dataclasses.dataclass
class _Bucket:
  """One `tune_bucket` call in progress: what every stage reads and adds to.

  Made fresh per call (never shared between calls or threads).
  """

  spec: Any
  family: Any
  kernels: dict[str, Any]
  options: TuneOptions
  label: str
  platform: str
  start: float
  args: list[Any] = dataclasses.field(default_factory=list)
  functions: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
  outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
  errors: dict[str, str] = dataclasses.field(default_factory=dict)
  rejected: dict[str, float] = dataclasses.field(default_factory=dict)
  skipped: list[str] = dataclasses.field(default_factory=list)
  temps: dict[str, int] = dataclasses.field(default_factory=dict)
  record: dict[str, Any] = dataclasses.field(default_factory=dict)
  timing_start: float = 0.0
  compile_s: dict[str, float] = dataclasses.field(default_factory=dict)
  prediction: Prediction | None = None
  pruned: dict[str, str] = dataclasses.field(default_factory=dict)
  every: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
  error_ratios: dict[str, float] = dataclasses.field(default_factory=dict)
  compiled: dict[str, Any] = dataclasses.field(default_factory=dict)  # before tune_bucket
  quiet: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
  warm: bool = False  # the family made a timed call before the default's first (`_WARM`)

  @property
  def screen_min_s(self) -> float:
    """The shortest first call of the default that tells (`SCREEN_MIN_S`, or
    `WARM_SCREEN_MIN_S` once the family made a timed call before it)."""
    return WARM_SCREEN_MIN_S if self.warm else SCREEN_MIN_S

  @property
  def default(self) -> str:
    return self.family.default

  def none_passed(self) -> str:
    """The reason the default stays when no other candidate passed the checks."""
    return _accuracy.none_passed(self.default, self.error_ratios, self.rejected)

  @classmethod
  def prepare(cls, spec: Any, candidates: Sequence[Any], platform: str, options: TuneOptions,
              label: str, family: Any) -> _Bucket:
    """Checks the candidates and draws the operands (on `platform`'s first device)."""
    start = _clock()
    family = _registry.family_of(spec) if family is None else family
    kernels = {k.name: k for k in candidates}
    if family.default not in kernels:
      raise AutotuneError(
          f"tune_bucket needs the {family.default!r} kernel among the candidates (the "
          f"{family.name} family's default, always a candidate); got {sorted(kernels)}.")
    bucket = cls(spec, family, kernels, options, label, platform, start)
    rng = np.random.default_rng(options.seed)
    try:
      device = jax.devices(platform)[0]
    except RuntimeError:
      device = jax.devices()[0]
    with jax.ensure_compile_time_eval():
      operands = [jax.device_put(x, device) for x in family.operands(spec, rng)]
      bucket.args = _timed_args(family, spec, operands, kernels[family.default], rng, device)
    bucket.functions = {n: _timed_function(k, spec, family.timed) for n, k in kernels.items()}
    bucket.every = dict(bucket.functions)
    return bucket

  def finish(self, winner: str, reason: str, timings: Mapping[str, Sequence[float]],
             ratios: Mapping[str, float]) -> TuneResult:
    """The `TuneResult` of this bucket, logged."""
    return _finish(winner, reason, timings, ratios, self.errors, self.rejected, self.skipped,
                   self.start, self.label, self.temps, payback=self.record,
                   compile_s=self.compile_s, pruned=self.pruned,
                   predicted=(self.prediction.ratios() if self.prediction is not None
                              and self.prediction.estimates else {}),
                   error_ratios=self.error_ratios)


def prepared_default(spec: Any, candidates: Sequence[Any], *, platform: str,
                     options: TuneOptions, label: str, family: Any) -> _Bucket:
  """A bucket's operands drawn and its default kernel compiled, ready for
  `tune_bucket(prepared=...)`: the work a bucket's tuning begins with, which
  no decision changes (`_prefetch` does it ahead, on a spare core)."""
  bucket = _Bucket.prepare(spec, candidates, platform, options, label, family)
  default = bucket.default
  bucket.compiled.update(_compile_all({default: bucket.functions[default]}, bucket.args,
                                      bucket.compile_s))
  return bucket


def _begin(spec: Any, candidates: Sequence[Any], platform: str, options: TuneOptions,
           label: str, family: Any, prepared: _Bucket | None) -> _Bucket:
  """The bucket to tune: the one `prepared` ahead for the same candidates and
  options (its clock restarted: what it took ran beside the trace), else a
  fresh one."""
  if (prepared is not None and prepared.options == options and prepared.platform == platform
      and list(prepared.kernels) == [k.name for k in candidates]):
    prepared.start = _clock()
    return prepared
  return _Bucket.prepare(spec, candidates, platform, options, label, family)


def _compile_rest(bucket: _Bucket, compiled: dict[str, Any]) -> dict[str, Any]:
  """`compiled` with the candidates left to compile (those not compiled beside
  the default), side by side; the timing budget starts after them: compiles
  are not counted, so a loaded machine that compiles slowly still times every
  candidate."""
  rest = {n: f for n, f in bucket.functions.items() if n not in compiled}
  compiled.update(_compile_all(rest, bucket.args, bucket.compile_s) if rest else {})
  bucket.timing_start = _clock()
  bucket.temps.update(_temps_of(compiled))
  return compiled


def _timed(bucket: _Bucket, runners: Mapping[str, Callable[[], Any]], **kw: Any
           ) -> dict[str, list[float]]:
  """`time_interleaved` with the cores to itself (`bucket.quiet`)."""
  with bucket.quiet():
    times = _tuning.time_interleaved(runners, **kw)
  _WARM.add((bucket.platform, bucket.family.name))
  return times


def _was_warm(bucket: _Bucket) -> bool:
  return (bucket.platform, bucket.family.name) in _WARM


def _steps() -> _payback_plan.Steps:
  """The steps the payback planning runs, read now (a test may replace one)."""
  return _payback_plan.Steps(compile_all=_compile_all, runner=_runner, timed=_timed,
                             keeping=_keeping, was_warm=_was_warm, temps_of=_temps_of,
                             clock=_clock)


def _start(bucket: _Bucket, compiled: Mapping[str, Any]) -> dict[str, Callable[[], Any]]:
  """A call of each compiled candidate, the default first; a failed compile is
  recorded and skipped, and once the budget is spent the rest are skipped."""
  runs = {bucket.default: _runner(compiled[bucket.default], bucket.args)}  # fails: an error
  for name in bucket.functions:
    if name == bucket.default:
      continue
    if _clock() - bucket.timing_start > bucket.options.budget_s:
      bucket.skipped.append(name)
      continue
    try:
      runs[name] = _runner(compiled[name], bucket.args)
    except Exception as e:  # pylint: disable=broad-except  # failed to compile: skip it
      _failed(bucket.errors, name, e, bucket.label)
  return runs


def _screen(bucket: _Bucket, runs: Mapping[str, Callable[[], Any]],
            default_screen: list[float] | None) -> dict[str, Sequence[float]]:
  """One call each, side by side: the call that checks a candidate's result is
  also its screening round (a candidate many times slower than the default,
  an FFT on a small kernel, is dropped before it costs `rounds` calls). With
  a horizon the default's first call was made already and is its screening call."""
  if default_screen is None:
    bucket.warm = _was_warm(bucket)
  screen = _timed(
      bucket, {n: _keeping(bucket.outputs, n, r) for n, r in runs.items()
       if n != bucket.default or default_screen is None}, rounds=1, warmup=0)
  return {bucket.default: default_screen, **screen} if default_screen is not None else screen


def _check(bucket: _Bucket, runs: Mapping[str, Callable[[], Any]]
           ) -> dict[str, Callable[[], Any]]:
  """The candidates no less accurate than the default; the others are recorded
  as failed or rejected.

  One rule for every family (`_accuracy`): a candidate's error against a
  high-precision reference of the same call may be at most
  `_accuracy.ERROR_RATIO_LIMIT` times the default's (its error ratio, kept
  in the result). Where every candidate is close enough to the default's
  output for `_accuracy.agreement_bound` to prove that, no reference is
  computed and the bounds are kept instead; otherwise the reference is
  computed once and every candidate judged against it. The family's
  tolerance against the default's own output stays as a sanity bound.
  """
  default = bucket.default
  ref = _output(bucket.outputs, default, runs[default])
  if isinstance(ref, BaseException):
    raise ref
  ref = jax.tree_util.tree_map(np.asarray, ref)
  ref_out = jax.tree_util.tree_leaves(ref)[0]
  tol = bucket.family.tolerance(ref_out.dtype, bucket.platform)
  scales = [_tuning.max_abs_difference(leaf, None) for leaf in jax.tree_util.tree_leaves(ref)]
  outs, bounds = {}, {}
  for name, run in runs.items():
    if name == default:
      continue
    out = _output(bucket.outputs, name, run)
    if isinstance(out, BaseException):
      _failed(bucket.errors, name, out, bucket.label)
      continue
    err = _leaves_error(out, ref, scales)
    if err > tol:
      bucket.rejected[name] = err if math.isfinite(err) else 1e300
      _log_rejected(bucket, name, out, ref_out, err, tol, None, "")
      continue
    outs[name], bounds[name] = (out, err), _accuracy.agreement_bound(out, ref, scales)
  bucket.outputs.clear()
  if all(b <= _accuracy.ERROR_RATIO_LIMIT for b in bounds.values()):
    bucket.error_ratios.update(bounds)  # proved without a reference
    return {default: runs[default], **{n: runs[n] for n in outs}}
  precise = _precise_reference(bucket, ref)
  runners = {default: runs[default]}
  for name, (out, err) in outs.items():
    ratio = precise.ratio(out) if precise is not None else None
    if ratio is not None:
      bucket.error_ratios[name] = ratio if math.isfinite(ratio) else 1e300
    if ratio is None or ratio <= _accuracy.ERROR_RATIO_LIMIT:
      runners[name] = runs[name]
      continue
    bucket.rejected[name] = err
    _log_rejected(bucket, name, out, ref_out, err, tol, ratio, precise.dtype)
  return runners


def _precise_reference(bucket: _Bucket, default_out: Any) -> _accuracy.Reference | None:
  """The bucket's high-precision reference (`OpFamily.precise`, else the
  default kernel's function, in float64 or at HIGHEST), computed once."""
  kernel = bucket.kernels[bucket.default]
  if bucket.family.precise is not None:
    kernel = types.SimpleNamespace(name=kernel.name, fn=bucket.family.precise)
  function = _timed_function(kernel, bucket.spec, bucket.family.timed)
  return _accuracy.reference(function, bucket.args, default_out, platform=bucket.platform,
                             label=bucket.label)


def _log_rejected(bucket: _Bucket, name: str, out: Any, ref_out: Any, err: float, tol: float,
                  ratio: float | None, ref_dtype: str) -> None:
  """The warning for a rejected candidate: its error ratio, or its disagreement."""
  got = jax.tree_util.tree_leaves(out)[0] if jax.tree_util.tree_leaves(out) else out
  where = (f"output {getattr(got, 'dtype', '?')}{list(getattr(got, 'shape', ()))}, expected "
           f"{ref_out.dtype}{list(ref_out.shape)}")
  if ratio is not None and ratio > _accuracy.ERROR_RATIO_LIMIT:
    logger.warning("autotune %s: candidate %r is less accurate than %s (error ratio %.3g > "
                   "%g: its error against a %s reference over %s's; %s) and is dropped.",
                   bucket.label, name, bucket.default, ratio, _accuracy.ERROR_RATIO_LIMIT,
                   ref_dtype, bucket.default, where)
    return
  logger.warning("autotune %s: candidate %r disagrees with the reference (relative "
                 "error %.3g > %.3g, %s) and is dropped.", bucket.label, name, err, tol, where)


def _time(bucket: _Bucket, runners: dict[str, Callable[[], Any]],
          screen: Mapping[str, Sequence[float]]
          ) -> tuple[dict[str, Sequence[float]], dict[str, float]]:
  """The checked candidates' times: the screening round drops those over
  `SCREEN_FACTOR` times the default's and may settle the choice (`decisive`);
  otherwise interleaved rounds until `clear_choice` or the budget.

  Returns:
    ``(timings, slow)``: seconds per call by candidate, and the screened-out
    candidates' first-call ratios.
  """
  default, options = bucket.default, bucket.options
  screen = {n: screen[n] for n in runners}
  # First-call costs are noise below this (the default's screening call is counted
  # warm only if the family had made a timed call before it).
  telling = min(screen[default]) >= bucket.screen_min_s
  slow = {n: _ratio(t, screen[default]) for n, t in screen.items()
          if telling and n != default and _ratio(t, screen[default]) > SCREEN_FACTOR}
  for name in slow:
    del runners[name]
  timings: dict[str, Sequence[float]] = {n: screen[n] for n in slow}
  if len(runners) > 1 and telling and decisive({n: screen[n] for n in runners},
                                               default=default):
    timings.update({n: screen[n] for n in runners})
  elif len(runners) > 1:
    left = max(options.budget_s - (_clock() - bucket.timing_start), 1e-3)
    # The screening call counts as a round toward a clear choice, so a
    # decisive bucket (a depthwise kernel at 0.05x) needs one round more.
    timings.update(_timed(
        bucket, runners, rounds=options.rounds, warmup=0, budget_s=left,
        stop=lambda t: clear_choice({n: [*screen[n], *t[n]] for n in t}, options.margin,
                                    default=default)))
  return timings, slow


def _choose(bucket: _Bucket, timings: Mapping[str, Sequence[float]],
            slow: Mapping[str, float]) -> TuneResult:
  """The result from the timings: `choose` among the candidates not screened out."""
  default, options = bucket.default, bucket.options
  if default not in timings:  # every candidate was screened out
    return bucket.finish(default, f"every other candidate took over {SCREEN_FACTOR:g}x "
                         f"{default}'s time in a first call", timings, dict(slow))
  base = timings[default]
  ratios = {name: _ratio(t, base) for name, t in timings.items() if name not in slow}
  ratios.update(slow)
  winner, reason = choose({n: r for n, r in ratios.items() if n not in slow}, bucket.temps,
                          objective=options.objective, margin=options.margin, default=default)
  return bucket.finish(winner, reason, timings, ratios)


def _temps_of(compiled: Mapping[str, Any]) -> dict[str, int]:
  """``{name: temporary bytes}`` of the compiled candidates that report them."""
  return {n: b for n, b in ((n, _temp_bytes(c)) for n, c in compiled.items()
                            if not isinstance(c, BaseException)) if b is not None}


def _finish(winner: str, reason: str, timings: Mapping[str, Sequence[float]],
            ratios: Mapping[str, float], errors: Mapping[str, str],
            rejected: Mapping[str, float], skipped: Sequence[str], start: float,
            label: str, temp_bytes: Mapping[str, int] | None = None, *,
            payback: Mapping[str, Any] | None = None,
            compile_s: Mapping[str, float] | None = None,
            pruned: Mapping[str, str] | None = None,
            predicted: Mapping[str, float] | None = None,
            error_ratios: Mapping[str, float] | None = None) -> TuneResult:
  result = TuneResult(
      winner=winner, reason=reason, timings=dict(timings), ratios=dict(ratios),
      errors=dict(errors), rejected=dict(rejected), skipped=tuple(skipped),
      measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      tuning_s=_clock() - start, temp_bytes=dict(temp_bytes or {}),
      payback=dict(payback or {}), compile_s=dict(compile_s or {}),
      pruned=dict(pruned or {}), predicted=dict(predicted or {}),
      error_ratios=dict(error_ratios or {}))
  logger.info("autotune %s: chose %s in %.2fs (%s)", label, winner, result.tuning_s, reason)
  return result

