"""`Jitted`, the function `tj.jit` returns: a facade over its options, its
program table, its whole-program check and its report book."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax

from tunedjax import _errors
from tunedjax import _host_memory
from tunedjax import _native
from tunedjax import _tuning
from tunedjax._jit import _options
from tunedjax._jit._check import WholeProgramCheck
from tunedjax._jit._key import ProgramKey
from tunedjax._jit._options import JitOptions
from tunedjax._jit._reports import JitReport
from tunedjax._jit._reports import MemoryFigures
from tunedjax._jit._reports import ReportBook
from tunedjax._jit._table import ProgramTable
from tunedjax._jit._trace import Builder
from tunedjax._tuning import _anatomy
from tunedjax.autotune import _verify
from tunedjax.rewrite import _compat

P = ParamSpec("P")
R = TypeVar("R")


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
    self._options = JitOptions.of(
        fun, level=level, static_argnums=static_argnums, static_argnames=static_argnames,
        donate_argnums=donate_argnums, donate_argnames=donate_argnames, platform=platform,
        session=session, verify=bool(verify))
    name = getattr(fun, "__qualname__", repr(fun))
    self._book = ReportBook(name)
    self._table = ProgramTable(self._options, Builder(fun, self._options, self._book,
                                                      self._after_trace))
    # The whole-program check (`WholeProgramCheck`): on when the session has a horizon.
    self._check = WholeProgramCheck(name, self._table, enabled=verify)
    functools.update_wrapper(self, fun)
    # Host memory (auto mode): a few early calls measured for page faults, then None.
    self._probe = _host_memory.CallProbe(name) if _host_memory.measuring() else None

  def __repr__(self) -> str:
    return f"tunedjax.jit({self._book.name}, level={self.level!r})"

  @property
  def level(self) -> str | None:
    """The level given to `tj.jit` (None: the config's level at each call)."""
    return self._options.level

  @property
  def trace_count(self) -> int:
    """How many times the function was traced with kernel selection on (a
    new count means new programs: the Trainer re-reads what they chose)."""
    return self._table.trace_count

  @property
  def runs_per_call(self) -> int:
    """Runs of the session horizon's unit per call, 1 by default; the
    whole-program check budgets the horizon divided by it. Set it when one
    call runs several steps (the Trainer's k-steps program: ``k``).

    Example:
      >>> import tunedjax as tj
      >>> f = tj.jit(lambda x: x)
      >>> f.runs_per_call = 4
      >>> f.runs_per_call
      4
    """
    return self._check.runs_per_call

  @runs_per_call.setter
  def runs_per_call(self, runs: int) -> None:
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
      raise _errors.ConfigError(f"Jitted.runs_per_call must be a positive int (the runs of "
                                f"the horizon's unit one call makes), got {runs!r}.")
    self._check.runs_per_call = runs

  # -- calling ------------------------------------------------------------------

  def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
    check, book = self._check, self._book
    if check.busy:  # the whole-program check waits to start or runs
      return self._checked_call(args, kwargs)
    fn = self._table.program()
    try:
      out = fn(*args, **kwargs) if self._probe is None else self._probed_call(fn, args, kwargs)
    except BaseException:
      _anatomy.drop(book.firsts)
      raise
    if check.busy:  # this call traced (and compiled) a tuned program: its check starts
      check.after_call(None, args, kwargs)
    return out if not book.firsts.count else book.first_call_done(out)

  def _checked_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call while the whole-program check waits to start or runs."""
    check, book = self._check, self._book
    if check.running:  # the whole-program check times it
      return book.first_call_done(check.call(args, kwargs))
    fn = self._table.program()
    # A tuned program traced by `lower` or `trace` before this call: time the call.
    start = None if not check.pending else _verify.clock()
    try:
      out = fn(*args, **kwargs) if self._probe is None else self._probed_call(fn, args, kwargs)
    except BaseException:
      _anatomy.drop(book.firsts)
      raise
    if check.pending:  # this call traced (and compiled) a tuned program
      check.after_call(start, args, kwargs)
    return out if not book.firsts.count else book.first_call_done(out)

  def _after_trace(self, selection: Any, key: ProgramKey, start: float) -> None:
    """After a trace with kernel selection (`start`: on the check's clock)."""
    warm = self._table.after_trace(selection, key)
    self._check.note_trace(selection, key, warm, start)

  def _probed_call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    """`fn` called under the host-memory probe (`_host_memory.CallProbe`): CPU only."""
    probe = self._probe
    if (probe is None or probe.done or not _host_memory.measuring()
        or self._options.platform not in (None, "cpu") or jax.default_backend() != "cpu"):
      self._probe = None
      return fn(*args, **kwargs)
    return probe.call(lambda: fn(*args, **kwargs), jax.block_until_ready)

  def __get__(self, obj: Any, objtype: Any = None) -> Any:
    if obj is None:
      return self
    return functools.partial(self, obj)

  def _jitted(self) -> Any:
    """The compiled function for the state now (`ProgramTable.program`)."""
    return self._table.program()

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
    with self._check.paused():
      yield

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
    return self._check.summary()

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
    return self._book.report(self._table.compiled, memory=memory)

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
      platform = self._options.platform or jax.default_backend()
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
  level = _options.check_level(level)
  options = dict(
      static_argnums=_options.as_tuple("static_argnums", static_argnums, int),
      static_argnames=_options.as_tuple("static_argnames", static_argnames, str),
      donate_argnums=_options.as_tuple("donate_argnums", donate_argnums, int),
      donate_argnames=_options.as_tuple("donate_argnames", donate_argnames, str))

  def decorate(f: Callable[P, R]) -> Jitted[P, R]:
    if not callable(f):
      raise TypeError(f"tunedjax.jit expects a function, got {f!r}.")
    _options.check_static_and_donated(f, **options)
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
