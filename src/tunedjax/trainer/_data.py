"""The Trainer's data: a `Loader`, any iterable of batches, or arrays.

`BatchStream` gives them one interface: batches with the epoch they belong
to, and a position that a checkpoint records and a resumed run restores.
`BatchChecker` holds every batch to the first one's structure and shapes, and
`Placement` puts batches on the devices, sharded over the mesh's data axis.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from tunedjax._errors import TunedJaxError, format_choices
from tunedjax.input_pipeline import Loader
from tunedjax.trainer._model import TrainerError

logger = logging.getLogger("tunedjax.trainer")

ARRAY_TYPES = (np.ndarray, jax.Array)


def _leading(x: Any) -> int | None:
  return int(x.shape[0]) if isinstance(x, ARRAY_TYPES) and x.ndim >= 1 else None


def is_arrays(data: Any) -> bool:
  """Whether `data` is in-memory records: an array, or a dict/tuple of arrays
  with the same leading (record) dimension. A list is an iterable of batches.

  Example:
    >>> is_arrays((np.zeros((4, 2)), np.zeros(4))), is_arrays([np.zeros(2)])
    (True, False)
  """
  if isinstance(data, ARRAY_TYPES):
    return _leading(data) is not None
  if isinstance(data, Mapping):
    leaves = list(data.values())
  elif isinstance(data, tuple):
    leaves = list(data)
  else:
    return False
  sizes = {_leading(x) for x in leaves}
  return bool(leaves) and None not in sizes and len(sizes) == 1


def _record_lengths(data: Any) -> dict[str, int] | None:
  """``{name: rows}`` when `data` is a dict/tuple of arrays whose numbers of
  rows differ (records that do not line up), else None."""
  if isinstance(data, Mapping):
    items = [(repr(k), v) for k, v in data.items()]
  elif isinstance(data, tuple):
    items = [(f"[{i}]", v) for i, v in enumerate(data)]
  else:
    return None
  lengths = {name: _leading(x) for name, x in items}
  if not items or None in lengths.values() or len(set(lengths.values())) < 2:
    return None
  return lengths


def _mismatch(what: str, lengths: Mapping[str, int]) -> TrainerError:
  shown = ", ".join(f"{name}: {n}" for name, n in lengths.items())
  return TrainerError(
      f"{what} holds arrays with different numbers of rows ({shown}); every array "
      "must hold one row per record, so their first dimensions must be equal.")


def _short(value: Any) -> str:
  shown = repr(value)
  shown = shown if len(shown) <= 80 else shown[:77] + "..."
  return f"{shown} (type {type(value).__name__})"


def predict_batches(x_or_data: Any, batch_size: int | None) -> Iterator[Any]:
  """The batches `Trainer.predict` runs: `x_or_data`'s records split into
  batches of `batch_size` (all at once when None), or its batches checked one
  by one as they come.

  Raises:
    TrainerError: `x_or_data` is neither records nor an iterable of batches,
      holds no records, or a batch has a leaf that is not an array with a
      batch dimension.

  Example:
    >>> [b.shape for b in predict_batches(np.zeros((5, 2)), 2)]
    [(2, 2), (2, 2), (1, 2)]
  """
  what = "predict(x_or_data=...)"
  accepted = ("an array or a dict/tuple of arrays with one row per record, or an "
              "iterable of batches (a list, a generator)")
  if is_arrays(x_or_data):
    size = int(jax.tree_util.tree_leaves(x_or_data)[0].shape[0])
    if size == 0:
      raise TrainerError(f"{what} holds no records (0 rows): nothing to predict.")
    step = size if batch_size is None else batch_size
    return iter([jax.tree_util.tree_map(lambda a, i=i: a[i:i + step], x_or_data)
                 for i in range(0, size, step)])
  if isinstance(x_or_data, ARRAY_TYPES + (np.generic,)):
    raise TrainerError(f"{what} is a scalar ({describe(x_or_data)}), not records: pass "
                       f"{accepted}.")
  if (lengths := _record_lengths(x_or_data)) is not None:
    raise _mismatch(what, lengths)
  if (isinstance(x_or_data, (str, bytes, Mapping)) or not isinstance(x_or_data, Iterable)):
    raise TrainerError(f"{what} must be {accepted}; got {_short(x_or_data)}.")
  return _checked_batches(x_or_data, what)


def _checked_batches(batches: Iterable[Any], what: str) -> Iterator[Any]:
  for index, batch in enumerate(batches):
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves or any(not isinstance(x, ARRAY_TYPES) or x.ndim == 0 for x in leaves):
      raise TrainerError(
          f"Batch {index} of {what} is not arrays with a batch dimension: got "
          f"{_short(batch)}. An iterable x_or_data must yield batches (arrays, or "
          "dicts/tuples of arrays, one row per record); pass records as one array "
          "(or a dict/tuple of arrays) with batch_size= to have them split.")
    yield batch


class BatchStream:
  """Batches with their epoch, and a checkpointable position.

  Args:
    data: a `tunedjax.input_pipeline.Loader`; arrays (see `is_arrays`),
      batched here by a `Loader` with `batch_size`, shuffled with `seed`; or
      any iterable of batches (a list, a generator, a torch-style loader).
    batch_size: records per batch, for arrays.
    seed: the shuffle seed, for arrays.
    shuffle: shuffle arrays (a new order each epoch).
    drop_remainder: drop a last short batch of arrays (False for evaluation).
    what: the argument's name, for error messages.
  """

  def __init__(self, data: Any, *, batch_size: int | None, seed: int, shuffle: bool = True,
               drop_remainder: bool = True, what: str = "train_data"):
    self.what = what
    self._owned = False
    self._iterable: Iterable[Any] | None = None
    self._iterator: Iterator[Any] | None = None
    self._epoch, self._index = 0, 0
    self._skip = 0
    if isinstance(data, Loader):
      self.loader: Loader | None = data
    elif is_arrays(data):
      if batch_size is None:
        raise TrainerError(f"{what} is arrays: pass batch_size= to say how many records "
                           "make a batch.")
      # Records in memory: nothing to decode, so nothing for workers to do.
      try:
        self.loader = Loader(data, batch_size=batch_size, shuffle=shuffle, seed=seed,
                             drop_remainder=drop_remainder, worker_count=0, read_threads=0,
                             tuning_budget_s=0)
      except TunedJaxError as e:  # say which argument: train_data, eval data, ...
        raise TrainerError(f"{what} (with batch_size={batch_size!r}): {e}") from None
      self._owned = True
    elif isinstance(data, ARRAY_TYPES + (np.generic,)) and np.ndim(data) == 0:
      raise TrainerError(f"{what} is a scalar ({describe(data)}), not records: pass an "
                         "array with one row per record, a dict/tuple of them, a Loader "
                         "or an iterable of batches.")
    elif (lengths := _record_lengths(data)) is not None:
      raise _mismatch(what, lengths)
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes, Mapping)):
      self.loader, self._iterable = None, data
    else:
      raise TrainerError(
          f"{what} must be a tunedjax.input_pipeline.Loader, arrays (an array, or a "
          f"dict/tuple of arrays with one row per record, with batch_size=) or an "
          f"iterable of batches; got {type(data).__name__}.")

  @property
  def steps_per_epoch(self) -> int | None:
    """Batches in one epoch, when known."""
    if self.loader is not None:
      return self.loader.batches_per_epoch
    try:
      return len(self._iterable)  # type: ignore[arg-type]
    except TypeError:
      return None

  @property
  def epoch(self) -> int:
    """The epoch of the next batch (0-based); for an iterable without a
    length, known only once it has run out."""
    if self.loader is not None:
      return self.loader.epoch
    n = self.steps_per_epoch
    return self._epoch + 1 if n is not None and self._index >= n else self._epoch

  def next(self) -> tuple[int, Any]:
    """``(epoch, batch)``; StopIteration when the data has ended."""
    if self.loader is not None:
      epoch = self.loader.epoch
      return epoch, next(self.loader)
    n = self.steps_per_epoch
    if n is not None and self._index >= n:  # a new epoch: read the iterable again
      self._epoch, self._index, self._iterator = self._epoch + 1, 0, None
    if self._iterator is None:
      self._iterator = iter(self._iterable)  # type: ignore[arg-type]
      for _ in range(self._skip):
        next(self._iterator)
      self._skip = 0
    try:
      batch = next(self._iterator)
    except StopIteration:
      if self._index == 0 or self._iterator is self._iterable:
        raise  # empty, or a one-shot iterator that has run out
      self._epoch, self._index, self._iterator = self._epoch + 1, 0, None
      return self.next()
    self._index += 1
    return self._epoch, batch

  def get_state(self) -> dict[str, Any]:
    """The position, JSON-able."""
    if self.loader is not None:
      return {"kind": "loader", "loader": self.loader.get_state()}
    return {"kind": "iterable", "epoch": self._epoch, "index": self._index}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Continues after the position `state` records."""
    kind = state.get("kind")
    if (kind == "loader") != (self.loader is not None):
      raise TrainerError(f"The checkpoint's data position is for {kind!r} data, but "
                         f"{self.what} is {'a Loader' if self.loader else 'an iterable'}.")
    if self.loader is not None:
      self.loader.set_state(state["loader"])
      return
    if iter(self._iterable) is self._iterable:  # type: ignore[arg-type]
      warnings.warn(f"{self.what} is a one-shot iterator: training resumes from its "
                    "current position, which need not be where the checkpoint stopped. "
                    "Pass a re-iterable (a list, a Loader) to resume exactly.", stacklevel=3)
      return
    self._epoch, self._index = int(state["epoch"]), int(state["index"])
    self._skip, self._iterator = self._index, None

  def close(self) -> None:
    """Stops the loader's workers if this stream made the loader."""
    if self._owned and self.loader is not None:
      self.loader.close()


def describe(tree: Any) -> str:
  """A batch's structure with shapes and dtypes, for error messages."""
  return str(jax.tree_util.tree_map(
      lambda x: f"{np.dtype(getattr(x, 'dtype', type(x)))}{list(np.shape(x))}", tree))


_PASSED_KEPT = 64  # distinct batch signatures remembered by a BatchChecker


class BatchChecker:
  """Checks that each batch has the first batch's structure and shapes.

  A different structure or a different shape beyond the batch dimension is a
  `TrainerError` that shows both; a different batch size (a short last
  batch) is allowed but recompiles the step, and is logged once.
  """

  def __init__(self, what: str):
    self.what = what
    self._first: tuple[Any, list[tuple[tuple[int, ...], Any]]] | None = None
    self._told_size = False
    # (structure, shapes and dtypes) of the batches that passed: a batch like
    # one of them is not checked again, so a run pays one comparison per batch.
    self._passed: set[tuple[Any, tuple[tuple[Any, Any], ...]]] = set()

  def check(self, batch: Any, index: int) -> None:
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    try:
      key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
      if key in self._passed:
        return
    except (AttributeError, TypeError):  # not arrays: the full check says which leaf
      key = None
    self._check(batch, index, leaves, treedef)
    if key is not None and len(self._passed) < _PASSED_KEPT:
      self._passed.add(key)

  def _check(self, batch: Any, index: int, leaves: list[Any], treedef: Any) -> None:
    bad = [x for x in leaves if not hasattr(x, "shape") or np.ndim(x) == 0]
    if bad or not leaves:
      raise TrainerError(f"Batch {index} of {self.what} has leaves that are not arrays "
                         f"with a batch dimension: {describe(batch)}.")
    types = [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves]
    if self._first is None:
      self._first = (treedef, types)
      return
    first_def, first_types = self._first
    same_rest = treedef == first_def and all(
        a[0][1:] == b[0][1:] and a[1] == b[1] for a, b in zip(types, first_types))
    if not same_rest:
      raise TrainerError(
          f"Batch {index} of {self.what} does not match the first batch.\n"
          f"  first batch: {jax.tree_util.tree_unflatten(first_def, [f'{d}{list(s)}' for s, d in first_types])}\n"
          f"  batch {index}: {describe(batch)}\n"
          "Every batch must have the same structure, dtypes and shapes (the batch "
          "dimension may differ).")
    if types[0][0][:1] != first_types[0][0][:1] and not self._told_size:
      self._told_size = True
      logger.info("%s: batch %d has %d records, the first had %d: the step is compiled "
                  "again for it.", self.what, index, types[0][0][0], first_types[0][0][0])


class Placement:
  """Puts batches on the mesh: the batch dimension sharded over `axis`.

  Parameters and optimizer state are replicated. With several processes
  (`jax.distributed`), each process passes its own part of the global batch.

  Args:
    mesh: the mesh; None for a one-axis mesh ``("data",)`` over every device.
      Its axes are used as ``AxisType.Auto`` (XLA places the computation).
    axis: the mesh axis the batch is split over (default: ``"data"`` if the
      mesh has one, else its first axis).
  """

  def __init__(self, mesh: Mesh | None, axis: str | None = None):
    if mesh is None:
      mesh = Mesh(np.array(jax.devices()), ("data",))
    if not isinstance(mesh, Mesh):
      raise TrainerError(f"mesh must be a jax.sharding.Mesh or None, got {mesh!r}.")
    # The step is written for one device and sharded by XLA (GSPMD): the mesh's
    # axes must be Auto, not Explicit (jax.make_mesh's default), or user code
    # such as a dropout mask fails JAX's sharding-in-types checks.
    mesh = Mesh(mesh.devices, mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    names = tuple(mesh.axis_names)
    if axis is not None and not isinstance(axis, str):
      raise TrainerError(f"data_axis must be None or the name of a mesh axis "
                         f"({format_choices(names)}), got {axis!r}.")
    if axis is None:
      axis = "data" if "data" in names else names[0]
    if axis not in names:
      raise TrainerError(f"data_axis={axis!r} is not an axis of the mesh; its axes are "
                         f"{names}.")
    self.mesh, self.axis = mesh, axis
    self.shards = int(mesh.shape[axis])
    # One process, one device: host batches go to the jitted step as they are,
    # and jit's own (C++) transfer puts them on that device; a `device_put`
    # first costs ~5x the host time per batch (see `put`).
    self._pass_host = jax.process_count() == 1 and mesh.devices.size == 1
    self.replicated = NamedSharding(mesh, PartitionSpec())
    self.batch = NamedSharding(mesh, PartitionSpec(axis))
    self.stacked = NamedSharding(mesh, PartitionSpec(None, axis))

  def check_batch_size(self, size: int, what: str) -> None:
    local = self.shards // jax.process_count() if jax.process_count() > 1 else self.shards
    if size % max(local, 1):
      raise TrainerError(
          f"{what}: a batch of {size} records cannot be split evenly over the {self.shards} "
          f"devices of the mesh's {self.axis!r} axis; use a batch_size divisible by "
          f"{local}, or pass mesh= with fewer devices.")

  def put(self, tree: Any, *, stacked: bool = False) -> Any:
    """`tree`'s arrays on the devices, sharded along the batch dimension.

    On a one-device mesh in one process, a batch of NumPy arrays is returned
    as it is: the jitted step it is passed to moves it to the device itself,
    as part of its dispatch, for a fifth of the host time of a `device_put`
    (the step's other arguments are on the mesh's device, so that is where
    jit puts it).
    """
    if self._pass_host and all(isinstance(x, np.ndarray)
                               for x in jax.tree_util.tree_leaves(tree)):
      return tree
    sharding = self.stacked if stacked else self.batch
    if jax.process_count() == 1:
      return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)

  def replicate(self, tree: Any) -> Any:
    """`tree` replicated on every device of the mesh (every process passes the
    same values, as each initialises the model from the same seed)."""
    if jax.process_count() == 1:
      # Copies: the train step donates its state, and device_put alone can hand
      # it the caller's own buffers to delete (one device, or the first shard
      # of a replicated array), even with may_alias=False.
      return jax.device_put(jax.tree_util.tree_map(_copy, tree), self.replicated)
    return jax.tree_util.tree_map(self._replicate_global, tree)

  def _replicate_global(self, x: Any) -> Any:
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
      impl = jax.random.key_impl(x)
      return jax.random.wrap_key_data(self._replicate_global(jax.random.key_data(x)),
                                      impl=impl)
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, self.replicated, lambda index: host[index])


def _copy(x: Any) -> Any:
  """A jax.Array in fresh buffers; anything else as it is."""
  return x.copy() if isinstance(x, jax.Array) else x
