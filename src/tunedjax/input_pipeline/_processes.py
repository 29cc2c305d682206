"""Worker-process hygiene: absl flags, parent-death watchdog, exit-time close.

grain 0.2.18 starts its `mp_prefetch` workers with the ``spawn`` method from
a thread pool, and leaves three problems to its users, all handled here:

* The first worker start reads the absl flag
  ``--grain_enable_multiprocess_worker_profiling`` and fails with
  ``UnparsedFlagAccessError`` in any program that did not run
  ``absl.app.run`` (plain scripts, pytest, notebooks; grain#1355).
  `ensure_absl_flags_parsed` marks the flags parsed, as ``app.run`` would.
  (It and `worker_init` live in `_worker`, which a worker unpickles without
  importing `tunedjax`.)
* Workers outlive a parent killed with SIGKILL (nothing tells them). Each
  worker runs `worker_init`, which starts a watchdog thread that exits the
  worker as soon as its parent process is gone. ``prctl(PR_SET_PDEATHSIG)``
  is not used: it fires when the *thread* that forked the worker exits, and
  grain forks from pool threads that may exit before the loader does.
* Iterators still open at interpreter exit are closed by grain's ``__del__``
  after modules are torn down, which prints tracebacks. `register` keeps a
  weak set of open loaders that an ``atexit`` hook closes while the
  interpreter is still whole.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any, Protocol

from tunedjax.input_pipeline import _worker
from tunedjax.input_pipeline._settings import LoaderSettings


class _Closable(Protocol):

  def close(self) -> None:
    ...


_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.Lock()


def register(obj: _Closable) -> None:
  """Remembers `obj` (weakly) so that interpreter exit closes it cleanly."""
  with _LOCK:
    _OPEN.add(obj)


def unregister(obj: _Closable) -> None:
  """Forgets `obj` (after it was closed)."""
  with _LOCK:
    _OPEN.discard(obj)


@atexit.register
def _close_all() -> None:
  # Registered after multiprocessing's own exit hook, so it runs before it
  # (atexit is last-in first-out): workers are stopped while everything the
  # shutdown needs still exists.
  with _LOCK:
    open_now = list(_OPEN)
  for obj in open_now:
    try:
      obj.close()
    except Exception:  # pylint: disable=broad-except
      pass  # exiting anyway; a failed close must not print a traceback


def child_pids(pid: int | None = None) -> list[int]:
  """The pids of the live child processes of `pid` (default: this process).

  Reads ``/proc`` (Linux); returns [] where it does not exist. Zombies
  (exited, not yet reaped) are not counted.

  Example:
    >>> isinstance(child_pids(), list)
    True
  """
  pid = os.getpid() if pid is None else pid
  children = []
  try:
    entries = os.listdir("/proc")
  except OSError:
    return []
  for entry in entries:
    if not entry.isdigit():
      continue
    state_ppid = _state_and_ppid(int(entry))
    if state_ppid is not None and state_ppid[1] == pid and state_ppid[0] not in "ZX":
      children.append(int(entry))
  return sorted(children)


def _state_and_ppid(pid: int) -> tuple[str, int] | None:
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      stat = f.read()
  except OSError:
    return None
  fields = stat.rsplit(")", 1)[-1].split()
  return fields[0], int(fields[1])


def is_running(pid: int) -> bool:
  """Whether process `pid` exists and is not a zombie.

  Example:
    >>> is_running(os.getpid())
    True
  """
  state = _state_and_ppid(pid)
  if state is not None:
    return state[0] not in "ZX"
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return not os.path.isdir("/proc")


def grain_options(settings: LoaderSettings) -> tuple[Any, Any]:
  """grain's (ReadOptions, MultiprocessingOptions) for `settings`.

  The mapping of each knob is its row of the knob table (`_settings.KNOBS`).
  Read threads get a buffer twice as deep as the threads: grain's default
  buffer of 500 elements holds 500 *batches* here (batching happens before
  prefetching), memory for nothing, and a buffer that makes short timing
  windows read the buffer instead of the pipeline; twice the threads keeps
  every thread busy while the consumer takes a batch.

  Example:
    >>> read, mp = grain_options(LoaderSettings(worker_count=2, read_threads=1,
    ...                                         prefetch_buffer=4))
    >>> read.num_threads, read.prefetch_buffer_size, mp.num_workers, mp.per_worker_buffer_size
    (1, 2, 2, 4)
  """
  import grain  # pylint: disable=g-import-not-at-top
  kwargs = settings.grain_kwargs()
  return (grain.ReadOptions(**kwargs["ReadOptions"]),
          grain.MultiprocessingOptions(**kwargs["MultiprocessingOptions"]))


def buffered_batches(settings: LoaderSettings) -> int:
  """How many batches the prefetch buffers can hold before the first read.

  Example:
    >>> buffered_batches(LoaderSettings(worker_count=2, read_threads=4))
    20
  """
  read, mp = grain_options(settings)
  if mp.num_workers == 0:
    return read.prefetch_buffer_size
  return mp.num_workers * (mp.per_worker_buffer_size + read.prefetch_buffer_size)


def open_iterator(ds: Any, settings: LoaderSettings) -> Any:
  """Starts a grain iterator over the batched MapDataset `ds`.

  Args:
    ds: a `grain.MapDataset` of batches (its order fixes the data).
    settings: the worker processes, read threads and per-worker buffer
      (`grain_options`); 0 workers reads in this process.

  Returns:
    A grain `DatasetIterator` of batches (call `.close()` when done).
  """
  import functools  # pylint: disable=g-import-not-at-top
  read, mp = grain_options(settings)
  it_ds = ds.to_iter_dataset(read)
  if mp.num_workers > 0:
    _worker.ensure_absl_flags_parsed()
    it_ds = it_ds.mp_prefetch(mp, worker_init_fn=functools.partial(_worker.worker_init,
                                                                   os.getpid()))
  return iter(it_ds)


def close_quietly(iterator: Any) -> None:
  """Closes a grain iterator, stopping its workers; never raises."""
  if iterator is None:
    return
  try:
    iterator.close()
  except Exception:  # pylint: disable=broad-except
    pass
