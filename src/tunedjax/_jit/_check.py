"""`tj.jit`'s whole-program check: a tuned program against the untuned one,
on the calls the program makes anyway.

`WholeProgramCheck` decides, after a tuned trace's call, whether a check can
pay back, and routes calls to the run in progress (`ProgramCheck`), which asks
the `ProgramTable` for the variant the `_verify.Verifier` wants; when the
search ends the table keeps the program it chose and the verdicts are cached
(`_verdict`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax

from tunedjax._jit._key import SELECT
from tunedjax._jit._key import UNTUNED
from tunedjax._jit._key import ProgramKey
from tunedjax._jit._key import arg_key
from tunedjax._jit._table import ProgramTable
from tunedjax._tuning import _anatomy
from tunedjax.autotune import _verdict
from tunedjax.autotune import _verify

logger = logging.getLogger("tunedjax.jit")


class ProgramCheck:
  """The whole-program check of one tuned program, run on the calls it makes anyway.

  Each call with the checked program's arguments runs the variant the
  `_verify.Verifier` asks for, timed to the end of its run; every variant
  computes the same function (only kernels differ), so the calls' results
  are the program's. Calls with other arguments run the tuned program.
  When the search ends, the program it kept runs from then on and the
  verdicts are cached (`_verdict`); `done` gets the summary.
  """

  def __init__(self, table: ProgramTable, verifier: _verify.Verifier, select_key: ProgramKey,
               selection: Any, args_key: Hashable, *, name: str,
               done: Callable[[dict[str, Any]], None]):
    self.table, self.verifier, self.select_key = table, verifier, select_key
    self.selection, self.args_key = selection, args_key
    self.decisions = dict(selection.decisions)
    self.name, self.done = name, done

  def _as_variant(self, vetoed: frozenset[str]) -> Any:
    if not vetoed:
      return None
    return UNTUNED if vetoed == self.verifier.all else vetoed

  def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    table, verifier = self.table, self.verifier
    variant = verifier.next_variant()
    if variant is None or arg_key(args, kwargs) != self.args_key:
      if variant is None:
        self.finish()
      return table.program()(*args, **kwargs)
    fn, new = table.lookup(self._as_variant(variant))
    traces = table.trace_count
    start = _verify.clock()
    out = jax.block_until_ready(fn(*args, **kwargs))
    took = _verify.clock() - start
    with _anatomy.first_call_stage("check"):
      verifier.record(variant, took, compiled=not new and traces == table.trace_count)
      if verifier.next_variant() is None:
        self.finish()
    return out

  def finish(self) -> None:
    """Keeps the program the search chose and caches the verdicts."""
    verifier, selection = self.verifier, self.selection
    final = verifier.final
    self.table.keep(self.select_key, self._as_variant(final))
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
    self.done(summary)
    logger.info("tunedjax.jit(%s): whole-program check: %s (tuned/untuned %s, %d runs, "
                "%d compiles); lose in context: %s", self.name, summary["outcome"],
                summary["tuned_over_untuned"], summary["runs"], summary["compiles"],
                ", ".join(f"{d['bucket']} ({d['kernel']})" for d in summary["lost"]) or "none")


class WholeProgramCheck:
  """The whole-program check of one `Jitted`: which tuned program to check,
  the run in progress, and what it found.

  Attributes:
    runs_per_call: runs of the session horizon's unit per call (the
      Trainer's k-steps program: k); the check's budget is the horizon
      divided by it.
    busy: whether a check waits to start or runs (a plain field: every call
      reads it, and calls while it is False take the plain path).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax._jit._options import JitOptions
    >>> table = ProgramTable(JitOptions(), lambda level, key: jax.jit(jnp.sin))
    >>> check = WholeProgramCheck("f", table, enabled=True)
    >>> check.running, check.summary()
    (False, None)
  """

  def __init__(self, name: str, table: ProgramTable, *, enabled: bool):
    self.runs_per_call = 1
    self.busy = False  # `_pending` or `_run` set (`_settle`)
    self._name, self._table, self._enabled = name, table, bool(enabled)
    self._lock = threading.Lock()
    # A tuned trace to check after its call: (select key, selection, trace start).
    self._pending: tuple[Any, ...] | None = None
    self._run: ProgramCheck | None = None
    self._checked: set[ProgramKey] = set()
    self._verification: dict[str, Any] | None = None
    self._paused = False  # `paused`: calls run the tuned program, untimed

  @property
  def running(self) -> bool:
    """Whether the next call is the check's (a run in progress, not paused)."""
    return self._run is not None and not self._paused

  @property
  def pending(self) -> bool:
    """Whether a tuned program was traced and waits for its call to start a check."""
    return self._pending is not None

  def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call while the check runs: the variant it asks for, timed."""
    return self._run.call(args, kwargs)

  def note_trace(self, selection: Any, key: ProgramKey, warm: bool, start: float) -> None:
    """After a trace with kernel selection: a tuned program with decisions
    (the tune phase's, or a warm observe program that is the same) waits for
    its call to start its check (`start`: the trace's start on the check's clock)."""
    select_key = key._replace(phase=SELECT)
    with self._lock:
      if (selection.decisions and (key.phase == SELECT or warm) and not key.vetoed
          and select_key not in self._checked and self._enabled):
        self._checked.add(select_key)
        self._pending = (select_key, selection, start)
        self._settle()

  def after_call(self, start: float | None, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
    """After the call that traced (and compiled) a tuned program: starts its
    check (`start`: the call's start, or None when `lower` or `trace` traced
    it, to count from the trace's start: tracing, compiling, running)."""
    with self._lock:
      pending, self._pending = self._pending, None
    if pending is not None:
      began = pending[2] if start is None else start
      with _anatomy.first_call_stage("check"):
        self._start(pending[:2], _verify.clock() - began, arg_key(args, kwargs))
    self._settle()

  def _start(self, pending: tuple[Any, ...], compile_s: float, args_key: Any) -> None:
    """Starts the whole-program check of a tuned program (when it can pay back)."""
    select_key, selection = pending
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
      verifier = _verify.Verifier(
          {k: v[0] for k, v in decisions.items()},
          calls_left=max(session.horizon // self.runs_per_call - 1, 0),
          compile_s=compile_s,
          compiled=(frozenset({frozenset(decisions)}) if self._table.has_untuned(select_key)
                    else frozenset()))
      self._run = ProgramCheck(self._table, verifier, select_key, selection, args_key,
                               name=self._name, done=self._done)
      return
    self._verification = summary
    logger.info("tunedjax.jit(%s): whole-program check: %s", self._name, summary["outcome"])

  def _done(self, summary: dict[str, Any]) -> None:
    self._run = None
    self._verification = summary
    self._settle()

  def _settle(self) -> None:
    self.busy = self._pending is not None or self._run is not None

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Inside the block, calls run the program in use, untimed, and the check waits."""
    before, self._paused = self._paused, True
    try:
      yield
    finally:
      self._paused = before

  def summary(self) -> dict[str, Any] | None:
    """What the check found (None: no check yet; ``"checking"`` while it runs)."""
    run = self._run
    if run is not None:
      return {**run.verifier.summary(), "outcome": "checking"}
    return None if self._verification is None else dict(self._verification)
