"""The selector: each kernel site of every op family runs on its bucket's best kernel.

A *site* is one place a program uses an op family: an equation of the
family's primitive (a `conv_general_dilated`, found by `kernel_pass`), or a
call of `dispatch` (a call-site function such as `tunedjax.attention` asks at
trace time). A function that contains `jax.grad` has its backward
convolutions as equations of their own, so each is a bucket of its own. For
every site `decide` chooses, in this order:

1. a user's hint (`hint`, or ``kernel.hints`` keyed by family) that applies;
2. in the observe phase (see `TuningSession`) the bucket's cached winner if
   the cache has one (nothing is tuned), else the family's default (``xla``),
   which is also what runs when nothing else applies;
3. the cached winner of its bucket (a hit);
4. on a miss: in the tune phase (or before any step) tune the bucket now,
   store the result and use its winner; in the apply phase use the default.

With a tuning horizon (`TuningSession.horizon`: the Trainer sets the steps
of its fit) and ``kernel.payback`` on (the default), step 4 first compiles and times the default alone, and keeps it
untuned when tuning the other candidates could not pay back within the
horizon (`_payback.Payback`: the default's time x the bucket's sites so far in
this program x the horizon, against the expected cost of tuning, costed by
what tuning took on this platform or its rule until measured,
`_payback.for_platform`; reason ``"cannot pay back"``). That decision is cached with its horizon and the
numbers it was made from: a later lookup with an equal or shorter horizon
reuses it (a hit, no cost); a longer horizon, a None one, or a further site
of the same bucket in the program that makes tuning pay, tunes the bucket
then (sites of this trace already decided keep the default).

After step 3 or 4, a kernel that a cached verdict of the whole-program
check (`_verdict`) says makes this program slower gets the default (reason
``"loses in context"``); and in a variant of the program that check compares
(`Selection.untuned`, `Selection.vetoed`) a vetoed site gets its default
(reason ``"verifying"``). The other non-default choices are recorded in
`Selection.decisions` for that check.

In a multi-process job, steps 3 and 4 happen on process 0 only and the
others receive its choice. What is decided is counted in the active
`Selection`'s tally (a typed `KernelReport`) and in its `TuningSession`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from tunedjax import _tuning
from tunedjax._config import get_config
from tunedjax._errors import AutotuneError, TunedJaxError
from tunedjax.autotune import (_hints, _multihost, _payback, _predict, _prefetch, _registry,
                               _report, _sites, _tuner, _verdict)
from tunedjax.autotune._bucket import bucket_key
from tunedjax.rewrite import _compat, _engine

logger = logging.getLogger("tunedjax.autotune")

CacheLike = _tuning.CacheLike


@dataclasses.dataclass
class Selection:
  """What kernel selection needs while one program is traced.

  `tunedjax.jit` (and `select_kernels`) make one current with `selecting`
  around each trace; sites found then are decided with its platform,
  config, session, cache and tuning options, and counted in its tally.

  Attributes:
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    config: the active `tunedjax.Config`.
    session: the `TuningSession` whose phase is read and stats recorded.
    cache: the tuning cache (a `Cache`, or None for memory only).
    options: how a bucket is tuned on a miss.
    tally: the choices made so far.
    explain_only: look up the cache only (never tune, never record stats),
      for `explain`; `buckets` collects what was seen.
    sites: ``{bucket key as JSON: sites decided so far}`` in this trace:
      the calls of a bucket per run of the program, as known when a site is
      decided (for the tuning horizon's payback check).
    measured: ``(bucket key, value)`` of the buckets tuned in this trace,
      for predicting the next ones where there is no cache to read them from.
    seen: sites met in this trace, whatever was decided (0: the program does
      not depend on the phase, hints or verdicts).
    observed: sites that got their default only because of the observe
      phase (no final cached winner); 0 in an observe-phase trace: the
      program is the one the tune phase would trace.
    untuned: every site runs its family's default (hints still apply): the
      untuned program of the whole-program check (`_verify`).
    vetoed: bucket ids (`_verdict.bucket_id`) that run their default in this
      variant of the program (reason ``"verifying"``).
    context: the program context verdicts are keyed by
      (`_verdict.context_key`); None: verdicts are not looked up.
    decisions: ``{bucket id: (family, label, kernel)}`` of every site whose
      tuned kernel is not the default (hints excepted): what the
      whole-program check verifies.
    prefetch: the work ahead for the buckets this trace will tune
      (`_prefetch.Prefetcher`: their operands and default kernels, on a spare
      core), started by the kernel pass's look at each jaxpr (`_expect`);
      None until then. `selecting` ends it with the trace.
    lookaheads: jaxprs looked ahead in so far (the order of their sites).
  """

  platform: str
  config: Any
  session: _tuning.TuningSession
  cache: Any
  options: _tuner.TuneOptions = _tuner.TuneOptions()
  tally: _report.Tally = dataclasses.field(default_factory=_report.Tally)
  explain_only: bool = False
  buckets: dict[str, Any] = dataclasses.field(default_factory=dict)
  sites: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
  measured: list[tuple[dict[str, Any], dict[str, Any]]] = dataclasses.field(default_factory=list)
  seen: int = 0
  observed: int = 0
  untuned: bool = False
  vetoed: frozenset[str] = frozenset()
  context: dict[str, str] | None = None
  decisions: dict[str, tuple[str, str, str]] = dataclasses.field(default_factory=dict)
  prefetch: _prefetch.Prefetcher | None = None
  lookaheads: int = 0


_ACTIVE: contextvars.ContextVar[Selection | None] = contextvars.ContextVar(
    "tunedjax_kernel_selection", default=None)


def new_selection(*, platform: str | None = None, config: Any = None,
                  session: _tuning.TuningSession | None = None, cache: CacheLike = None,
                  options: _tuner.TuneOptions = _tuner.TuneOptions(),
                  explain_only: bool = False) -> Selection:
  """A `Selection` with defaults filled in (JAX's backend, the config, the current session)."""
  platform = _tuning.canonical_platform(platform)
  # The cache of the platform's device: a GPU's decisions never read the CPU's file.
  return Selection(platform=platform,
                   config=get_config() if config is None else config,
                   session=_tuning.current_session() if session is None else session,
                   cache=_tuning.resolve_cache(cache, platform=platform), options=options,
                   explain_only=explain_only)


@contextlib.contextmanager
def selecting(selection: Selection) -> Iterator[Selection]:
  """Makes `selection` the one sites are decided with inside the block."""
  token = _ACTIVE.set(selection)
  try:
    yield selection
  finally:
    _ACTIVE.reset(token)
    if selection.prefetch is not None:  # the work ahead ends with the trace
      selection.prefetch.close()
      selection.prefetch = None


def active_selection() -> Selection | None:
  """The `Selection` of the program being traced, or None outside kernel selection."""
  return _ACTIVE.get()


@functools.lru_cache(maxsize=None)
def _measurable(platform: str) -> bool:
  """Whether this process has a `platform` device to time kernels on."""
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


def decide(family: _registry.OpFamily, spec: Any, selection: Selection) -> tuple[str, str]:
  """Chooses the kernel for one site and counts the choice.

  Args:
    family: the site's `OpFamily`.
    spec: the site's spec.
    selection: the platform, config, session, cache and options to decide with.

  Returns:
    ``(kernel name, why)``; why is one of `_report.REASONS`, or ``"no gpu
    here"`` (rewriting for a platform this process has no device of, e.g. to
    export: nothing can be timed, and this device's cache does not hold
    that platform's timings: the default).
  """
  config, session, default = selection.config, selection.session, family.default
  selection.seen += 1
  candidates = _registry.applicable_kernels(spec, selection.platform, op=family.name)
  names = [k.name for k in candidates]
  objective = config.kernel.objective
  key = bucket_key(spec, candidates, bucket=config.kernel.bucket, family=family,
                   objective=objective)
  label = family.label(key)
  if selection.explain_only:
    found = selection.buckets.setdefault(label, [key, candidates, 0])
    found[2] += 1
    return default, _report.OBSERVE
  hinted = _hints.hinted_kernel(family.name, candidates, _hints.active_hints(config), label,
                                session=session)
  if hinted is not None:
    return hinted, _report.HINT
  if names == [default]:
    return default, _report.ONLY_DEFAULT
  if not _measurable(selection.platform):  # rewriting for another machine (an export)
    ruled = _by_rule(family, key, candidates, selection)
    if ruled is not None:
      return ruled, f"{_report.BY_RULE}, no {selection.platform} here"
    return default, f"no {selection.platform} here"
  if selection.untuned:
    return default, _report.VERIFYING
  # By the full key: two buckets can share a label (a convolution and its input
  # gradient differ only in their dimension numbers).
  bucket = json.dumps(key, sort_keys=True, default=str)
  verdict_id = _verdict.bucket_id(family.name, key)
  if verdict_id in selection.vetoed:
    return default, _report.VERIFYING
  phase = session.phase(config)
  selection.sites[bucket] += 1
  site = _Site(family, spec, tuple(candidates), key, label, selection.sites[bucket],
               session.horizon if config.kernel.payback else None, phase)
  if phase == _tuning.OBSERVE:
    return _observe(site, names, selection, verdict_id)
  why: dict[str, Any] = {}
  all_names = sorted(k.name for k in _registry.kernels(family.name))
  name = _multihost.agree(lambda: _in_context(site, selection, why, verdict_id), all_names)
  if name not in names:
    return default, _report.NOT_APPLICABLE
  if "temp_bytes" in why:
    selection.tally.add_temporaries(label, name, why["temp_bytes"], default)
  reason = why.get("why", _report.RECEIVED)
  if name != default and reason in (_report.HIT, _report.TUNED, _report.RECEIVED):
    selection.decisions[verdict_id] = (family.name, label, name)
  return name, reason


def _observe(site: _Site, names: list[str], selection: Selection, bucket: str
             ) -> tuple[str, str]:
  """The observe phase tunes nothing: the default, or, in a program the
  whole-program check has seen before (its context has a `_verdict` entry),
  the bucket's cached winner when the cache has a final one (a hit; a cached
  verdict still applies).

  With a warm cache the observe phase's program is then the tuned one, and
  `tunedjax.jit` compiles it once for both phases (`Selection.observed`: the
  sites that got the default only because of the phase). A program seen for
  the first time observes on defaults: that program is the untuned one the
  check compares with, compiled already. In a multi-process job nothing is
  looked up before the tuning window (every process must compile the same
  program): the default.
  """
  family, label, session = site.family, site.label, selection.session
  default = family.default
  value = None
  if jax.process_count() == 1 and _verdict.load(session, selection.cache,
                                                selection.context) is not None:
    value = session.lookup(selection.cache, family.name, site.key,
                           platform=selection.platform)
  final = value is not None and value.get("winner") in names and (
      not value.get("payback", {}).get("kept")  # kept untuned: final if the tune phase keeps it
      or _payback.still_cannot_pay_back(value, horizon=site.horizon, sites=site.sites))
  if not final:
    selection.observed += 1
    return default, _report.OBSERVE
  name = value["winner"]
  session.record(hit=True, config=selection.config)
  if name == default:
    return name, _report.HIT
  if _verdict.loses(session, selection.cache, selection.context, bucket, name):
    return default, _report.LOSES_IN_CONTEXT
  selection.decisions[bucket] = (family.name, label, name)
  selection.tally.add_temporaries(label, name, value.get("temp_bytes", {}), default)
  return name, _report.HIT


def _in_context(site: _Site, selection: Selection, why: dict[str, Any], bucket: str) -> str:
  """`_leader_decides`, then the default where a cached verdict says the chosen
  kernel makes this program slower (reason ``"loses in context"``)."""
  name = _leader_decides(site, selection, why)
  if name != site.family.default and _verdict.loses(
      selection.session, selection.cache, selection.context, bucket, name):
    why["why"] = _report.LOSES_IN_CONTEXT
    why.pop("temp_bytes", None)
    return site.family.default
  return name


@dataclasses.dataclass(frozen=True)
class _Site:
  """One site being decided: its bucket, and what the decision depends on."""

  family: _registry.OpFamily
  spec: Any
  candidates: tuple[Any, ...]
  key: dict[str, Any]
  label: str
  sites: int  # of this bucket in the traced program so far
  horizon: int | None  # program runs the tuning must pay back within; None: unbounded
  phase: str


def _leader_decides(site: _Site, selection: Selection, why: dict[str, Any]) -> str:
  """The kernel process 0 chooses (every process, in a single-process run): the
  cache's, the default in the apply phase, or one tuned now. Says why in `why`."""
  config, session = selection.config, selection.session
  value = session.lookup(selection.cache, site.family.name, site.key,
                         platform=selection.platform)
  if value is not None and (not value.get("payback", {}).get("kept")
                            or _payback.still_cannot_pay_back(value, horizon=site.horizon,
                                                            sites=site.sites)):
    session.record(hit=True, config=config)
    why.update(why=_report.HIT, temp_bytes=value.get("temp_bytes", {}))
    return value["winner"]
  if site.phase == _tuning.APPLY:
    session.record(hit=False, config=config)
    why["why"] = _report.MISS
    return site.family.default
  # A bucket kept for a shorter horizon that now pays back is tuned outright.
  return _tune_now(site, selection, why, weigh_payback=value is None)


def leaves_as_written(op: str, spec: Any) -> bool:
  """Whether a routed call site (a Flax layer sent to `op`'s family) should run
  the user's own code: the active selection would give it the default having
  measured nothing (rewriting for a platform with no device here, or a GPU
  where nothing measured nor a prior says a candidate wins: `_xla_first`).
  The site is counted with that reason; a hint, a cached winner or a
  measurement routes it as before.

  Example:
    >>> from tunedjax.ops.batch_norm._spec import BatchNormSpec
    >>> leaves_as_written("batch_norm", BatchNormSpec((8, 4), "float32"))  # no selection
    False
  """
  selection = active_selection()
  if selection is None or selection.explain_only or selection.untuned:
    return False
  family = _registry.op_family(op)
  config = selection.config
  candidates = _registry.applicable_kernels(spec, selection.platform, op=family.name)
  if len(candidates) < 2 or family.name in _hints.active_hints(config):
    return False
  key = bucket_key(spec, candidates, bucket=config.kernel.bucket, family=family,
                   objective=config.kernel.objective)
  if not _measurable(selection.platform):
    why = f"no {selection.platform} here"
  elif (selection.session.lookup(selection.cache, family.name, key,
                                 platform=selection.platform) is None
        and _xla_first(family, key, candidates, selection)):
    why = _report.XLA_FIRST
  else:
    return False
  _count(selection, family.name, family.default, why + ", as written")
  return True


def _by_rule(family: _registry.OpFamily, key: dict[str, Any], candidates: Any,
             selection: Selection) -> str | None:
  """Where nothing can be timed (rewriting for a platform with no device here), the
  candidate the family's rule for that platform puts first, when even its
  pessimistic estimate beats the default by the tuner's margin (on a GPU, cuDNN's
  attention for half-precision causal attention); None: the default."""
  if family.presumed is None or len(candidates) < 2:
    return None
  prediction = predict_bucket(family, key, candidates, selection)
  if prediction is None:
    return None
  best = prediction.best()
  est = prediction.estimates.get(best)
  threshold = 1.0 / (1.0 + _tune_options(selection).margin)
  if best == family.default or est is None or est.source != "rule" or est.high >= threshold:
    return None
  return best


def _xla_first(family: _registry.OpFamily, key: dict[str, Any], candidates: Any,
               selection: Selection) -> bool:
  """Whether, on a GPU, nothing measured there, no prior of its class and no
  rule of the family says a candidate could beat the default (XLA's own
  kernel, cuDNN's convolutions autotuned by XLA): nothing is compiled ahead
  for the bucket, and a routed call site runs the user's own code."""
  if selection.platform != "gpu":
    return False
  prediction = predict_bucket(family, key, candidates, selection)
  if prediction is None:
    return False
  kept, _ = prediction.could_win(margin=_tune_options(selection).margin)
  return kept == [family.default]


def _tune_now(site: _Site, selection: Selection, why: dict[str, Any], *,
              weigh_payback: bool) -> str:
  """Tunes the site's bucket (`tune_bucket`), stores and counts the result."""
  config, session = selection.config, selection.session
  if selection.prefetch is None and _may_look_ahead(selection):  # e.g. a call site's bucket
    selection.prefetch = _prefetch.Prefetcher()
  options, prepared, ahead = _tune_options(selection), None, selection.prefetch
  if ahead is not None:  # its operands and default, if the work ahead has them
    with _tuning.first_call_stage("tune:compile"):
      prepared = ahead.take(json.dumps(site.key, sort_keys=True, default=str))
  # Costed by what tuning took on this platform (or its rule until measured there).
  payback = None if site.horizon is None or not weigh_payback else _payback.for_platform(
      session, selection.platform, horizon=site.horizon, sites=site.sites)
  prediction = (predict_bucket(site.family, site.key, site.candidates, selection)
                if options.predict and config.kernel.predict else None)
  with _tuning.first_call_stage("tune:time"):  # its compiles: "tune:compile"
    result = _tuner.tune_bucket(site.spec, site.candidates, platform=selection.platform,
                                options=options, label=site.label, family=site.family,
                                payback=payback, prediction=prediction, prepared=prepared,
                                beside=ahead)
  session.store(selection.cache, site.family.name, site.key, result.to_value(),
                platform=selection.platform)
  selection.measured.append((site.key, result.to_value()))
  record = result.payback
  if record and not result.kept:  # what tuning the rest took, against its estimate
    session.record_tuning_cost(record["estimate_s"], result.tuning_s - record["decided_s"],
                               platform=selection.platform)
  session.record(hit=False, tuning_s=result.tuning_s, tuned=not result.kept,
                 kept=result.kept, config=config)
  selection.tally.add_tuning(result.tuning_s)
  selection.tally.add_decision(_report.BucketDecision(
      site.label, site.family.name, result.winner, result.decided,
      len(result.compile_s) or 1, len(site.candidates), float(sum(result.compile_s.values())),
      result.regret))
  why.update(why=_report.CANNOT_PAY_BACK if result.kept else _report.TUNED,
             temp_bytes=result.temp_bytes)
  return result.winner


def _tune_options(selection: Selection) -> _tuner.TuneOptions:
  """How a bucket is tuned: the selection's options, with the config's objective."""
  options, objective = selection.options, selection.config.kernel.objective
  return options if options.objective == objective else dataclasses.replace(
      options, objective=objective)


def _may_look_ahead(selection: Selection) -> bool:
  """Whether this trace's misses are tuned now, in this process, with a core to spare."""
  return (not selection.explain_only and not selection.untuned
          and jax.process_count() == 1 and _tuning.usable_cores() > 1
          and _measurable(selection.platform)
          and selection.session.phase(selection.config) == _tuning.TUNE)


def _expect(family: _registry.OpFamily, spec: Any, selection: Selection,
            order: tuple[int, ...]) -> None:
  """Starts the work ahead for a site's bucket where `decide` will tune it: not
  hinted, a miss in the session and the cache, more than one candidate."""
  config = selection.config
  candidates = _registry.applicable_kernels(spec, selection.platform, op=family.name)
  if len(candidates) < 2 or family.name in _hints.active_hints(config):
    return
  key = bucket_key(spec, candidates, bucket=config.kernel.bucket, family=family,
                   objective=config.kernel.objective)
  if (_verdict.bucket_id(family.name, key) in selection.vetoed
      or selection.session.lookup(selection.cache, family.name, key,
                                  platform=selection.platform) is not None
      or _xla_first(family, key, candidates, selection)):
    return
  make = functools.partial(_tuner.prepared_default, spec, tuple(candidates),
                           platform=selection.platform, options=_tune_options(selection),
                           label=family.label(key), family=family)
  if selection.prefetch is None:
    selection.prefetch = _prefetch.Prefetcher()
  selection.prefetch.expect(json.dumps(key, sort_keys=True, default=str), make, order=order)


def _look_ahead(families: list[_registry.OpFamily]) -> Callable[..., list[Any]]:
  """The kernel pass's look at a jaxpr before its first equation: the sites
  of `families`' primitives, in order, to `_expect` (it finds no match)."""
  by_primitive = {f.primitive: f for f in families if f.primitive}

  def look(ctx: _engine.Context, jaxpr: Any) -> list[Any]:
    del ctx
    selection = active_selection()
    if selection is None or not by_primitive or not _may_look_ahead(selection):
      return []
    selection.lookaheads += 1
    for i, eqn in enumerate(jaxpr.eqns):
      family = by_primitive.get(eqn.primitive.name)
      if family is None:
        continue
      try:
        spec = family.from_equation(eqn)
      except Exception:  # pylint: disable=broad-except  # its rule reports it when reached
        continue
      _expect(family, spec, selection, order=(selection.lookaheads, i))
    return []

  return look


def predict_bucket(family: _registry.OpFamily, key: dict[str, Any], candidates: Any,
                   selection: Selection) -> _predict.Prediction | None:
  """The candidates' predicted times for a bucket on the selection's platform.

  All of it that platform's: the family's buckets measured on its device
  (the selection's cache is that device's file; this trace's buckets where
  there is no cache), the family's priors for its machine class, and where
  neither is near, the family's rule for the platform (`OpFamily.presumed`).
  None for a family without `OpFamily.features`.
  """
  if family.features is None:
    return None
  try:
    features = family.features(key)
    presumed = family.presumed(key, selection.platform) if family.presumed else None
  except Exception as e:  # pylint: disable=broad-except  # a family's bug: tune exhaustively
    logger.warning("autotune %s: the %s family's features or rule failed (%s: %s); every "
                   "candidate is timed.", family.label(key), family.name, type(e).__name__, e)
    return None
  cache = selection.cache
  entries = ([(e.key, e.value) for e in cache.entries(family.name)] if cache is not None
             else selection.measured)
  points = _predict.measured_points(family, entries)
  points += _predict.priors(family, _machine_classes(selection.platform),
                            selection.platform)
  return _predict.predict(features, [k.name for k in candidates], points,
                          default=family.default, presumed=presumed)


def _machine_classes(platform: str) -> tuple[str, ...]:
  """The machine classes of this process's `platform` device (the platform's
  name alone where it has none: rewriting for another machine)."""
  try:
    return _predict.machine_class(_tuning.device_fingerprint(platform))
  except TunedJaxError:
    return (platform,)


def _count(selection: Selection, op: str, name: str, why: str) -> None:
  if not selection.explain_only:
    selection.tally.add(op, name, why)


def _run_kernel(ctx: _engine.Context | None, fn: Callable[..., Any], invals: list[Any],
                post: _engine.Pass | None) -> Any:
  """Calls the kernel `fn` on `invals`, its equations through `post` if given.

  The kernel is traced to a jaxpr and evaluated with `post`'s rules in the
  caller's trace, so a pass like cleanup sees the kernel's own equations next
  to the program's (a kernel that transposes into its layout folds with a
  transpose the layout pass put before it). `post`'s counts join `ctx`'s.
  """
  if post is None or ctx is None:
    return fn(*invals)
  closed, flat, _ = _engine.trace(fn, *invals)
  sub = _engine.Context(post, platform=ctx.platform, config=ctx.config)
  (out,) = sub.finish(sub.eval_jaxpr(closed.jaxpr, closed.consts, flat), closed.out_avals,
                      "a kernel")
  for what, n in sub.counts.items():
    ctx.count(what, n)
  return out


def _apply(family: _registry.OpFamily, spec: Any, selection: Selection, operands: list[Any],
           want: Any, run_default: Callable[[], Any], ctx: _engine.Context | None = None,
           post: _engine.Pass | None = None, out_aval: Any = None) -> Any:
  """Decides a site and runs its kernel; the default on any failure (never worse).

  With `out_aval` (a replaced equation's output), explicitly sharded operands
  (jax 0.11+ meshes) run the kernel on Auto axes and the result gets the
  equation's output sharding (`_compat.on_auto_axes`).
  """
  name, why = decide(family, spec, selection)
  if name == family.default:
    _count(selection, family.name, name, why)
    return run_default()
  try:
    kernel = _registry.get_kernel(family.name, name).fn
    run = lambda *ops: _run_kernel(ctx, lambda *a: kernel(*a, spec), list(ops), post)
    out = run(*operands) if out_aval is None else _compat.on_auto_axes(run, operands, out_aval)
    got = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), out)
    if got != want:
      raise TypeError(f"it returned {got} for {want}")
  except Exception as e:  # pylint: disable=broad-except  # never worse than the default
    logger.warning("autotune: %s kernel %r could not be applied (%s: %s); using %s.",
                   family.name, name, type(e).__name__, e, family.default)
    _count(selection, family.name, name, _report.FAILED)
    return run_default()
  _count(selection, family.name, name, why)
  return out


@dataclasses.dataclass(frozen=True)
class _Chooser:
  """Decides pattern sites (`_sites`) with the active `Selection`, or this pass's."""

  cache: CacheLike
  options: _tuner.TuneOptions

  def selection(self, ctx: _engine.Context) -> Selection:
    return active_selection() or new_selection(
        platform=ctx.platform, config=ctx.config, cache=self.cache, options=self.options)

  def choose(self, ctx: _engine.Context, family: _registry.OpFamily, spec: Any
             ) -> tuple[str, str]:
    return decide(family, spec, self.selection(ctx))

  def checks(self, ctx: _engine.Context) -> _sites.BackwardChecks:
    selection = self.selection(ctx)
    return _sites.BackwardChecks(selection.session, selection.cache)

  def record(self, ctx: _engine.Context, family: _registry.OpFamily, kernel: str, why: str,
             matched: _report.MatchedSite, spec: Any = None) -> None:
    selection = self.selection(ctx)
    _count(selection, family.name, kernel, why)
    if spec is not None:
      matched = dataclasses.replace(matched, bucket=site_label(family, spec, selection))
    selection.tally.add_matched(matched)


def site_label(family: _registry.OpFamily, spec: Any, selection: Selection) -> str:
  """The bucket label `decide` gives a site of `family` with `spec`."""
  config = selection.config
  candidates = _registry.applicable_kernels(spec, selection.platform, op=family.name)
  return family.label(bucket_key(spec, candidates, bucket=config.kernel.bucket,
                                 family=family, objective=config.kernel.objective))


def pattern_pass(*, cache: CacheLike = None) -> _engine.Pass:
  """A `Pass` with only the op families' patterns (for `explain`: each site decided
  with the active `Selection`, the default's equations evaluated as written)."""
  return _engine.Pass("kernel_patterns", patterns=_sites.family_patterns(
      _registry.op_families(), _Chooser(cache, _tuner.TuneOptions())))


def kernel_pass(*, cache: CacheLike = None, rounds: int = _tuner.DEFAULT_ROUNDS,
                budget_s: float = _tuner.DEFAULT_BUDGET_S,
                margin: float = _tuner.DEFAULT_MARGIN, seed: int = 0,
                post: _engine.Pass | None = None) -> _engine.Pass:
  """The kernel-selection `Pass`: a rule for every op family found in the jaxpr.

  Each registered family with a ``primitive`` gets a rule for it; each
  family's ``patterns`` become the pass's patterns (`_sites`: a computation
  written out in other primitives, replaced with its forward, and in a
  differentiated jaxpr its backward, when its kernel is not the default). A rule
  decides with the `Selection` made current by `tunedjax.jit` or
  `select_kernels`; used on its own (through `tunedjax.rewrite.transform`)
  it decides with this pass's cache and options and the current session.

  Args:
    cache: the tuning cache: an `autotune.Cache`, a folder, None for the
      config's (``cache.dir``, ``$TUNEDJAX_CACHE_DIR``, ``~/.cache/tunedjax``),
      or False for none.
    rounds: timed rounds per candidate when tuning a bucket.
    budget_s: seconds tuning one bucket may take.
    margin: how much faster than the default a kernel must be to be chosen
      (0.10: more than 10%).
    seed: seed of the random tuning inputs.
    post: a pass the chosen kernel's own equations go through (`tunedjax.jit`
      gives its cleanup pass, whose rules it merges with this one's, so that
      one evaluation selects kernels and folds the transposes and casts a
      kernel makes against those around it).

  Returns:
    A `Pass` named ``"kernel_selection"``.

  Example:
    >>> import jax, jax.numpy as jnp, tempfile
    >>> from tunedjax import rewrite
    >>> f = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
    >>> x, w = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 1, 1))
    >>> p = kernel_pass(cache=tempfile.mkdtemp(), rounds=1, budget_s=1.0)
    >>> rewrite.transform(f, p)(x, w).shape
    (1, 3, 5, 5)
  """
  options = _tuner.TuneOptions(rounds=rounds, budget_s=budget_s, margin=margin, seed=seed)

  def rule_for(family: _registry.OpFamily) -> Callable[..., list[Any]]:
    def rule(ctx: _engine.Context, eqn: Any, invals: list[Any]) -> list[Any]:
      selection = active_selection() or new_selection(
          platform=ctx.platform, config=ctx.config, cache=cache, options=options)
      spec = family.from_equation(eqn)
      want = [(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
      out = _apply(family, spec, selection, list(invals),
                   want[0] if len(want) == 1 else tuple(want),
                   lambda: ctx.default(eqn, invals), ctx=ctx, post=post,
                   out_aval=eqn.outvars[0].aval if len(want) == 1 else None)
      if isinstance(out, list):  # the default's outputs
        return out
      return list(out) if isinstance(out, tuple) else [out]
    return rule

  families = _registry.op_families()
  rules = {f.primitive: rule_for(f) for f in families if f.primitive}
  patterns = (_look_ahead(families), *_sites.family_patterns(families, _Chooser(cache, options)))
  return _engine.Pass("kernel_selection", rules, patterns=patterns)


def dispatch(op: str, spec: Any, *operands: Any) -> Any:
  """Runs the kernel kernel selection chose for `spec`'s bucket; the default outside it.

  The call-site entry of an op family without a jaxpr primitive: a function
  such as `tunedjax.attention` builds its spec from its operands' shapes and
  calls this while it is traced. Under `tunedjax.jit` (or `select_kernels`)
  with kernel selection on, the site is decided like a convolution (hint,
  phase, cache, tuner) and counted in the report; elsewhere, and whenever
  the chosen kernel fails, the family's default kernel runs.

  Args:
    op: the op family's name.
    spec: the site's spec (an instance of the family's `spec_type`).
    *operands: the kernel's array operands.

  Returns:
    What the kernel returns.

  Raises:
    AutotuneError: an unknown family, or a spec of the wrong type.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from tunedjax.ops.conv._spec import ConvSpec
    >>> x, w = jnp.ones((1, 2, 4, 4)), jnp.ones((3, 2, 1, 1))
    >>> spec = ConvSpec.from_arrays(x, w)
    >>> dispatch("conv", spec, x, w).shape  # outside kernel selection: xla
    (1, 3, 4, 4)
  """
  family = _registry.op_family(op)
  if not isinstance(spec, family.spec_type):
    raise AutotuneError(f"dispatch({op!r}, spec, ...): spec must be a "
                        f"{family.spec_type.__name__}, got {type(spec).__name__}.")
  default = _registry.get_kernel(op, family.default).fn

  def run_default() -> Any:
    return default(*operands, spec)

  # Marked, so that a family's pattern does not find this site again in its kernel's
  # equations (`_sites.SITE_SCOPE`).
  with jax.named_scope(_sites.SITE_SCOPE):
    selection = active_selection()
    if selection is None:
      return run_default()
    want = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), jax.eval_shape(run_default))
    return _apply(family, spec, selection, list(operands), want, run_default)


def select_kernels(f: Callable[..., Any], *, cache: CacheLike = None,
                   platform: str | None = None, jit: bool = False,
                   rounds: int = _tuner.DEFAULT_ROUNDS,
                   budget_s: float = _tuner.DEFAULT_BUDGET_S,
                   margin: float = _tuner.DEFAULT_MARGIN,
                   session: _tuning.TuningSession | None = None,
                   on_report: Callable[[_report.KernelReport], None] | None = None,
                   ) -> Callable[..., Any]:
  """Runs `f` with each kernel site on the fastest kernel for its shape.

  The choice is made when the returned function is traced (see the module
  docstring for the order: hint, phase, cache, tuner). Without ``jit`` the
  result is a plain function that composes with `jax.jit`, `jax.grad` and
  `jax.vmap`; note that `jax.jit` then keeps the kernels of its first trace.
  With ``jit=True`` the result is jitted and traced again when the phase
  leaves observe, when the hints change or when the config changes.

  Args:
    f: the function; it may contain `jax.grad` (the backward convolutions
      are selected too) and call-site functions (`dispatch`).
    cache: an `autotune.Cache`, a folder, None for the config's cache, or
      False for none.
    platform: the platform kernels must run on (default: JAX's default backend).
    jit: return a jitted function that re-traces when the selection would change.
    rounds: timed rounds per candidate when tuning.
    budget_s: seconds tuning one bucket may take.
    margin: the fraction by which a kernel must beat the default to be chosen.
    session: the `TuningSession` whose phase is read (default: the current one).
    on_report: called with each trace's `KernelReport`.

  Returns:
    A function with `f`'s signature and results.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax.autotune._hints import hint
    >>> conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME").sum()
    >>> x, w = jnp.ones((1, 2, 6, 6)), jnp.ones((2, 2, 3, 3))
    >>> with hint(conv="xla"):
    ...   float(jax.jit(select_kernels(conv))(x, w))
    1024.0
  """
  options = _tuner.TuneOptions(rounds=rounds, budget_s=budget_s, margin=margin)
  transformed = _engine.transform(f, kernel_pass(cache=cache, rounds=rounds, budget_s=budget_s,
                                                 margin=margin), platform=platform)

  @functools.wraps(f)
  def selected(*args: Any, **kwargs: Any) -> Any:
    selection = new_selection(platform=platform, cache=cache, options=options,
                              session=session)
    with selecting(selection):
      out = transformed(*args, **kwargs)
    if on_report is not None:
      on_report(selection.tally.report())
    return out

  if not jit:
    return selected
  jitted: dict[Any, Callable[..., Any]] = {}
  lock = threading.Lock()

  @functools.wraps(f)
  def run(*args: Any, **kwargs: Any) -> Any:
    config = get_config()
    current = session or _tuning.current_session()
    state = (current, current.phase_key(config), _hints.active_hints(config), config)
    with lock:
      fn = jitted.get(state)
      if fn is None:
        # A new function object per state: jax.jit caches traces by function.
        fn = jitted[state] = jax.jit(functools.wraps(f)(
            lambda *a, **k: selected(*a, **k)))
    return fn(*args, **kwargs)

  return run
