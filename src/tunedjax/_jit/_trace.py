"""`tj.jit`'s tracing: the function traced inside `jax.jit`'s own trace with
the passes the config enables, its report filed, and level O2's persistent
compilation cache."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from tunedjax import _pipeline
from tunedjax import _tuning
from tunedjax._config import Config
from tunedjax._jit._key import UNTUNED
from tunedjax._jit._key import ProgramKey
from tunedjax._jit._options import JitOptions
from tunedjax._jit._reports import ReportBook
from tunedjax._jit._reports import SignatureReport
from tunedjax._tuning import _anatomy
from tunedjax.autotune import _routes
from tunedjax.autotune import _select
from tunedjax.autotune import _verdict
from tunedjax.autotune import _verify
from tunedjax.rewrite import _gc

logger = logging.getLogger("tunedjax.jit")

XLA_CACHE_SUBDIR = "xla"
PASS_NAMES = ("mixed_precision", "layout", "kernel_selection", "cleanup")


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



@dataclasses.dataclass(frozen=True)
class Builder:
  """Builds a `Jitted`'s program for a `ProgramKey`: `jax.jit` of the
  function rewritten by the passes (plain `jax.jit` at O0).

  Attributes:
    fun: the user's function.
    options: the `JitOptions`.
    book: the `ReportBook` each trace files its report in.
    after_trace: called after a trace with kernel selection, with the
      selection, the key and the trace's start on the check's clock.
  """

  fun: Callable[..., Any]
  options: JitOptions
  book: ReportBook
  after_trace: Callable[[Any, ProgramKey, float], None]

  def __call__(self, level: str, key: ProgramKey) -> Any:
    if level == "O0":
      return jax.jit(self.fun, **self.options.jax_jit)
    config = key.config
    if level == "O2":
      enable_compilation_cache(config)
    else:  # a GPU's or TPU's executables and XLA's autotuning, kept with the tuning cache
      _tuning.persist_xla(config)
    traced = _anatomy.recording(self._rewriting(level, config, key), self.book.firsts)
    return jax.jit(functools.wraps(self.fun)(traced), **self.options.jax_jit)

  def _rewriting(self, level: str, config: Config, key: ProgramKey) -> Callable[..., Any]:
    fun, platform = self.fun, self.options.platform
    session = key.session if key.selects else (self.options.session
                                                or _tuning.current_session())

    def rewritten(*args: Any, **kwargs: Any) -> Any:
      start, check_start = time.perf_counter(), _verify.clock()
      static, dyn_args, dyn_kwargs, rebuild = self.options.split_static(args, kwargs)

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
        self._shape_selection(selection, key, signature, (dyn_args, dyn_kwargs))
      # Python's garbage collector paused while tracing and rewriting, for at
      # most `_gc.LIMIT_S` (a full collection costs about the whole trace).
      with _tuning.using_session(session), _selecting(selection), _routing(selection), \
          _gc.paused():
        out = program(*dyn_args, **dyn_kwargs)
      if selection is not None:
        self.after_trace(selection, key, check_start)
      report = SignatureReport(
          signature=signature, level=level,
          reports=tuple(r for stage in stages for r in stage.reports()),
          trace_s=time.perf_counter() - start)
      abstract = jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type),
          (dyn_args, dyn_kwargs))
      self.book.file((key, signature), report, (abstract, static))
      return out

    return rewritten

  def _shape_selection(self, selection: Any, key: ProgramKey, signature: str,
                       dyn: Any) -> None:
    """The variant `key` runs (untuned, or buckets vetoed) and the program
    context its verdicts are looked up under."""
    selection.untuned = key.phase == UNTUNED
    selection.vetoed = key.vetoed
    platform = self.options.platform or jax.default_backend()
    selection.context = _verdict.context_key(
        self.book.name, str(jax.tree_util.tree_structure(dyn)), signature, platform)
