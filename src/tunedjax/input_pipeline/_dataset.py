"""The grain recipe behind `Loader`: records, transforms, shuffle, batches.

Everything that decides *which* records land in *which* batch happens on the
`grain.MapDataset` side (shuffle, per-record transforms, batching, epochs),
before any prefetching. A `MapDataset` is a pure function of the batch index,
so the batches, and their order, do not depend on how many worker processes
or read threads later fetch them: a tuner may change those freely.

Each record travels with its index in the source, so that a failing user
transform can say which record it failed on (`_errors.TransformError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from tunedjax._errors import ConfigError, TunedJaxError
from tunedjax.input_pipeline import _worker
from tunedjax.input_pipeline._worker import ArraySource


BAD_TRANSFORM = (
    "Loader(transforms=...) accepts grain.transforms.Map, "
    "grain.transforms.RandomMap or a plain callable of one record; got "
    "{value!r} (type {type_name}) at position {position}. Filters and batch "
    "transforms change which records form a batch and are not supported: "
    "filter the source and use Loader(batch_size=...)."
)
NOT_A_LIST = (
    "Loader(transforms=...) must be a list or tuple of per-record transforms "
    "(grain.transforms.Map, grain.transforms.RandomMap or plain callables of one "
    "record), or one of them; () for none. Got {value} (type {type_name})."
)
BAD_SOURCE = (
    "Loader(source=...) needs random access: a grain data source, a sequence "
    "(anything with __len__ and __getitem__), a NumPy array, or a dict/tuple "
    "of arrays with the same first dimension; got {value!r} (type {type_name})."
)


def _short(value: Any) -> str:
  shown = repr(value)
  return shown if len(shown) <= 80 else shown[:77] + "..."


def _check_arrays(arrays: Any) -> ArraySource:
  lengths = {len(a) for a in _worker.leaves(arrays)}
  if len(lengths) != 1:
    raise TunedJaxError(
        "Loader(source=...) got arrays with different first dimensions "
        f"{sorted(lengths)}; every array must hold one row per record.")
  return ArraySource(arrays)


def as_source(source: Any) -> Any:
  """Returns a random-access source for `source` (arrays are wrapped).

  Example:
    >>> len(as_source(np.arange(10)))
    10
  """
  if isinstance(source, np.ndarray) or (
      isinstance(source, (dict, tuple)) and source
      and all(isinstance(a, np.ndarray) or hasattr(a, "__array__")
              for a in _worker.leaves(source))):
    if isinstance(source, np.ndarray):
      return source if source.ndim else _bad_source(source)
    return _check_arrays(_worker.map_tree(np.asarray, source))
  if hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(
      source, (str, bytes, Mapping)):
    return source
  return _bad_source(source)


def _bad_source(source: Any):
  raise TunedJaxError(BAD_SOURCE.format(value=source, type_name=type(source).__name__))


def _is_random(transform: Any) -> bool:
  return isinstance(transform, grain.transforms.RandomMap) or (
      hasattr(transform, "random_map") and not hasattr(transform, "map"))


def check_transforms(transforms: Sequence[Any]) -> tuple[Any, ...]:
  """Validates the transforms; returns them as a tuple.

  Example:
    >>> check_transforms([np.sqrt])
    (<ufunc 'sqrt'>,)
  """
  if callable(transforms) or isinstance(
      transforms, (grain.transforms.Map, grain.transforms.RandomMap)):
    transforms = (transforms,)  # one transform
  if not isinstance(transforms, (list, tuple)):
    raise ConfigError(NOT_A_LIST.format(value=_short(transforms),
                                        type_name=type(transforms).__name__))
  out = tuple(transforms)
  for position, t in enumerate(out):
    ok = isinstance(t, (grain.transforms.Map, grain.transforms.RandomMap)) or (
        callable(t) and not isinstance(
            t, (grain.transforms.Filter, grain.transforms.Batch)))
    if not ok:
      raise TunedJaxError(BAD_TRANSFORM.format(
          value=t, type_name=type(t).__name__, position=position))
  return out


def build(source: Any, *, batch_size: int, transforms: Sequence[Any],
          shuffle: bool, seed: int, num_epochs: int | None, drop_remainder: bool,
          indices: np.ndarray | None = None) -> grain.MapDataset:
  """The batched `MapDataset`: element `i` is global batch `i`.

  Args:
    source: a random-access source (see `as_source`).
    batch_size: records per batch.
    transforms: per-record transforms, applied in order.
    shuffle: shuffle the records, anew each epoch.
    seed: the seed of the shuffle and of random transforms.
    num_epochs: epochs, or None for an endless stream.
    drop_remainder: drop each epoch's last, short batch.
    indices: read only these source records (the tuner's random subset).

  Returns:
    A `grain.MapDataset` of batches; its length is the number of batches
    (`sys.maxsize` for an endless stream).

  Example:
    >>> ds = build(np.arange(10), batch_size=4, transforms=(), shuffle=False,
    ...            seed=0, num_epochs=1, drop_remainder=True)
    >>> len(ds), ds[1].tolist()
    (2, [4, 5, 6, 7])
  """
  if indices is None:
    ds = grain.MapDataset.range(len(source))
  else:
    ds = grain.MapDataset.source(np.asarray(indices, dtype=np.int64))
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.map(_worker.Read(source))
  for position, t in enumerate(transforms):
    if _is_random(t):
      ds = ds.random_map(_worker.ApplyRandom(t, position), seed=(seed + 1 + position) % 2**32)
    else:
      ds = ds.map(_worker.Apply(t, position))
  ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=_worker.stack_records)
  return ds.repeat(num_epochs)
