"""Checkpoints of the training state: orbax steps, atomic, async and pruned.

`Checkpointer` is a thin layer over `orbax.checkpoint.CheckpointManager`. One
step is one folder ``<directory>/<step>`` that holds three orbax items:

* ``state``: the pytree of arrays (`ocp.args.StandardSave`): jax arrays
  (sharded ones too, each process writing its shards), numpy arrays and
  scalars, optax states, flax ``nnx.State``, None leaves.
* ``metadata``: the caller's JSON object (`ocp.args.JsonSave`): loader
  position, tuned settings, history, config.
* ``tunedjax``: this module's own JSON record (format, version, and where the
  typed PRNG keys were).

What orbax does, and this module relies on rather than re-implements:

* **Crash safety.** A step is written into ``<step>.orbax-checkpoint-tmp`` and
  renamed when complete; a process killed mid-write leaves only that temporary
  folder, which `latest_step` never reports and the next save of that step
  replaces.
* **Async saves.** `save` returns once the arrays are copied off the devices;
  the files are written in a background thread. `wait` blocks until they are,
  a new `save` first waits for the one in flight, and `restore` waits too.
* **Pruning.** Only the newest `max_to_keep` steps are kept, and with
  `best_metric` also the `keep_best` best by that metric (orbax's `best_fn`
  and `best_mode` options, with a `LatestN` and a `BestN` preservation policy;
  orbax stores each step's metrics in the step's folder, so a new Checkpointer
  on the folder knows them).
* **Many processes.** Under `jax.distributed` every process must call `save`
  and `restore` (with the same step); orbax coordinates the writers.

What this module adds: typed PRNG keys (``jax.random.key``) are stored as
their raw ``jax.random.key_data`` with the impl's name on the side (the orbax
0.11 releases that tunedjax allows cannot restore them into a target), so they
come back as typed keys of the same impl, with or without a target;
states are checked before orbax sees them (an unsavable leaf is a `TypeError`
naming its path, not a half-started save); errors name the directory and list
the steps there.

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> with Checkpointer(tempfile.mkdtemp(), max_to_keep=2) as ckpt:
  ...   for step in (1, 2, 3):
  ...     _ = ckpt.save(step, {"w": np.full(3, step, np.float32)}, {"epoch": step})
  ...   state, metadata = ckpt.restore()
  ...   ckpt.all_steps()
  [2, 3]
  >>> state["w"], metadata
  (array([3., 3., 3.], dtype=float32), {'epoch': 3})
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from tunedjax._errors import format_choices

FORMAT = "tunedjax-checkpoint"
FORMAT_VERSION = 1

_STATE = "state"
_METADATA = "metadata"
_INFO = "tunedjax"
_ITEMS = (_STATE, _METADATA, _INFO)

# What orbax's StandardSave stores; anything else with `__array__` becomes a
# numpy array first, as orbax itself does.
_ARRAY_TYPES = (int, float, np.ndarray, jax.Array)
BEST_MODES = ("min", "max")


def _is_key(x: Any) -> bool:
  """Whether `x` is a typed PRNG key array (or the abstract shape of one)."""
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _check_leaf(path: tuple[Any, ...], leaf: Any) -> Any:
  """`leaf` as orbax will store it, or a TypeError naming its path."""
  if not isinstance(leaf, (np.ndarray, jax.Array)) and hasattr(leaf, "__array__"):
    leaf = np.asarray(leaf)  # NumPy scalars, np.bool_ included
  if isinstance(leaf, _ARRAY_TYPES) and not (
      isinstance(leaf, np.ndarray) and leaf.dtype == object):
    return leaf
  shown = repr(leaf)
  shown = shown if len(shown) <= 80 else shown[:77] + "..."
  raise TypeError(
      f"Checkpointer.save: the state leaf at {jax.tree_util.keystr(path)!r} is "
      f"{shown} (type {type(leaf).__name__}), which orbax cannot store. State "
      "leaves must be jax or numpy arrays (typed PRNG keys included) or Python/"
      "NumPy scalars; pass JSON-able values as `metadata` instead, or register "
      "the class as a pytree node.")


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
  if metadata is None:
    return {}
  if not isinstance(metadata, Mapping):
    raise TypeError("Checkpointer.save: metadata must be a dict of JSON values, "
                    f"got {type(metadata).__name__}.")
  metadata = dict(metadata)
  try:
    json.dumps(metadata)
  except (TypeError, ValueError) as err:
    raise TypeError(
        f"Checkpointer.save: metadata must be JSON-serializable ({err}). Use "
        "dicts, lists, str, int, float, bool and None; convert NumPy values "
        "with `.item()` or `.tolist()`.") from err
  return metadata


class Checkpointer:
  """Saves and restores the training state in `directory`, one folder a step.

  Args:
    directory: the checkpoint folder; created if missing. Must not be a file.
    max_to_keep: how many of the newest steps to keep (older ones are
      deleted after each save); None keeps all of them.
    save_interval_steps: `save` writes only steps that are a multiple of this
      (default 1: every step it is asked to); `force=True` overrides it.
    best_metric: also keep the `keep_best` steps that are best by this entry
      of the `metrics` given to `save` (steps saved without it are kept by
      `max_to_keep` only); `max_to_keep` may then be 0 (keep only the best).
      `latest_step` and `restore()` still mean the newest step.
    best_mode: "min" (the default) or "max": which values of `best_metric`
      are best.
    keep_best: how many of the best steps to keep (>= 1).

  Attributes:
    directory: the absolute checkpoint folder.

  Every process of a multi-process (`jax.distributed`) job must construct the
  Checkpointer on the same directory and call `save`, `restore`, `wait` and
  `close` in the same order; orbax coordinates them.

  Example:
    >>> import tempfile
    >>> import jax
    >>> import numpy as np
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), save_interval_steps=10)
    >>> state = {"w": np.ones(2, np.float32), "key": jax.random.key(0)}
    >>> ckpt.save(5, state), ckpt.save(10, state), ckpt.save(10, state)
    (False, True, False)
    >>> restored, _ = ckpt.restore(target=state)
    >>> restored["key"].dtype
    key<fry>
    >>> ckpt.close()
  """

  def __init__(self, directory: str | os.PathLike[str], *,
               max_to_keep: int | None = 3, save_interval_steps: int = 1,
               best_metric: str | None = None, best_mode: str = "min", keep_best: int = 1):
    least = 0 if best_metric is not None else 1
    if max_to_keep is not None and (
        isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
        or max_to_keep < least):
      raise ValueError("Checkpointer max_to_keep (the Trainer's max_checkpoints) must be "
                       f"an int >= {least} or None (keep every step), got {max_to_keep!r}.")
    self._best = _best_options(best_metric, best_mode, keep_best)
    if (isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int)
        or save_interval_steps < 1):
      raise ValueError("Checkpointer save_interval_steps must be a positive int, "
                       f"got {save_interval_steps!r}.")
    if (not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory)
        or "\x00" in str(os.fspath(directory))):
      raise TypeError("Checkpointer directory (the Trainer's checkpoint_dir) must be a "
                      f"folder path (str or os.PathLike), got {directory!r}.")
    self.directory = pathlib.Path(directory).expanduser().absolute()
    if self.directory.exists() and not self.directory.is_dir():
      raise NotADirectoryError(
          f"Checkpointer directory {str(self.directory)!r} is a file, not a "
          "folder. Pass a folder (it is created if missing).")
    self.max_to_keep = max_to_keep
    self.save_interval_steps = save_interval_steps
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(save_interval_steps),
            # Saves where a multi-host job's preemption notice says to.
            policies.PreemptionCheckpointingPolicy(),
        ]),
        preservation_policy=_preservation(max_to_keep, self._best),
        create=True,
        enable_async_checkpointing=True,
        **({} if self._best is None else {"best_fn": self._best.fn,
                                          "best_mode": self._best.mode}),
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=_ITEMS)
    self._closed = False

  def __repr__(self) -> str:
    best = ("" if self._best is None else f", best_metric={self._best.metric!r}, "
            f"best_mode={self._best.mode!r}, keep_best={self._best.keep}")
    return (f"Checkpointer({str(self.directory)!r}, max_to_keep={self.max_to_keep}, "
            f"save_interval_steps={self.save_interval_steps}{best})")

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def _check_open(self, method: str) -> None:
    if self._closed:
      raise RuntimeError(f"Checkpointer.{method}: the Checkpointer of "
                         f"{str(self.directory)!r} is closed; make a new one.")

  # -- saving ----------------------------------------------------------------

  def save(self, step: int, state: Any, metadata: Mapping[str, Any] | None = None,
           *, force: bool = False, metrics: Mapping[str, float] | None = None) -> bool:
    """Saves `state` and `metadata` as checkpoint `step`, in the background.

    The arrays are copied off the devices before this returns, so the caller
    may donate or overwrite them at once; the files are written by a
    background thread (`wait` blocks until they are complete).

    A step is saved only if it is a multiple of `save_interval_steps` (or
    `force` is set) and newer than `latest_step`. Steps only go forward: a
    step that already exists is never overwritten, and an older one is never
    added (`save` returns False, even with `force`), so that `max_to_keep`
    always keeps the newest steps. To branch off an older step, restore it and
    save into another directory.

    Args:
      step: the training step, a non-negative int.
      state: a pytree of jax/numpy arrays and scalars (typed PRNG keys, optax
        states, ``nnx.State`` and None leaves included).
      metadata: a JSON-able dict stored with the step (None for ``{}``). JSON
        turns tuples into lists and dict keys into strings.
      force: save even where `save_interval_steps` says not to (the final
        step of a run, a preemption).
      metrics: ``{name: number}`` ranked by `best_metric` (stored by orbax
        with the step; ignored without `best_metric`).

    Returns:
      Whether a checkpoint was (started to be) written.

    Raises:
      TypeError: a leaf of `state` cannot be stored (the message names its
        path), or `metadata` is not JSON-serializable.
      ValueError: `step` is not a non-negative int, or `state` has no arrays.

    Example:
      >>> import tempfile
      >>> import numpy as np
      >>> ckpt = Checkpointer(tempfile.mkdtemp())
      >>> ckpt.save(1, {"w": np.ones(2)}), ckpt.save(1, {"w": np.zeros(2)})
      (True, False)
      >>> ckpt.close()
    """
    self._check_open("save")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"Checkpointer.save: step must be a non-negative int, got {step!r}.")
    step = int(step)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      return False
    if not force and not self._manager.should_save(step):
      return False
    metadata = _check_metadata(metadata)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    if not leaves:
      raise ValueError("Checkpointer.save: the state has no arrays to save "
                       f"(got {state!r}).")
    stored, keys = [], []
    for path, leaf in leaves:
      if _is_key(leaf):
        keys.append({"path": list(ocp.tree.str_keypath(path)),
                     "impl": str(jax.random.key_impl(leaf))})
        leaf = jax.random.key_data(leaf)
      stored.append(_check_leaf(path, leaf))
    info = {"format": FORMAT, "version": FORMAT_VERSION, "prng_keys": keys}
    args = ocp.args.Composite(**{
        _STATE: ocp.args.StandardSave(jax.tree_util.tree_unflatten(treedef, stored)),
        _METADATA: ocp.args.JsonSave(metadata),
        _INFO: ocp.args.JsonSave(info),
    })
    # The decision is made above; `force` here only skips orbax's second look.
    return bool(self._manager.save(step, args=args, force=True,
                                   metrics=self._check_metrics(metrics)))

  def _check_metrics(self, metrics: Mapping[str, float] | None) -> dict[str, float] | None:
    if self._best is None or metrics is None:
      return None
    try:
      values = {str(k): float(v) for k, v in metrics.items()}
    except (AttributeError, TypeError, ValueError):
      raise TypeError(f"Checkpointer.save: metrics must be a dict of numbers, got "
                      f"{metrics!r}.") from None
    if self._best.metric not in values:
      raise ValueError(f"Checkpointer.save: metrics has no {self._best.metric!r} (the "
                       f"best_metric); it has {sorted(values)}.")
    return values

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is complete on disk."""
    if not self._closed:
      self._manager.wait_until_finished()

  # -- reading ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """The steps in `directory`, oldest first (a save in flight included).

    They are read from disk when the Checkpointer is made and kept up to date
    by its own saves; make a new Checkpointer to see another process's.
    """
    self._check_open("all_steps")
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest step (see `all_steps`), or None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The step with the best `best_metric` (orbax's `best_step`), or None if no
    step was saved with metrics; without `best_metric`, `latest_step`."""
    self._check_open("best_step")
    if self._best is None:
      return self.latest_step()
    return self._manager.best_step()

  def restore(self, step: int | None = None, *,
              target: Any = None) -> tuple[Any, dict[str, Any]]:
    """Reads checkpoint `step` (default: the latest) back.

    Args:
      step: the step to read; None for `latest_step`.
      target: None, or a pytree with the structure of the saved state whose
        leaves are arrays or `jax.ShapeDtypeStruct` (with or without a
        ``sharding``): the restored state then has the target's containers,
        dtypes and shardings (an array saved from one mesh comes back on the
        target's mesh). Without it, the state comes back as orbax reads it:
        dicts and lists instead of NamedTuples and ``nnx.State``, numpy and
        jax arrays as saved, but typed PRNG keys rebuilt.

    Returns:
      ``(state, metadata)``: the state and the metadata dict saved with it.

    Raises:
      FileNotFoundError: `directory` holds no checkpoint, or not `step` (the
        message lists the steps there).
      ValueError: `target` does not fit the saved state (its structure, an
        array's shape, a PRNG key's impl).

    Example:
      >>> import tempfile
      >>> import jax
      >>> import numpy as np
      >>> ckpt = Checkpointer(tempfile.mkdtemp())
      >>> _ = ckpt.save(7, {"w": np.arange(4.0)})
      >>> target = {"w": jax.ShapeDtypeStruct((4,), np.float32)}
      >>> state, _ = ckpt.restore(7, target=target)
      >>> state["w"].dtype, state["w"].tolist()
      (dtype('float32'), [0.0, 1.0, 2.0, 3.0])
      >>> ckpt.close()
    """
    self._check_open("restore")
    self._manager.wait_until_finished()
    steps = self.all_steps()
    if step is not None and step not in steps:
      self._manager.reload()  # another process may have written it since
      steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(
          f"No checkpoint in {str(self.directory)!r}: it holds no complete step.")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(
          f"No checkpoint for step {step!r} in {str(self.directory)!r}; the "
          f"steps there are {steps}.")
    abstract = None if target is None else jax.tree.map(_abstract_leaf, target)
    args = ocp.args.Composite(**{
        _STATE: ocp.args.StandardRestore(abstract),
        _METADATA: ocp.args.JsonRestore(),
        _INFO: ocp.args.JsonRestore(),
    })
    try:
      restored = self._manager.restore(step, args=args)
    except ValueError as err:
      if target is None:
        raise
      raise ValueError(f"Checkpointer.restore: step {step} in {str(self.directory)!r} "
                       f"does not fit `target`: {err}") from err
    info = restored[_INFO] or {}
    impls = {tuple(k["path"]): k["impl"] for k in info.get("prng_keys", [])}
    if target is None:
      state = _rewrap_keys(restored[_STATE], impls)
    else:
      try:
        state = _fit_to_target(restored[_STATE], target, impls)
      except ValueError as err:
        raise ValueError(f"Checkpointer.restore: step {step} in "
                         f"{str(self.directory)!r} does not fit `target`: {err}") from None
    return state, dict(restored[_METADATA] or {})

  def close(self) -> None:
    """Waits for the save in flight and releases orbax's threads. Idempotent."""
    if not self._closed:
      self._closed = True
      self._manager.close()


@dataclasses.dataclass(frozen=True)
class _Best:
  """What `Checkpointer(best_metric=...)` keeps: the `keep` best by `metric`."""

  metric: str
  mode: str
  keep: int

  def fn(self, metrics: Mapping[str, float]) -> float:
    """orbax's `best_fn`: the number steps are ranked by (a nan ranks last)."""
    value = float(metrics[self.metric])
    if math.isnan(value):
      return math.inf if self.mode == "min" else -math.inf
    return value


def _best_options(metric: Any, mode: Any, keep: Any) -> _Best | None:
  if metric is None:
    return None
  if not isinstance(metric, str) or not metric:
    raise ValueError(f"Checkpointer best_metric must be None or a metric name (str), "
                     f"got {metric!r}.")
  if not isinstance(mode, str) or mode not in BEST_MODES:
    raise ValueError(f"Checkpointer best_mode must be {format_choices(BEST_MODES)}, "
                     f"got {mode!r}.")
  if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
    raise ValueError(f"Checkpointer keep_best must be an int >= 1, got {keep!r}.")
  return _Best(metric, mode, keep)


def _preservation(max_to_keep: int | None, best: _Best | None) -> Any:
  """orbax's preservation policy: the newest `max_to_keep`, and the best."""
  policies = ocp.checkpoint_managers
  latest = policies.LatestN(n=max_to_keep)
  if best is None:
    return latest
  # orbax sorts ascending, best last; `reverse` puts the smallest last for "min".
  ranked = policies.BestN(get_metric_fn=best.fn, reverse=best.mode == "min", n=best.keep,
                          keep_checkpoints_without_metrics=False)
  return policies.AnyPreservationPolicy([latest, ranked])


def _abstract_leaf(leaf: Any) -> Any:
  """The restore target orbax gets for one leaf of the caller's target."""
  if not _is_key(leaf):
    if not isinstance(leaf, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) and (
        hasattr(leaf, "__array__")):
      return np.asarray(leaf)  # a NumPy scalar comes back as a 0-d array
    return leaf
  # A typed key is stored as its key data: same leading dims, the impl's key
  # shape (e.g. (2,) for threefry) last, replicated over the mesh.
  data = jax.eval_shape(jax.random.key_data, leaf)
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, sharding.spec)
  else:
    sharding = None  # as saved; `_rewrap_keys_like` moves the key afterwards
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _rewrap_keys(state: Any, impls: dict[tuple[str, ...], str]) -> Any:
  """`state` (as orbax restored it) with the recorded key data wrapped as keys."""
  if not impls:
    return state

  def wrap(path: tuple[Any, ...], leaf: Any) -> Any:
    impl = impls.get(ocp.tree.str_keypath(path))
    return leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)

  return jax.tree_util.tree_map_with_path(wrap, state)


def _fit_to_target(state: Any, target: Any,
                   impls: dict[tuple[str, ...], str]) -> Any:
  """`state` (restored into `target`) with its keys wrapped and shapes checked.

  orbax checks the shapes of jax arrays, but restores a numpy array with the
  shape it was saved with, whatever the target says.
  """
  target_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  leaves = treedef.flatten_up_to(state)
  for i, (path, want) in enumerate(target_leaves):
    name = jax.tree_util.keystr(path)
    if _is_key(want):
      impl = impls.get(ocp.tree.str_keypath(path))
      if impl is None:
        raise ValueError(
            f"`target` has a typed PRNG key at {name!r}, but the checkpoint "
            "stores a plain array there; give that leaf the saved array's "
            "dtype and wrap it with jax.random.wrap_key_data.")
      key = jax.random.wrap_key_data(leaves[i], impl=impl)
      if key.dtype != want.dtype:
        raise ValueError(f"the PRNG key at {name!r} was saved as {key.dtype}, "
                         f"but `target` asks for {want.dtype}.")
      sharding = getattr(want, "sharding", None)
      if sharding is not None and key.sharding != sharding:
        key = jax.device_put(key, sharding)
      leaves[i] = key
    want_shape = getattr(want, "shape", None)
    if want_shape is not None and np.shape(leaves[i]) != tuple(want_shape):
      raise ValueError(f"the array at {name!r} was saved with shape "
                       f"{np.shape(leaves[i])}, but `target` asks for {tuple(want_shape)}.")
  return jax.tree_util.tree_unflatten(treedef, leaves)
