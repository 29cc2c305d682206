"""`tunedjax.jit`: `jax.jit` with the tuners' passes, at levels O0/O1/O2.

On each new input signature, inside `jax.jit`'s own trace, the function is
traced to a jaxpr and the passes the config enables run in order (mixed
precision if ``mixed_precision.enable``, layout if ``layout.enable``, kernel
selection if ``kernel.enable``), then a cleanup pass folds the casts and
transposes they leave next to each other, and the result is evaluated with
jit's tracers. So jit's cache, static arguments, donation, pytrees, `grad` and
`vmap` around it and sharded inputs behave as with `jax.jit`.

The compiled function is looked up by what the passes depend on: the level,
the config, the kernel-selection phase and the active kernel hints. A change
of any of them (a `config_context`, a step that leaves the tuning window)
takes effect on the next call.

Levels (after MindSpore's ``jit_level``):

- ``O0``: plain `jax.jit`, nothing rewritten (for debugging);
- ``O1``: the passes the config enables (the default, ``Config.level``);
- ``O2``: O1, plus JAX's persistent compilation cache in ``<cache dir>/xla``
  beside the tuning cache, so that a restarted job compiles less. It is the
  level at which the Trainer runs several steps in one compiled loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax

from tunedjax import _errors
from tunedjax import _host_memory
from tunedjax import _native
from tunedjax import _pipeline
from tunedjax import _tuning
from tunedjax._config import LEVELS
from tunedjax._config import Config
from tunedjax._config import get_config
from tunedjax._tuning import _anatomy
from tunedjax.autotune import _hints
from tunedjax.autotune import _routes
from tunedjax.autotune import _select
from tunedjax.autotune import _verdict
from tunedjax.autotune import _verify
from tunedjax.autotune._report import KernelReport
from tunedjax.layout._report import LayoutReport
from tunedjax.rewrite import _compat
from tunedjax.rewrite import _gc

logger = logging.getLogger("tunedjax.jit")

P = ParamSpec("P")
R = TypeVar("R")

XLA_CACHE_SUBDIR = "xla"
PASS_NAMES = ("mixed_precision", "layout", "kernel_selection", "cleanup")
PassReport = _pipeline.PassReport


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
  """What the compiled program needs, from `compiled.memory_analysis()`.

  Attributes:
    argument_bytes: inputs (parameters, optimizer state, batch).
    output_bytes: outputs.
    temp_bytes: temporaries (activations and intermediates).
    alias_bytes: outputs that reuse donated inputs.
    generated_code_bytes: the executable's code.
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  generated_code_bytes: int

  @classmethod
  def from_compiled(cls, compiled: Any) -> MemoryFigures | None:
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report memory
      return None
    return cls(argument_bytes=int(stats.argument_size_in_bytes),
               output_bytes=int(stats.output_size_in_bytes),
               temp_bytes=int(stats.temp_size_in_bytes),
               alias_bytes=int(stats.alias_size_in_bytes),
               generated_code_bytes=int(stats.generated_code_size_in_bytes))

  def __str__(self) -> str:
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # pylint: disable=unnecessary-lambda-assignment
    return (f"arguments {mib(self.argument_bytes)}, outputs {mib(self.output_bytes)}, "
            f"temporaries {mib(self.temp_bytes)}, aliased {mib(self.alias_bytes)}")


@dataclasses.dataclass(frozen=True)
class SignatureReport:
  """What `tunedjax.jit` did for one input signature: one typed report per pass.

  Attributes:
    signature: the traced input types and static values.
    level: ``"O0"``, ``"O1"`` or ``"O2"``.
    reports: one report per pass that ran, in order: `AutocastReport`,
      `LayoutReport`, `KernelReport`, `CleanupReport` (each has a ``name``
      and the seconds it spent tuning, ``tuning_s``).
    trace_s: seconds to trace the function and run the passes (compiling
      not included).
    memory: the compiled program's `MemoryFigures` (filled by `report()`).
    first_call: where the wall time of the call that traced this signature
      went, seconds per stage (`tunedjax.FirstCall`); None when no call
      traced it (``lower``, ``trace``, a call under another transformation
      such as `jax.grad`, or inside another `tunedjax.jit` function).

  The properties below read the typed reports: `passes`, `policy`, `casts`,
  `layout`, `kernel_report`, `kernels`, `cache_hits`, `cache_misses`,
  `tuning_s`, `cleanup`.
  """

  signature: str
  level: str
  reports: tuple[PassReport, ...] = ()
  trace_s: float = 0.0
  memory: MemoryFigures | None = None
  first_call: _tuning.FirstCall | None = None

  def report(self, name: str) -> PassReport | None:
    """The report of the pass called `name` (``"layout"``, ...), or None if it did not run."""
    for r in self.reports:
      if r.name == name:
        return r
    return None

  @property
  def passes(self) -> tuple[str, ...]:
    """The passes that ran, in order."""
    return tuple(r.name for r in self.reports)

  @property
  def policy(self) -> str | None:
    """The mixed-precision policy, or None when that pass did not run."""
    r = self.report("mixed_precision")
    return None if r is None else r.policy

  @property
  def casts(self) -> Mapping[str, int]:
    """The autocast pass's counters (casts inserted, ops per dtype)."""
    r = self.report("mixed_precision")
    return {} if r is None else dict(r.casts)

  @property
  def layout(self) -> LayoutReport | None:
    """The layout pass's `LayoutReport`, or None when it did not run."""
    return self.report("layout")

  @property
  def kernel_report(self) -> KernelReport | None:
    """Kernel selection's `KernelReport`, or None when it did not run."""
    return self.report("kernel_selection")

  @property
  def kernels(self) -> Mapping[str, int]:
    """``{"<op> <kernel> (<why>)": count}`` for display (read `kernel_report` in code)."""
    r = self.kernel_report
    return {} if r is None else dict(r.counts())

  @property
  def cache_hits(self) -> int:
    """Kernel buckets found in the tuning cache."""
    r = self.kernel_report
    return 0 if r is None else r.hits

  @property
  def cache_misses(self) -> int:
    """Kernel buckets not found (tuned now, or the default in the apply phase)."""
    r = self.kernel_report
    return 0 if r is None else r.misses

  @property
  def tuning_s(self) -> float:
    """Seconds spent tuning kernels and measuring layouts in this trace."""
    return float(sum(r.tuning_s for r in self.reports))

  @property
  def cleanup(self) -> Mapping[str, int]:
    """The cleanup pass's counters (casts and transposes folded)."""
    r = self.report("cleanup")
    return {} if r is None else dict(r.folded)

  @property
  def hit_rate(self) -> float:
    """cache_hits / (cache_hits + cache_misses); 1.0 when nothing was looked up."""
    total = self.cache_hits + self.cache_misses
    return self.cache_hits / total if total else 1.0

  def __str__(self) -> str:
    lines = [f"signature {self.signature}  (level {self.level})",
             f"  passes: {', '.join(self.passes) or 'none'}; traced and rewritten in "
             f"{self.trace_s:.3f} s"]
    for r in self.reports:
      if isinstance(r, LayoutReport):
        lines.append(f"  layout: {r.decision} -> {r.target} ({r.reason}); {_counts(r.counts)}")
      elif isinstance(r, KernelReport):
        lines.append(f"  kernels: {r}")
      elif isinstance(r, _pipeline.CleanupReport) and not r.folded:
        continue
      else:
        lines.append(f"  {r}")
    if self.memory is not None:
      lines.append(f"  memory: {self.memory}")
    if self.first_call is not None:
      lines += [f"  {line}" for line in str(self.first_call).splitlines()]
    return "\n".join(lines)


def _counts(counts: Mapping[str, int]) -> str:
  return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "nothing to do"


@dataclasses.dataclass(frozen=True)
class JitReport:
  """`Jitted.report()`: one `SignatureReport` per signature compiled, oldest first.

  Iterate over it, index it, or ``print`` it.
  """

  function: str
  signatures: tuple[SignatureReport, ...]

  def __iter__(self):
    return iter(self.signatures)

  def __len__(self) -> int:
    return len(self.signatures)

  def __getitem__(self, i: int) -> SignatureReport:
    return self.signatures[i]

  @property
  def last(self) -> SignatureReport:
    """The most recently traced signature."""
    if not self.signatures:
      raise _errors.TunedJaxError(
          f"tunedjax.jit({self.function}) has not been called yet: nothing to report.")
    return self.signatures[-1]

  def __str__(self) -> str:
    if not self.signatures:
      return f"tunedjax.jit({self.function}): not called yet."
    return "\n".join([f"tunedjax.jit({self.function}): {len(self.signatures)} signature(s)"]
                     + [str(s) for s in self.signatures])


def _check_level(level: Any) -> str | None:
  if level is None or (isinstance(level, str) and level in LEVELS):
    return level
  raise _errors.ConfigError(
      f"tunedjax.jit(level=...) must be one of {_errors.format_choices(LEVELS)} "
      f"(or None for the config's level), got {level!r}"
      f"{_errors.did_you_mean(str(level), LEVELS)}.")


def _as_tuple(name: str, value: Any, kind: type) -> tuple[Any, ...]:
  if value is None:
    return ()
  items = (value,) if isinstance(value, kind) else value
  try:
    items = tuple(items)
  except TypeError:
    items = (value,)
  bad = [v for v in items if not isinstance(v, kind) or isinstance(v, bool)]
  if bad:
    raise TypeError(f"tunedjax.jit({name}=...) must be {'an int' if kind is int else 'a str'} "
                    f"or a sequence of them, got {value!r}.")
  return items


def _argnames_to_nums(fun: Callable[..., Any], names: Sequence[str]) -> dict[str, int]:
  """Positions of the named parameters that can be passed positionally."""
  try:
    params = list(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):
    return {}
  positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  return {p.name: i for i, p in enumerate(params) if p.kind in positional and p.name in names}


def _all_names(fun: Callable[..., Any]) -> tuple[str, ...]:
  try:
    return tuple(inspect.signature(fun).parameters)
  except (TypeError, ValueError):
    return ()


def _check_static_and_donated(fun: Callable[..., Any], static_argnums: tuple[int, ...],
                              static_argnames: tuple[str, ...], donate_argnums: tuple[int, ...],
                              donate_argnames: tuple[str, ...]) -> None:
  names = _argnames_to_nums(fun, static_argnames + donate_argnames)
  static = set(static_argnums) | {names[n] for n in static_argnames if n in names}
  donated = set(donate_argnums) | {names[n] for n in donate_argnames if n in names}
  both = sorted(static & donated) + sorted(set(static_argnames) & set(donate_argnames))
  if both:
    raise _errors.ConfigError(
        f"tunedjax.jit: argument(s) {both} are both static and donated. A static "
        "argument is a Python value baked into the program, not a buffer: it cannot "
        "be donated. Remove it from donate_argnums/donate_argnames or from "
        "static_argnums/static_argnames.")


def enable_compilation_cache(config: Config) -> str | None:
  """Points JAX's persistent compilation cache at ``<cache dir>/xla`` (level O2).

  Thresholds are lowered so that every executable is kept: a restart should
  find all of them. Leaves a directory the user set themselves alone. A
  folder that cannot be used (under a regular file, read-only, full) is the
  tuning cache's decision (`usable_folder`): one `CacheWarning` naming the
  path and the reason, and this process compiles without a persistent cache.

  Returns:
    The directory in use, or None when it cannot be used.
  """
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  directory = _tuning.usable_folder(
      config.cache.resolved_dir / XLA_CACHE_SUBDIR, what="compilation cache (level O2)",
      consequence="executables are compiled for this process only")
  if directory is None:
    return None
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  logger.info("level O2: JAX's persistent compilation cache is %s", directory)
  return str(directory)


def _signature(dyn_args: Any, dyn_kwargs: Any, static: Mapping[Any, Any]) -> str:
  leaves = jax.tree_util.tree_leaves((dyn_args, dyn_kwargs))
  parts = [jax.typeof(x).str_short(short_dtypes=True) for x in leaves]
  parts += [f"{k}={v!r}" for k, v in static.items()]
  return ", ".join(parts)


_UNTUNED = "untuned"  # the variant with every decision on its default (its phase key)


def _base(state: Hashable) -> Hashable | None:
  """A kernel-selection state less what only kernel sites depend on (phase,
  hints, vetoed buckets); None for other states."""
  if not isinstance(state, tuple) or len(state) != 7:
    return None
  return (state[0], state[1], state[2], state[5])


def _arg_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
  """The structure, shapes and dtypes of a call's arguments: calls with the
  same key run the same program (only those are compared)."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  return treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))))
                        for x in leaves)


class _ProgramCheck:
  """The whole-program check of one tuned program, run on the calls it makes anyway.

  Each call with the checked program's arguments runs the variant the
  `_verify.Verifier` asks for, timed to the end of its run; every variant
  computes the same function (only kernels differ), so the calls' results
  are the program's. Calls with other arguments run the tuned program.
  When the search ends, the program it kept runs from then on and the
  verdicts are cached (`_verdict`).
  """

  def __init__(self, jitted: Jitted, verifier: _verify.Verifier, select_state: Hashable,
               selection: Any, args_key: Hashable):
    self.jitted, self.verifier, self.select_state = jitted, verifier, select_state
    self.selection, self.args_key = selection, args_key
    self.decisions = dict(selection.decisions)

  def _as_variant(self, vetoed: frozenset[str]) -> Any:
    if not vetoed:
      return None
    return _UNTUNED if vetoed == self.verifier.all else vetoed

  def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    jitted, verifier = self.jitted, self.verifier
    variant = verifier.next_variant()
    if variant is None or _arg_key(args, kwargs) != self.args_key:
      if variant is None:
        self.finish()
      return jitted._jitted()(*args, **kwargs)
    jitted._forced = self._as_variant(variant)
    try:
      fn, new = jitted._jitted_new()
      traces = jitted._traces
      start = _verify.clock()
      out = jax.block_until_ready(fn(*args, **kwargs))
      took = _verify.clock() - start
    finally:
      jitted._forced = None
    with _anatomy.first_call_stage("check"):
      verifier.record(variant, took, compiled=not new and traces == jitted._traces)
      if verifier.next_variant() is None:
        self.finish()
    return out

  def finish(self) -> None:
    """Keeps the program the search chose and caches the verdicts."""
    jitted, verifier, selection = self.jitted, self.verifier, self.selection
    final = verifier.final
    variant = self._as_variant(final)
    with jitted._lock:
      if variant is not None:
        jitted._kept[self.select_state] = variant
        if self.select_state in jitted._warm:  # the observe phase runs the same program
          jitted._kept[jitted._warm[self.select_state]] = variant
      jitted._last_state = jitted._fast = None
      jitted._state_memo = None  # the kept variant changes the state
      jitted._check = None
    lost = {b: {"kernel": self.decisions[b][2], "label": self.decisions[b][1], "how": how}
            for b, how in verifier.lost.items()}
    kept = {b: d[2] for b, d in self.decisions.items() if b not in final}
    if verifier.outcome == _verify.SKIPPED:  # seen, nothing verified: a later run checks again
      lost, kept = {}, {}
    if selection.context is not None:
      _verdict.store(selection.session, selection.cache, selection.context, lost=lost,
                     kept=kept, outcome=verifier.outcome)
    summary = verifier.summary()
    # A list: a convolution and its input gradient can share a label.
    summary["lost"] = [{"bucket": self.decisions[b][1], "kernel": self.decisions[b][2],
                        "how": how} for b, how in sorted(verifier.lost.items())]
    summary["from_cache"] = False
    jitted._verification = summary
    logger.info("tunedjax.jit(%s): whole-program check: %s (tuned/untuned %s, %d runs, "
                "%d compiles); lose in context: %s", jitted._name, summary["outcome"],
                summary["tuned_over_untuned"], summary["runs"], summary["compiles"],
                ", ".join(f"{d['bucket']} ({d['kernel']})" for d in summary["lost"]) or "none")


@contextlib.contextmanager
def _selecting(selection: Any) -> Iterator[None]:
  """`_select.selecting(selection)`, or nothing when kernel selection is off.

  The tuning cache's writes wait for the trace's end (`Cache.deferring`):
  the buckets a first call tunes are written to the file once, together.
  """
  if selection is None:
    yield
    return
  deferring = (contextlib.nullcontext() if selection.cache is None
               else selection.cache.deferring())
  with deferring, _select.selecting(selection):
    yield


def _routing(selection: Any) -> Any:
  """The op families' routes (`autotune._routes`: Flax's ``BatchNorm`` and
  attention modules onto their families) around a trace under kernel
  selection, as the Trainer's step gets them; nothing when it is off."""
  return contextlib.nullcontext() if selection is None else _routes.routed()


class Jitted(Generic[P, R]):
  """A function compiled by `tunedjax.jit`; call it as the function.

  Besides calling, `report()` says what each pass did per signature, `jaxpr`
  shows the rewritten program, `lower` lowers it as `jax.jit`'s does and
  `memory_analysis` gives the compiled program's memory figures.
  """

  def __init__(self, fun: Callable[P, R], *, level: str | None,
               static_argnums: tuple[int, ...], static_argnames: tuple[str, ...],
               donate_argnums: tuple[int, ...], donate_argnames: tuple[str, ...],
               platform: str | None, session: _tuning.TuningSession | None = None,
               verify: bool = True):
    self.__wrapped__ = fun
    self.level = level
    # As jax.jit does: a static name passed by position is static too, and back.
    positions = _argnames_to_nums(fun, static_argnames)
    names = {i: n for n, i in _argnames_to_nums(fun, _all_names(fun)).items()}
    self._static_argnums = tuple(sorted(set(static_argnums) | set(positions.values())))
    self._static_argnames = tuple(dict.fromkeys(
        static_argnames + tuple(names[i] for i in static_argnums if i in names)))
    donate_positions = _argnames_to_nums(fun, donate_argnames)
    # Given in full: the rewriting wrapper's (*args, **kwargs) hides the names from jax.jit.
    self._jit_options = dict(
        static_argnums=self._static_argnums, static_argnames=self._static_argnames,
        donate_argnums=tuple(sorted(set(donate_argnums) | set(donate_positions.values()))),
        donate_argnames=donate_argnames)
    self._platform = platform
    self._session = session
    self._lock = threading.Lock()
    self._compiled: dict[Hashable, Any] = {}
    self._last_state: tuple[Any, Any] | None = None  # (state, jitted): the fast path
    # Per (compiled program state, signature): a config change is a new entry.
    self._reports: dict[tuple[Hashable, str], SignatureReport] = {}
    self._abstract: dict[tuple[Hashable, str], tuple[Hashable, tuple[Any, Any]]] = {}
    # Programs with no kernel site do not depend on the phase, hints or verdicts:
    # per state less those (`_base`), whether every trace so far found no site,
    # and the program built first, which serves every such state.
    self._site_free: dict[Hashable, bool] = {}
    self._base_fn: dict[Hashable, Any] = {}
    self._traces = 0
    # The whole-program check (`_ProgramCheck`): on when the session has a horizon.
    self._verify = bool(verify)
    # A tuned trace to check after its call: (select state, selection, trace start).
    self._pending: tuple[Any, ...] | None = None
    self._check: _ProgramCheck | None = None
    self._forced: Any = None  # the variant a checked call runs
    self._kept: dict[Hashable, Any] = {}  # select state -> the variant the check kept
    self._checked: set[Hashable] = set()
    self._untuned_fn: dict[Hashable, Any] = {}  # an observe program with every default
    self._warm: dict[Hashable, Hashable] = {}  # select state -> observe state, same program
    self._verification: dict[str, Any] | None = None
    self._paused = False  # `checks_paused`: calls run the tuned program, untimed
    self._state_memo: tuple[Any, Hashable] | None = None  # (what it depends on, state)
    self._fast: tuple[Any, Any] | None = None  # (what the state depends on, jitted): per call
    # Runs of the horizon's unit per call (the Trainer's k-steps program: k).
    self._runs_per_call = 1
    self._firsts = _anatomy.Pending()  # first calls being recorded (`_first_call_done`)
    functools.update_wrapper(self, fun)
    # Host memory (auto mode): a few early calls measured for page faults, then None.
    self._probe = _host_memory.CallProbe(self._name) if _host_memory.measuring() else None

  def __repr__(self) -> str:
    return f"tunedjax.jit({self._name}, level={self.level!r})"

  @property
  def _name(self) -> str:
    return getattr(self.__wrapped__, "__qualname__", repr(self.__wrapped__))

  # -- calling ------------------------------------------------------------------

  def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
    if self._check is not None and not self._paused:  # the whole-program check times it
      return self._first_call_done(self._check.call(args, kwargs))
    fn = self._jitted()
    # A tuned program traced by `lower` or `trace` before this call: time the call.
    start = None if self._pending is None else _verify.clock()
    try:
      out = fn(*args, **kwargs) if self._probe is None else self._probed_call(fn, args, kwargs)
    except BaseException:
      _anatomy.drop(self._firsts)
      raise
    if self._pending is not None:  # this call traced (and compiled) a tuned program
      with self._lock:
        pending, self._pending = self._pending, None
      if pending is not None:  # else from the trace's start: tracing, compiling, running
        began = pending[2] if start is None else start
        with _anatomy.first_call_stage("check"):
          self._start_check(pending[:2], _verify.clock() - began, _arg_key(args, kwargs))
    return out if not self._firsts.count else self._first_call_done(out)

  def _first_call_done(self, out: Any) -> Any:
    """Files this thread's first-call record, if this call traced one, on its
    signature's report (`_anatomy.finish`: blocks on a first call's outputs)."""
    done = _anatomy.finish(self._firsts, out)
    if done is not None:
      key, first_call = done
      with self._lock:
        if key in self._reports:
          self._reports[key] = dataclasses.replace(self._reports[key], first_call=first_call)
    return out

  def _probed_call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    """A call of `fn` while the host-memory probe is on (`_host_memory.CallProbe`): CPU
    programs only."""
    probe = self._probe
    if (probe is None or probe.done or not _host_memory.measuring()
        or self._platform not in (None, "cpu") or jax.default_backend() != "cpu"):
      self._probe = None
      return fn(*args, **kwargs)
    return probe.call(lambda: fn(*args, **kwargs), jax.block_until_ready)

  def __get__(self, obj: Any, objtype: Any = None) -> Any:
    if obj is None:
      return self
    return functools.partial(self, obj)

  def _state(self, token: tuple[Any, ...] | None = None) -> tuple[str, Hashable]:
    """The level, and what the compiled program depends on: ``(level, config,
    session, phase key, hints, native suspended, vetoed buckets)`` with kernel
    selection on. The whole-program check's untuned variant has the phase key
    ``"untuned"`` (it shares the observe phase's program when that one has every
    site on its default)."""
    token = self._token() if token is None else token
    config = token[0]
    level = self.level or config.level
    if level == "O0":
      return level, (level,)
    if not config.kernel.enable:  # the phase and hints only matter to kernel selection
      return level, (level, config)
    # Working the state out costs microseconds (hints, phase): a call whose
    # inputs to it did not move reuses the last one.
    memo = self._state_memo
    if memo is not None and memo[0] == token:
      return level, memo[1]
    state = self._kernel_state(level, config, token[1])
    self._state_memo = (token, state)
    return level, state

  def _token(self) -> tuple[Any, ...]:
    """What `_state` depends on, read cheaply (every call reads it): the config
    and, with kernel selection on, the session, its phase, the hint blocks,
    whether native kernels are suspended and the variant the check forces.
    Compared element by element, by identity first."""
    config = get_config()
    if not config.kernel.enable:
      return (config,)
    session = self._session or _tuning.current_session()
    return (config, session, session.quick_phase_key(config), _hints.hint_blocks(),
            _native.is_suspended(), self._forced)

  def _kernel_state(self, level: str, config: Config, session: Any) -> Hashable:
    state = (level, config, session, session.phase_key(config),
             _hints.active_hints(config), _native.is_suspended())
    variant = self._forced
    if variant is None and self._kept:
      variant = self._kept.get(state)
    if variant is None:
      return state + (frozenset(),)
    if variant == _UNTUNED:
      return state[:3] + (_UNTUNED,) + state[4:] + (frozenset(),)
    return state + (variant,)

  def _jitted(self) -> Any:
    """The compiled function for the state now; a call whose `_token` did not
    move since the last one takes it without working the state out."""
    fast = self._fast
    if fast is not None and fast[0] == self._token():
      return fast[1]
    return self._jitted_new()[0]

  def _jitted_new(self) -> tuple[Any, bool]:
    """The compiled function for the state now, and whether it was built just now."""
    token = self._token()
    level, state = self._state(token)
    last = self._last_state
    if last is not None and last[0] == state:
      self._fast = (token, last[1])
      return last[1], False
    new = False
    with self._lock:
      fn = self._compiled.get(state)
      if fn is None:
        base = _base(state)
        fn = self._base_fn.get(base) if self._site_free.get(base) else None
        if fn is None and base is not None and state[3] == _UNTUNED and not state[6]:
          fn = self._untuned_fn.get(state[:3] + state[4:6])
        if fn is None:
          fn, new = self._build(level, state), True
          if base is not None:
            self._base_fn.setdefault(base, fn)
        self._compiled[state] = fn
      self._last_state = (state, fn)
      self._fast = (token, fn)
    return fn, new

  def _build(self, level: str, state: Hashable) -> Any:
    if level == "O0":
      return jax.jit(self.__wrapped__, **self._jit_options)
    config = state[1]
    if level == "O2":
      enable_compilation_cache(config)
    else:  # a GPU's or TPU's executables and XLA's autotuning, kept with the tuning cache
      _tuning.persist_xla(config)
    traced = _anatomy.recording(self._rewriting(level, config, state), self._firsts)
    return jax.jit(functools.wraps(self.__wrapped__)(traced), **self._jit_options)

  # -- the passes ---------------------------------------------------------------------

  def _split_static(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
    n = len(args)
    static_pos = {i % n if n else i for i in self._static_argnums if -n <= i < n}
    static = {i: args[i] for i in sorted(static_pos)}
    static.update({k: kwargs[k] for k in self._static_argnames if k in kwargs})
    dyn_pos = [i for i in range(n) if i not in static_pos]
    dyn_args = tuple(args[i] for i in dyn_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static}

    def rebuild(*d_args: Any, **d_kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
      full = list(args)
      for i, x in zip(dyn_pos, d_args):
        full[i] = x
      return tuple(full), {**{k: kwargs[k] for k in static if isinstance(k, str)}, **d_kwargs}

    return static, dyn_args, dyn_kwargs, rebuild

  def _rewriting(self, level: str, config: Config, state: Hashable) -> Callable[..., Any]:
    fun, platform = self.__wrapped__, self._platform
    session = state[2] if len(state) > 2 else (self._session or _tuning.current_session())

    def rewritten(*args: Any, **kwargs: Any) -> Any:
      start, check_start = time.perf_counter(), _verify.clock()
      static, dyn_args, dyn_kwargs, rebuild = self._split_static(args, kwargs)

      def inner(*d_args: Any, **d_kwargs: Any) -> Any:
        full_args, full_kwargs = rebuild(*d_args, **d_kwargs)
        with _anatomy.first_call_stage("trace"):
          return fun(*full_args, **full_kwargs)

      stages = _pipeline.plan(config, platform)
      program: Callable[..., Any] = inner
      for stage in stages:
        program = _anatomy.staged(f"pass:{stage.name}", stage.apply(program, platform))
      selection = None
      signature = _signature(dyn_args, dyn_kwargs, static)
      kernel_stages = [s for s in stages if isinstance(s, _pipeline.KernelStage)]
      if kernel_stages:
        selection = kernel_stages[0].selection = _select.new_selection(
            platform=platform, config=config, session=session)
        self._shape_selection(selection, state, signature, (dyn_args, dyn_kwargs))
      # Python's garbage collector paused while tracing and rewriting, for at
      # most `_gc.LIMIT_S` (a full collection costs about the whole trace).
      with _tuning.using_session(session), _selecting(selection), _routing(selection), \
          _gc.paused():
        out = program(*dyn_args, **dyn_kwargs)
      if selection is not None:
        self._after_trace(selection, state, check_start)
      report = SignatureReport(
          signature=signature, level=level,
          reports=tuple(r for stage in stages for r in stage.reports()),
          trace_s=time.perf_counter() - start)
      abstract = jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type),
          (dyn_args, dyn_kwargs))
      with self._lock:
        key = (state, signature)
        self._reports.pop(key, None)
        self._reports[key] = report
        self._abstract[key] = (state, (abstract, static))
      _anatomy.label(self._firsts, key)
      logger.info("tunedjax.jit(%s):\n%s", self._name, report)
      return out

    return rewritten

  def _shape_selection(self, selection: Any, state: Hashable, signature: str,
                       dyn: Any) -> None:
    """The variant `state` runs (untuned, or buckets vetoed) and the program
    context its verdicts are looked up under."""
    selection.untuned = state[3] == _UNTUNED
    selection.vetoed = state[6]
    platform = self._platform or jax.default_backend()
    selection.context = _verdict.context_key(
        self._name, str(jax.tree_util.tree_structure(dyn)), signature, platform)

  def _after_trace(self, selection: Any, state: Hashable, start: float) -> None:
    """Bookkeeping after a trace with kernel selection: site-free programs,
    and a tuned program for the whole-program check to verify (`start`: the
    trace's start on the verification clock)."""
    base = _base(state)
    with self._lock:
      self._traces += 1
      free = selection.seen == 0
      if not free and self._site_free.get(base):  # a state may share this program: no more
        shared = self._base_fn.pop(base, None)
        self._compiled = {k: v for k, v in self._compiled.items() if v is not shared}
        self._last_state = self._fast = None
      self._site_free[base] = self._site_free.get(base, True) and free
      select_key = state[:3] + ("select",) + state[4:6]
      warm = False
      if state[3] == "observe" and not state[6]:
        fn = self._compiled.get(state)
        if not selection.decisions:  # every site on its default: the untuned program
          self._untuned_fn.setdefault(state[:3] + state[4:6], fn)
        # Every site found its final kernel in the cache: the tune phase's
        # program is this one (compiled once for both phases).
        warm = selection.seen > 0 and selection.observed == 0
        if warm and fn is not None:
          self._compiled.setdefault(select_key + (frozenset(),), fn)
          self._warm[select_key] = state[:6]
      if (selection.decisions and (state[3] == "select" or warm) and not state[6]
          and select_key not in self._checked and self._verify):
        self._checked.add(select_key)
        self._pending = (select_key, selection, start)

  def _start_check(self, pending: tuple[Any, ...], compile_s: float, args_key: Any) -> None:
    """Starts the whole-program check of a tuned program (when it can pay back)."""
    select_state, selection = pending
    session, decisions = selection.session, dict(selection.decisions)
    # What compiling a variant costs: the call that traced the tuned program,
    # less the kernel tuning it did while tracing.
    compile_s = max(compile_s - selection.tally.report().tuning_s, 0.0)
    summary: dict[str, Any] = {"decisions": len(decisions)}
    entry = _verdict.load(session, selection.cache, selection.context)
    kernels = {k: v[2] for k, v in decisions.items()}
    if entry is not None and entry["kept"] == kernels:
      summary.update(outcome="verified earlier (cached)", from_cache=True)
    elif session.horizon is None:
      summary.update(outcome="not checked: no horizon")
    elif jax.process_count() > 1:
      summary.update(outcome="not checked: several processes")
    else:
      untuned = select_state[:3] + (_UNTUNED,) + select_state[4:] + (frozenset(),)
      compiled = untuned in self._compiled or (select_state[:3] + select_state[4:6]
                                                in self._untuned_fn)
      verifier = _verify.Verifier(
          {k: v[0] for k, v in decisions.items()},
          calls_left=max(session.horizon // self._runs_per_call - 1, 0),
          compile_s=compile_s,
          compiled=frozenset({frozenset(decisions)}) if compiled else frozenset())
      self._check = _ProgramCheck(self, verifier, select_state, selection, args_key)
      return
    self._verification = summary
    logger.info("tunedjax.jit(%s): whole-program check: %s", self._name, summary["outcome"])

  @contextlib.contextmanager
  def checks_paused(self) -> Iterator[None]:
    """Inside the block, calls run the program in use, untimed, and the
    whole-program check waits (for calls that are not real steps, such as a
    loader measuring its throughput against this function).

    Example:
      >>> import jax.numpy as jnp, tunedjax as tj
      >>> f = tj.jit(lambda x: x + 1)
      >>> with f.checks_paused():
      ...   f(jnp.ones(2)).tolist()
      [2.0, 2.0]
    """
    before, self._paused = self._paused, True
    try:
      yield
    finally:
      self._paused = before

  def verification(self) -> dict[str, Any] | None:
    """What the whole-program check found for the tuned program (None: no check yet).

    With kernel selection and a session horizon (`TuningSession.horizon`;
    the `Trainer` sets it), the first tuned program whose kernels are not
    all defaults is compared with the untuned one on its next calls, and
    decisions that make it slower are undone and cached (see docs/jit.md).

    Returns:
      ``{"outcome", "decisions", ...}``: the outcome (``"verified"``,
      ``"found losers"``, ``"untuned kept"``, ``"tie: tuned kept"``,
      ``"skipped: cannot pay back"``, ``"verified earlier (cached)"``, or
      ``"checking"`` while it runs), the tuned/untuned step-time ratio, trials,
      runs, compiles and the buckets that lose in context (``"lost"``: a list of
      ``{"bucket": label, "kernel", "how"}``).
    """
    check = self._check
    if check is not None:
      return {**check.verifier.summary(), "outcome": "checking"}
    return None if self._verification is None else dict(self._verification)

  # -- introspection ------------------------------------------------------------

  def report(self, *, memory: bool = True) -> JitReport:
    """What each pass did, for every signature compiled so far (oldest first).

    Args:
      memory: add each compiled program's memory figures. The program was
        compiled by the call that traced it, so this costs no compile.

    Returns:
      A `JitReport`; ``print`` it, or read its `SignatureReport` entries.

    Example:
      >>> import jax.numpy as jnp, tunedjax as tj
      >>> f = tj.jit(lambda x: jnp.tanh(x) * 2)
      >>> _ = f(jnp.ones(3))
      >>> f.report().last.signature
      'f32[3]'
    """
    with self._lock:
      items = list(self._reports.items())
      abstract = dict(self._abstract)
    out = []
    for key, rep in items:
      if memory and rep.memory is None and key in abstract:
        figures = self._memory_of(*abstract[key])
        if figures is not None:
          rep = dataclasses.replace(rep, memory=figures)
          with self._lock:
            if self._reports.get(key) is not None:
              rep = self._reports[key] = dataclasses.replace(self._reports[key], memory=figures)
      out.append(rep)
    return JitReport(self._name, tuple(out))

  def _memory_of(self, state: Hashable, saved: tuple[Any, Any]) -> MemoryFigures | None:
    (d_args, d_kwargs), static = saved
    with self._lock:
      fn = self._compiled.get(state)
    if fn is None:
      return None
    args = list(d_args)
    for i in sorted(k for k in static if isinstance(k, int)):
      args.insert(i, static[i])
    kwargs = {**d_kwargs, **{k: v for k, v in static.items() if isinstance(k, str)}}
    try:
      with _anatomy.not_a_call():
        return MemoryFigures.from_compiled(fn.lower(*args, **kwargs).compile())
    except Exception as e:  # pylint: disable=broad-except  # a report never fails a job
      logger.debug("tunedjax.jit: no memory figures for %s (%s)", self._name, e)
      return None

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """Lowers the rewritten function for `args`, as `jax.jit(f).lower` does.

    Example:
      >>> import jax.numpy as jnp, tunedjax as tj
      >>> tj.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()(jnp.ones(2)).tolist()
      [2.0, 2.0]
    """
    with _anatomy.not_a_call():
      return self._jitted().lower(*args, **kwargs)

  def trace(self, *args: Any, **kwargs: Any) -> Any:
    """Traces the rewritten function for `args`, as `jax.jit(f).trace` does."""
    with _anatomy.not_a_call():
      return self._jitted().trace(*args, **kwargs)

  def jaxpr(self, *args: Any, **kwargs: Any) -> Any:
    """The rewritten jaxpr for `args` (a `ClosedJaxpr`), for inspection.

    Example:
      >>> import jax.numpy as jnp, tunedjax as tj
      >>> print(tj.jit(lambda x: x * 2.0).jaxpr(jnp.ones(2)))
      { lambda ; a:f32[2]. let b:f32[2] = mul a 2.0:f32[] in (b,) }
    """
    return self.trace(*args, **kwargs).jaxpr

  def memory_analysis(self, *args: Any, **kwargs: Any) -> MemoryFigures | None:
    """The compiled program's memory figures for `args` (None if not reported)."""
    return MemoryFigures.from_compiled(self.lower(*args, **kwargs).compile())

  def export(self, *args: Any, platforms: Sequence[str] | None = None,
             disabled_checks: Sequence[Any] = (), device_kind: str | None = None,
             **kwargs: Any) -> Any:
    """The rewritten function as a `jax.export.Exported`, for serving or a check.

    With ``tj.jit(f, platform="gpu")`` the passes rewrite for the GPU (its
    layouts, its kernels) on any machine, and the program is lowered for CUDA
    without a GPU. `args` may be arrays or `jax.ShapeDtypeStruct`s. The
    Pallas convolution's Triton call, which kernel selection may have put in,
    is allowed (`jax.export` refuses custom calls without a stability
    guarantee): such an export runs only with the jaxlib that made it.
    tunedjax's native CPU kernels are left out (`tunedjax._native.suspended`):
    an exported program runs where tunedjax is not loaded, so its
    convolutions and batch norms use the best kernel that is plain JAX.

    Args:
      *args: the arguments, as for a call.
      platforms: JAX lowering platforms (``"cuda"``, ``"rocm"``, ``"tpu"``,
        ``"cpu"``); default: the one for ``platform`` (``"gpu"`` is CUDA), or
        JAX's default backend.
      disabled_checks: more `jax.export.DisabledSafetyCheck`s.
      device_kind: the GPU to lower Triton kernels for when this machine has
        none (default ``"NVIDIA H100"`` for CUDA), e.g. ``"NVIDIA A100"``.
      **kwargs: keyword arguments, as for a call.

    Returns:
      A `jax.export.Exported`.

    Example:
      >>> import jax, jax.numpy as jnp, tunedjax as tj
      >>> f = tj.jit(lambda x: jnp.tanh(x) * 2, platform="gpu")
      >>> f.export(jax.ShapeDtypeStruct((3,), jnp.float32)).platforms
      ('cuda',)
    """
    if platforms is None:
      platform = self._platform or jax.default_backend()
      platforms = [_compat.lowering_platform(platform)]
    checks = [*disabled_checks, *_compat.tunedjax_custom_call_checks(platforms)]
    with _compat.lowering_for(platforms, device_kind), _native.suspended(), \
        _anatomy.not_a_call():
      return jax.export.export(self._jitted(), platforms=platforms,
                               disabled_checks=checks)(*args, **kwargs)


@overload
def jit(fun: Callable[P, R], *, level: str | None = None,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None,
        platform: str | None = None,
        session: _tuning.TuningSession | None = None, verify: bool = True) -> Jitted[P, R]: ...


@overload
def jit(fun: None = None, *, level: str | None = None,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None,
        platform: str | None = None,
        session: _tuning.TuningSession | None = None, verify: bool = True,
        ) -> Callable[[Callable[P, R]], Jitted[P, R]]: ...


def jit(fun: Callable[P, R] | None = None, *, level: str | None = None,
        static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Iterable[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Iterable[str] | None = None,
        platform: str | None = None,
        session: _tuning.TuningSession | None = None, verify: bool = True) -> Any:
  """Compiles `fun` like `jax.jit`, with the tuners' passes the config enables.

  Use it bare (``@tj.jit``) or with options (``@tj.jit(level="O2",
  static_argnums=1)``). On each new input signature the function is traced,
  the enabled passes run (mixed precision, layout, kernel selection, then a
  cleanup), and the result is compiled by `jax.jit`; later calls with that
  signature run the compiled program directly. That first call waits for
  its outputs once, to time its first execution: where its time went is
  ``report().last.first_call`` (`tunedjax.FirstCall`); later calls dispatch
  asynchronously, as `jax.jit`'s do.

  Args:
    fun: the function.
    level: ``"O0"`` (plain `jax.jit`), ``"O1"`` (the enabled passes) or
      ``"O2"`` (O1 and JAX's persistent compilation cache under the tuning
      cache folder); None reads ``level`` from the config at each call.
    static_argnums: as in `jax.jit`.
    static_argnames: as in `jax.jit`.
    donate_argnums: as in `jax.jit`.
    donate_argnames: as in `jax.jit`.
    platform: the platform the passes tune for (default: JAX's default backend).
    session: the `tunedjax.autotune.TuningSession` whose phase kernel
      selection follows and whose statistics it records (default: the
      session current at each call, normally the one `autotune.step` drives).

  Returns:
    A `Jitted` function (or, without `fun`, a decorator that makes one).

  Raises:
    ConfigError: an unknown level, or an argument both static and donated.

  Example:
    >>> import jax, jax.numpy as jnp, tunedjax as tj
    >>> @tj.jit
    ... def conv(x, w):
    ...   return jax.nn.relu(jax.lax.conv(x, w, (1, 1), "SAME"))
    >>> with tj.config_context({"layout": {"enable": True}}):
    ...   y = conv(jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3)))
    >>> y.shape, conv.report().last.layout.decision
    ((1, 4, 8, 8), 'relaid')
  """
  level = _check_level(level)
  options = dict(
      static_argnums=_as_tuple("static_argnums", static_argnums, int),
      static_argnames=_as_tuple("static_argnames", static_argnames, str),
      donate_argnums=_as_tuple("donate_argnums", donate_argnums, int),
      donate_argnames=_as_tuple("donate_argnames", donate_argnames, str))

  def decorate(f: Callable[P, R]) -> Jitted[P, R]:
    if not callable(f):
      raise TypeError(f"tunedjax.jit expects a function, got {f!r}.")
    _check_static_and_donated(f, **options)
    if platform is not None:
      _tuning.canonical_platform(platform)  # an unknown name: a ConfigError listing the valid ones
    if session is not None and not isinstance(session, _tuning.TuningSession):
      raise TypeError(f"tunedjax.jit(session=...) must be a tunedjax.autotune.TuningSession "
                      f"or None, got {session!r}.")
    if not isinstance(verify, bool):
      raise TypeError(f"tunedjax.jit(verify=...) must be True or False, got {verify!r}.")
    return Jitted(f, level=level, platform=platform, session=session, verify=verify,
                  **options)

  return decorate if fun is None else decorate(fun)
