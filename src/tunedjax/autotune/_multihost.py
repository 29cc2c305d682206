"""Multi-host agreement: process 0 chooses, every process compiles the same program.

In a `jax.distributed` job each process traces and compiles the program on
its own; if two processes picked different kernels for a convolution they
would compile different programs, and the collectives between them would
not match. So process 0 decides every bucket (cache lookup, tuning, cache
write) and broadcasts its choice with
`jax.experimental.multihost_utils.broadcast_one_to_all`; the other
processes use what they receive and never write the cache. Every process
traces the same program and so reaches the same buckets in the same order,
which is what makes one broadcast per bucket line up.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from tunedjax._errors import AutotuneError


def is_multiprocess() -> bool:
  """Whether this is one process of several (`jax.process_count() > 1`).

  Example:
    >>> is_multiprocess()
    False
  """
  return jax.process_count() > 1


def is_leader() -> bool:
  """Whether this process decides (and writes the cache): process 0."""
  return jax.process_index() == 0


def _broadcast_index(index: int) -> int:
  """Process 0's `index`, on every process.

  `broadcast_one_to_all` runs a jitted collective under `jax.set_mesh`, which
  refuses to run inside a trace; the rule calling this runs inside one (the
  caller's `jax.jit`). JAX keeps its trace state per thread, so the broadcast
  runs on a worker thread, where no trace is active, while this thread waits.
  """
  def run() -> int:
    return int(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(index))))

  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tunedjax-agree") as pool:
    return pool.submit(run).result()


def agree(decide: Callable[[], str], names: Sequence[str]) -> str:
  """Process 0's `decide()`, received by every process.

  With one process this is just `decide()`. Otherwise process 0 calls
  `decide()` and broadcasts the index of its answer in `names` (which must be
  the same list, in the same order, on every process); the others do not
  call `decide` at all. Safe to call while a function is being traced.

  Args:
    decide: returns a kernel name; called on process 0 only.
    names: every name `decide` may return, identical on all processes.

  Returns:
    The name process 0 chose.

  Example:
    >>> agree(lambda: "fft", ["xla", "fft"])
    'fft'
  """
  if not is_multiprocess():
    return decide()
  names = list(names)
  index = -1
  if is_leader():
    choice = decide()
    if choice not in names:
      raise AutotuneError(f"multihost agreement: process 0 chose {choice!r}, which "
                          f"is not among {names}.")
    index = names.index(choice)
  got = _broadcast_index(index)
  if not 0 <= got < len(names):
    raise AutotuneError(f"multihost agreement: received kernel index {got} for "
                        f"{len(names)} names {names}; are all processes running "
                        "the same tunedjax with the same registered kernels?")
  return names[got]
