"""Tuning work started ahead: the default kernels of the buckets a trace will tune.

`tunedjax.jit` decides a program's kernel sites one by one while its kernel
pass evaluates the jaxpr, and a site whose bucket misses the cache is tuned on
the spot. That tuning begins with work no earlier decision changes: drawing
the bucket's random operands and compiling the family's default kernel
(`_tuner.prepared_default`). The sites of a jaxpr are known before its first
equation is evaluated, so the pass announces them (`Prefetcher.expect`) and a
`Prefetcher` does that work on a spare core, in the order the pass will meet
them, while the main thread evaluates equations, checks, stores and compiles
the candidates of the bucket before. When the pass reaches a site it takes the
finished work (`take`), waits for work in progress, and does work not yet
started itself.

Timings are never shared with a compile: the tuner times candidates inside
`Prefetcher.timing()`, which waits for the work in progress to finish and
holds back the next until the timing ends. So the work ahead changes when
things are computed, not what is measured or decided.

One `Prefetcher` per trace (the `Selection` owns it; `close` ends it with the
trace): no state outlives the program it was started for.

Example:
  >>> import threading
  >>> p, started = Prefetcher(), threading.Event()
  >>> p.expect("bucket a", lambda: started.set() or "compiled", order=(0, 3))
  >>> started.wait(10) and p.take("bucket a")  # begun, so waited for
  'compiled'
  >>> p.take("bucket b") is None  # never expected: the caller does the work
  True
  >>> p.close()
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

logger = logging.getLogger("tunedjax.autotune")

PENDING, RUNNING, DONE = "pending", "running", "done"
# Finished jobs not yet taken, at most: each holds a bucket's operands, so the
# work stays this far ahead of the pass (and its memory bounded).
AHEAD = 2


@dataclasses.dataclass
class _Job:
  order: tuple[int, ...]
  make: Callable[[], Any]
  state: str = PENDING
  result: Any = None


class Prefetcher:
  """Work for upcoming buckets, done one job at a time on a thread of its own.

  Jobs run in the order given (`expect`'s ``order``: the order the pass will
  reach the sites), never while the main thread times (`timing`), at most
  `AHEAD` finished ones waiting to be taken, and a job's exception only
  means the main thread does that work itself.
  """

  def __init__(self) -> None:
    self._cond = threading.Condition()
    self._jobs: dict[Hashable, _Job] = {}
    self._timing = 0
    self._running = False
    self._closed = False
    self._thread: threading.Thread | None = None
    self.done = 0  # jobs finished (taken or not): for reports and tests

  def expect(self, key: Hashable, make: Callable[[], Any], *, order: tuple[int, ...]) -> None:
    """Queues `make` (run in the caller's context) for the bucket `key`, once."""
    with self._cond:
      if self._closed or key in self._jobs:
        return
      self._jobs[key] = _Job(tuple(order), _in_context(make))
      if self._thread is None:
        self._thread = threading.Thread(target=self._work, name="tunedjax-prefetch",
                                        daemon=True)
        self._thread.start()
      self._cond.notify_all()

  def take(self, key: Hashable) -> Any:
    """The finished work for `key` (waiting for it if it runs now), or None:
    never expected, not started yet (then it never will be), or failed.
    Work expected for earlier sites and not taken is dropped."""
    with self._cond:
      job = self._jobs.pop(key, None)
      if job is None:
        return None
      # The pass has gone past the sites before this one: their work is dropped
      # (one decided otherwise never takes it), and the worker may go on.
      self._jobs = {k: j for k, j in self._jobs.items()
                    if j.state == RUNNING or j.order > job.order}
      self._cond.notify_all()
      if job.state == PENDING:
        return None
      while job.state == RUNNING:
        self._cond.wait()
      return job.result

  @contextlib.contextmanager
  def timing(self) -> Iterator[None]:
    """A block during which no job runs: waits for the one in progress."""
    with self._cond:
      self._timing += 1
      while self._running:
        self._cond.wait()
    try:
      yield
    finally:
      with self._cond:
        self._timing -= 1
        self._cond.notify_all()

  def close(self) -> None:
    """Drops the jobs not started and waits for the one in progress."""
    with self._cond:
      self._closed = True
      self._jobs = {k: j for k, j in self._jobs.items() if j.state != PENDING}
      self._cond.notify_all()
      thread = self._thread
    if thread is not None and thread is not threading.current_thread():
      thread.join()

  def _next(self) -> _Job | None:
    """The next job to run, once the main thread is not timing; None once closed."""
    with self._cond:
      while True:
        if self._closed:
          return None
        pending = [j for j in self._jobs.values() if j.state == PENDING]
        ready = sum(j.state == DONE for j in self._jobs.values())
        if pending and not self._timing and ready < AHEAD:
          job = min(pending, key=lambda j: j.order)
          job.state, self._running = RUNNING, True
          self._cond.notify_all()
          return job
        self._cond.wait()

  def _work(self) -> None:
    while (job := self._next()) is not None:
      try:
        result = job.make()
      except Exception as e:  # pylint: disable=broad-except  # the main thread does it again
        logger.debug("autotune: work ahead failed (%s: %s); done when the site is reached.",
                     type(e).__name__, e)
        result = None
      with self._cond:
        job.result, job.state, self._running = result, DONE, False
        self.done += 1
        self._cond.notify_all()


def _in_context(make: Callable[[], Any]) -> Callable[[], Any]:
  """`make`, run in a copy of the caller's context (its config, its session)."""
  context = contextvars.copy_context()
  return lambda: context.run(make)
