"""A first call's anatomy: where the wall time of a new signature's first call went.

`tunedjax.jit` traces, rewrites, tunes, compiles and runs a program the first
time it meets a signature; this module says how long each part took, as a
`FirstCall` (stage name -> seconds, adding up to the call's wall time).

How it is measured, without touching later calls:

- **A context-local recorder.** The function `jax.jit` traces is wrapped by
  `recording`: its trace begins a recorder in a `contextvars.ContextVar`
  (so two threads tracing at once keep separate records), unless it is
  nested in another recorded trace (a `tunedjax.jit` function called inside
  another's) or runs outside a call (`not_a_call`: ``lower``, ``trace``,
  ``export``). The call's caller ends it (`finish`): it blocks on the
  outputs once, so the first execution is measured to its end.
- **A stage clock that nests.** `first_call_stage(name)` times a block into
  the current recorder, if any; the time of a stage opened inside another
  is subtracted from the outer one, so the stages never overlap. tunedjax
  opens ``trace`` (the user's function), ``pass:<name>`` (each pass's
  evaluation), ``tune:time`` (a bucket's tuning) around ``tune:compile``
  (its candidates' compiles) and ``check`` (the whole-program check's work).
- **JAX's own compile events.** Lowering to StableHLO and XLA's compile of
  the step are read from `jax.monitoring`'s duration events in the
  recording thread (``compile``); the first execution (``first_run``) runs
  from the step's compile to its outputs being ready. A compile event inside
  a ``tune:*`` stage counts as ``tune:compile``; inside the user's function
  or a pass it stays theirs.
- ``other`` is the rest: the total less every stage (JAX's own bookkeeping
  around tracing and lowering, the report's), never negative.

``total_s`` runs from the start of the trace (JAX's argument checks before
it, well under a millisecond, are not counted) to the outputs being ready.

Example:
  >>> first = FirstCall({"trace": 0.25, "compile": 0.5, "other": 0.25}, 1.0)
  >>> first.share("compile")
  0.5
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import jax

# The stages, in the order a first call meets them (`FirstCall.stages` follows it;
# a stage not listed comes after the listed ones, in the order it was first met).
ORDER = ("trace", "pass:mixed_precision", "pass:layout", "pass:kernel_selection",
         "pass:cleanup", "tune:compile", "tune:time", "compile", "check", "first_run",
         "other")
_TUNE, _TUNE_COMPILE, _COMPILE, _FIRST_RUN, _OTHER = (
    "tune:", "tune:compile", "compile", "first_run", "other")
_clock = time.perf_counter


@dataclasses.dataclass(frozen=True)
class FirstCall:
  """Where the wall time of one signature's first call went.

  Attributes:
    stages: stage name -> seconds, in the order the call met them; the
      stages are disjoint and add up to `total_s`: ``"trace"`` (tracing the
      function), ``"pass:<name>"`` (each pass that ran: ``mixed_precision``,
      ``layout``, ``kernel_selection`` (with the cleanup it shares an
      evaluation with), ``cleanup``), ``"tune:compile"`` (compiling kernel
      candidates), ``"tune:time"`` (the rest of tuning: calling, checking and
      timing them), ``"compile"`` (lowering and XLA's compile of the step),
      ``"check"`` (the whole-program check's work in this call),
      ``"first_run"`` (the first execution, to its outputs being ready) and
      ``"other"`` (the rest).
    total_s: the call's measured wall time, from the start of its trace to
      its outputs being ready.

  Example:
    >>> first = FirstCall({"trace": 0.1, "compile": 0.3, "other": 0.0}, 0.4)
    >>> print(first)
    first call: 0.400 s
      trace     0.100 s   25.0%
      compile   0.300 s   75.0%
      other     0.000 s    0.0%
  """

  stages: Mapping[str, float]
  total_s: float

  def share(self, name: str) -> float:
    """The fraction of `total_s` stage `name` took (0.0 for a stage that did not run)."""
    return self.stages.get(name, 0.0) / self.total_s if self.total_s > 0 else 0.0

  def as_dict(self) -> dict[str, Any]:
    """``{"total_s": ..., "stages": {name: seconds}}``, JSON-able."""
    return {"total_s": float(self.total_s),
            "stages": {k: float(v) for k, v in self.stages.items()}}

  def __str__(self) -> str:
    width = max((len(k) for k in self.stages), default=5) + 2
    lines = [f"first call: {self.total_s:.3f} s"]
    lines += [f"  {name:<{width}}{seconds:6.3f} s  {100 * self.share(name):5.1f}%"
              for name, seconds in self.stages.items()]
    return "\n".join(lines)


class Pending:
  """The first calls of one function whose records are open (in any thread).

  Its owner reads `count` after every call (one attribute: a call whose
  trace began no record pays nothing more) and ends its own with `finish`.
  """

  __slots__ = ("count", "_lock")

  def __init__(self) -> None:
    self.count = 0
    self._lock = threading.Lock()

  def _add(self, n: int) -> None:
    with self._lock:
      self.count = max(self.count + n, 0)


class _Recorder:
  """One first call in progress, in one thread: exclusive seconds per stage."""

  __slots__ = ("pending", "thread", "start", "tracing", "key", "seconds", "stack")

  def __init__(self, pending: Pending | None):
    self.pending = pending  # None: not a call (nothing is recorded)
    self.thread = threading.get_ident()
    self.start = _clock()
    self.tracing = True
    self.key: Hashable | None = None
    self.seconds: dict[str, float] = {}
    self.stack: list[list[Any]] = []  # [name, start, seconds of the stages inside]

  def mine(self) -> bool:
    return self.pending is not None and self.thread == threading.get_ident()

  def push(self, name: str) -> None:
    self.stack.append([name, _clock(), 0.0])

  def pop(self) -> None:
    name, began, inner = self.stack.pop()
    took = _clock() - began
    self._add(name, took - inner)
    if self.stack:
      self.stack[-1][2] += took

  def _add(self, name: str, seconds: float) -> None:
    self.seconds[name] = self.seconds.get(name, 0.0) + max(seconds, 0.0)

  def nested(self, name: str, seconds: float) -> None:
    """A stage of `seconds` that ran inside the open one, timed by someone else."""
    self._add(name, seconds)
    if self.stack:
      self.stack[-1][2] += seconds

  def compiled(self, backend: bool, seconds: float) -> None:
    """JAX lowered (``backend`` False) or compiled a program in this thread."""
    top = self.stack[-1][0] if self.stack else None
    if top is None or top == _FIRST_RUN:  # the step itself
      self.nested(_COMPILE, seconds)
      if backend and top is None and not self.tracing:
        self.push(_FIRST_RUN)  # from the step's compile to its outputs ready
    elif top.startswith(_TUNE) and top != _TUNE_COMPILE:
      self.nested(_TUNE_COMPILE, seconds)

  def result(self) -> FirstCall:
    while self.stack:
      self.pop()
    total = _clock() - self.start
    rank = {name: i for i, name in enumerate(ORDER)}
    stages = {k: self.seconds[k] for k in sorted(self.seconds, key=lambda k: rank.get(k, 99))}
    stages[_OTHER] = max(total - sum(stages.values()), 0.0)
    return FirstCall(stages, total)


_current: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "tunedjax_first_call", default=None)


class first_call_stage:  # pylint: disable=invalid-name  # used as a context manager
  """Times a block as stage `name` of the first call being recorded, if any.

  Cheap outside a recorded first call (one context-variable read). A stage
  opened inside another is subtracted from it.

  Example:
    >>> with first_call_stage("tune:time"):  # no first call recorded: nothing to do
    ...   pass
  """

  __slots__ = ("name", "recorder")

  def __init__(self, name: str):
    self.name = name
    self.recorder: _Recorder | None = None

  def __enter__(self) -> None:
    rec = _current.get()
    if rec is not None and rec.mine():
      rec.push(self.name)
      self.recorder = rec

  def __exit__(self, *exc: Any) -> None:
    rec, self.recorder = self.recorder, None
    if rec is not None:
      rec.pop()


def recording(fn: Callable[..., Any], pending: Pending) -> Callable[..., Any]:
  """`fn`, the function `jax.jit` traces, beginning a first-call record in `pending`
  when it is traced by a call (not nested in another record, not `not_a_call`)."""
  _listen()

  def traced(*args: Any, **kwargs: Any) -> Any:
    rec = _begin(pending)
    if rec is None:
      return fn(*args, **kwargs)
    try:
      out = fn(*args, **kwargs)
    except BaseException:
      _end(rec)
      raise
    rec.tracing = False
    return out

  return traced


def _begin(pending: Pending) -> _Recorder | None:
  current = _current.get()
  if current is not None and current.thread == threading.get_ident():
    if current.tracing:
      return None  # inside another recorded trace, or not a call
    _end(current)  # one that never finished (its call raised): dropped
  rec = _Recorder(pending)
  pending._add(1)  # pylint: disable=protected-access
  _current.set(rec)
  return rec


def _end(rec: _Recorder) -> None:
  if _current.get() is rec:
    _current.set(None)
  if rec.pending is not None:
    rec.pending._add(-1)  # pylint: disable=protected-access
    rec.pending = None


def label(pending: Pending, key: Hashable) -> None:
  """Names the record `pending` has open in this thread (the report it belongs to)."""
  rec = _current.get()
  if rec is not None and rec.pending is pending and rec.mine() and rec.tracing:
    rec.key = key


def finish(pending: Pending, out: Any) -> tuple[Hashable, FirstCall] | None:
  """Ends this thread's first-call record of `pending`, if one is open.

  Blocks on `out` (a first call's outputs: the first execution is timed to
  its end; later calls never block here).

  Returns:
    ``(key, FirstCall)``, or None: no record of `pending` in this thread, or
    a call that could not be measured (traced under another transformation:
    its outputs are tracers, nothing ran).
  """
  rec = _current.get()
  if rec is None or rec.pending is not pending or not rec.mine() or rec.tracing:
    return None
  _end(rec)
  leaves = jax.tree_util.tree_leaves(out)
  if rec.key is None or any(isinstance(x, jax.core.Tracer) for x in leaves):
    return None
  jax.block_until_ready(out)
  return rec.key, rec.result()


def drop(pending: Pending) -> None:
  """Ends this thread's record of `pending` unmeasured (its call raised)."""
  rec = _current.get()
  if rec is not None and rec.pending is pending and rec.mine():
    _end(rec)


@contextlib.contextmanager
def not_a_call() -> Iterator[None]:
  """Inside the block, traces begin no record (``lower``, ``trace``, ``export``:
  a program is traced, nothing runs)."""
  token = _current.set(_Recorder(None))
  try:
    yield
  finally:
    _current.reset(token)


def _on_duration(event: str, duration: float, *, events: frozenset[str], backend: str,
                 **_: Any) -> None:
  """`jax.monitoring`'s duration listener: lowering and compiles in a recording thread."""
  if event not in events:
    return
  rec = _current.get()
  if rec is not None and rec.mine():
    rec.compiled(event == backend, duration)


@functools.cache
def _listen() -> None:
  """Registers `_on_duration` with `jax.monitoring`, once per process."""
  from tunedjax.rewrite import _compat  # pylint: disable=import-outside-toplevel
  jax.monitoring.register_event_duration_secs_listener(functools.partial(
      _on_duration, events=_compat.COMPILE_EVENTS, backend=_compat.BACKEND_COMPILE_EVENT))


def staged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, each call timed as stage `name` (`first_call_stage`)."""

  def timed(*args: Any, **kwargs: Any) -> Any:
    with first_call_stage(name):
      return fn(*args, **kwargs)

  return timed
