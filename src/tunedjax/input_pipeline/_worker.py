"""What a worker process runs: the pipeline's record functions and its start hook.

grain sends the pipeline to each worker process with cloudpickle, and the
worker imports every module a pickled object refers to before it reads a
record. A reference to a `tunedjax` module would import the package, and
with it jax, Flax, optax and orbax: seconds per worker, paid at every worker
start (measured: 3.4 s of imports against 0.9 s for grain itself). So the
objects a worker needs live here, in a module that imports only the standard
library and NumPy, and this module is pickled *by value*
(``cloudpickle.register_pickle_by_value``): a worker rebuilds these classes
from the pickle without importing `tunedjax` at all. What a worker still
imports is grain (which imports jax itself in grain 0.2.x), NumPy, and what
the user's own transforms and main module need.

Only an error path imports `tunedjax` here (`_errors.TransformError`), lazily;
`_dataset` imports this module, never the other way.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import cloudpickle
import numpy as np

WATCHDOG_INTERVAL_S = 0.1


def map_tree(fn, tree: Any) -> Any:
  """`fn` on each leaf of nested dicts, named tuples, tuples and lists.

  Example:
    >>> map_tree(lambda a: a * 2, {"x": (1, [2])})
    {'x': (2, [4])}
  """
  if isinstance(tree, Mapping):
    return {k: map_tree(fn, v) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(map_tree(fn, v) for v in tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(map_tree(fn, v) for v in tree)
  return fn(tree)


def leaves(tree: Any) -> list[Any]:
  """The leaves of nested dicts, tuples and lists, in order.

  Example:
    >>> leaves({"x": 1, "y": (2, 3)})
    [1, 2, 3]
  """
  if isinstance(tree, Mapping):
    return [leaf for v in tree.values() for leaf in leaves(v)]
  if isinstance(tree, (tuple, list)):
    return [leaf for v in tree for leaf in leaves(v)]
  return [tree]


class ArraySource:
  """Random access to the rows of an array, or of a dict/tuple of arrays.

  `tunedjax.input_pipeline._dataset.as_source` checks the arrays and makes one.

  Example:
    >>> src = ArraySource({"x": np.zeros((5, 2)), "y": np.arange(5)})
    >>> len(src), int(src[3]["y"])
    (5, 3)
  """

  __slots__ = ("arrays",)

  def __init__(self, arrays: Any):
    self.arrays = arrays

  def __len__(self) -> int:
    return len(leaves(self.arrays)[0])

  def __getitem__(self, index: int) -> Any:
    return map_tree(lambda a: a[index], self.arrays)

  def __getstate__(self) -> Any:
    return self.arrays

  def __setstate__(self, arrays: Any) -> None:
    self.arrays = arrays

  def __repr__(self) -> str:
    return f"ArraySource({len(self)} records)"


def stack(records: Sequence[Any]) -> Any:
  """Stacks records (arrays, scalars, dicts, tuples, lists) into one batch.

  Example:
    >>> stack([{"x": np.ones(2)}, {"x": np.zeros(2)}])["x"].shape
    (2, 2)
  """
  first = records[0]
  if isinstance(first, Mapping):
    return {k: stack([r[k] for r in records]) for k in first}
  if isinstance(first, tuple) and hasattr(first, "_fields"):
    return type(first)(*(stack([r[i] for r in records]) for i in range(len(first))))
  if isinstance(first, (tuple, list)):
    return type(first)(stack([r[i] for r in records]) for i in range(len(first)))
  return np.stack([np.asarray(r) for r in records])


def _fail(position: int, transform: Any, index: int, error: Exception) -> Exception:
  # The error path alone imports tunedjax (in a worker: once, as it fails).
  from tunedjax.input_pipeline import _errors  # pylint: disable=g-import-not-at-top
  tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
  return _errors.transform_error(position, transform, index, error, tb)


class Read:
  """Reads record `index` of the source; the index travels with the record."""

  __slots__ = ("source",)

  def __init__(self, source: Any):
    self.source = source

  def __call__(self, index: Any) -> tuple[int, Any]:
    index = int(index)
    return index, self.source[index]

  def __getstate__(self) -> Any:
    return self.source

  def __setstate__(self, source: Any) -> None:
    self.source = source


class Apply:
  """Applies transform number `position` (a grain `Map` or a callable)."""

  __slots__ = ("position", "transform")

  def __init__(self, transform: Any, position: int):
    self.transform = transform
    self.position = position

  def __call__(self, item: tuple[int, Any]) -> tuple[int, Any]:
    index, record = item
    fn = getattr(self.transform, "map", self.transform)
    try:
      return index, fn(record)
    except Exception as e:  # pylint: disable=broad-except
      raise _fail(self.position, self.transform, index, e) from e

  def __getstate__(self) -> Any:
    return (self.transform, self.position)

  def __setstate__(self, state: Any) -> None:
    self.transform, self.position = state


class ApplyRandom(Apply):
  """Applies a grain `RandomMap` with grain's per-record generator."""

  __slots__ = ()

  def __call__(self, item: tuple[int, Any], rng: np.random.Generator) -> tuple[int, Any]:
    index, record = item
    try:
      return index, self.transform.random_map(record, rng)
    except Exception as e:  # pylint: disable=broad-except
      raise _fail(self.position, self.transform, index, e) from e


def stack_records(items: Sequence[tuple[int, Any]]) -> Any:
  """The batch of `(index, record)` items: the records stacked."""
  return stack([record for _, record in items])


def ensure_absl_flags_parsed() -> None:
  """Marks absl flags parsed, so that grain can read its flags' defaults.

  A program that later calls ``absl.app.run`` still parses its command line
  as usual: absl re-parses on that call.

  Example:
    >>> ensure_absl_flags_parsed()
    >>> from absl import flags
    >>> flags.FLAGS.is_parsed()
    True
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _watch_parent(parent_pid: int) -> None:
  event = threading.Event()
  while not event.wait(WATCHDOG_INTERVAL_S):
    if os.getppid() != parent_pid:
      os._exit(0)  # the parent is gone; nobody will read what this worker makes


def worker_init(parent_pid: int, worker_index: int = 0, worker_count: int = 1) -> None:
  """Runs in each worker process first: exits the worker when its parent dies.

  Args:
    parent_pid: the pid of the process that owns the loader.
    worker_index: this worker's index (grain passes it; unused).
    worker_count: the number of workers (grain passes it; unused).
  """
  del worker_index, worker_count
  if os.getppid() != parent_pid:  # orphaned before it even started
    os._exit(0)
  ensure_absl_flags_parsed()
  threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                   name="tunedjax-parent-watchdog").start()


cloudpickle.register_pickle_by_value(sys.modules[__name__])
