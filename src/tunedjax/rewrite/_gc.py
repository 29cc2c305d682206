"""Python's cyclic garbage collector paused while `tunedjax.jit` traces and rewrites.

Tracing a program and evaluating its jaxpr through the passes allocates about
three times the objects `jax.jit`'s own trace does (tracers, equations, the
passes' values). The collector runs a young collection per 700 net
allocations and, every tenth of those, a middle one; a full collection, which
walks every object JAX and the model keep alive, becomes due after ten middle
ones. On a ResNet-18 train step in a process that had imported jax and flax,
a full collection took 0.16-0.20 s against `jax.jit`'s whole trace of
0.10-0.14 s (process CPU), and the passes' trace ran 68-74 young and 6-7
middle collections (a full one in 5-6 of 8 traces), against 4-5 young ones,
at most one middle one and no full one with the collector paused; the trace
took 0.24 s instead of 0.36-0.40 s. Nothing is lost by waiting: the trace's
garbage is collected as usual once the block ends (a full collection fell in
the lowering that follows once in 16 calls, as often as without the pause).

The pause is bounded in time (`LIMIT_S`): a trace that runs longer (a cold
tuning cache: kernel buckets tuned, layouts measured, each compiling and
running programs) gets the collector back after that, so what such work
leaves is not held for its whole length.

The collector's switch is process-wide: blocks in several threads nest, the
collector is back on when the last block ends (or at the time limit), and it
is never turned on by this module if it was off when the first block began
(a user's `gc.disable()` stays in force).

Example:
  >>> import gc
  >>> from tunedjax.rewrite import _gc
  >>> with _gc.paused():
  ...   inside = gc.isenabled()
  >>> inside, gc.isenabled()
  (False, True)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

LIMIT_S = 1.0  # longest pause: a warm ResNet-18 trace with the passes takes 0.2-0.5 s

_lock = threading.Lock()
_depth = 0  # `paused` blocks open, all threads
_owner = False  # whether the first block found the collector on (and turned it off)
_timer: threading.Timer | None = None
_pause = 0  # counts outermost blocks, so that a late timer leaves a newer pause alone


def _expire(pause: int) -> None:
  """The time limit: the collector back on while blocks are still open."""
  global _owner
  with _lock:
    if pause != _pause or not _owner:
      return
    if not gc.isenabled():
      gc.enable()
    _owner = False


@contextlib.contextmanager
def paused(limit_s: float | None = None) -> Iterator[None]:
  """The collector is off inside the block, for at most `limit_s` seconds.

  Args:
    limit_s: seconds after which the collector is turned back on (counted
      from the outermost open block); default `LIMIT_S`.
  """
  global _depth, _owner, _timer, _pause
  with _lock:
    _depth += 1
    if _depth == 1 and gc.isenabled():
      gc.disable()
      _owner = True
      _pause += 1
      _timer = threading.Timer(LIMIT_S if limit_s is None else limit_s, _expire, (_pause,))
      _timer.daemon = True
      _timer.start()
  try:
    yield
  finally:
    with _lock:
      _depth -= 1
      if _depth == 0:
        if _timer is not None:
          _timer.cancel()
          _timer = None
        if _owner and not gc.isenabled():
          gc.enable()
        _owner = False
