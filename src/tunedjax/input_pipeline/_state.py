"""Loader checkpoints: a position in global batches, nothing about workers.

grain's own iterator states record per-worker positions, so they cannot be
restored under another worker count ("Worker count in checkpoint does not
match", or an IndexError). Because `Loader`'s batches are a pure function of
the batch index, its state is just that index plus what identifies the
stream, and restores under any worker count or read-thread count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tunedjax._errors import TunedJaxError

STATE_VERSION = 1


class StateError(TunedJaxError):
  """A loader state does not fit this loader (another stream, bad fields).

  Example:
    >>> try:
    ...   LoaderState.from_dict({"position": -1})
    ... except StateError as e:
    ...   print("position" in str(e))
    True
  """


@dataclasses.dataclass(frozen=True)
class LoaderState:
  """Where a `Loader` is: `position` batches consumed since the start.

  The other fields identify the stream (same records, batch size, seed and
  order), so that a state is not silently restored into another pipeline.
  `to_dict` gives plain ints and bools, for JSON or an orbax checkpoint.

  Example:
    >>> s = LoaderState(position=3, num_records=100, batch_size=8, seed=0,
    ...                 shuffle=True, drop_remainder=True)
    >>> LoaderState.from_dict(s.to_dict()) == s
    True
  """

  position: int
  num_records: int
  batch_size: int
  seed: int
  shuffle: bool
  drop_remainder: bool

  def to_dict(self) -> dict[str, Any]:
    """The state as a dict of plain values, with a format version."""
    return {"version": STATE_VERSION, **dataclasses.asdict(self)}

  @classmethod
  def from_dict(cls, state: Mapping[str, Any]) -> LoaderState:
    """Reads and checks a state written by `to_dict`.

    Raises:
      StateError: a field is missing or has a wrong type or value.
    """
    if not isinstance(state, Mapping):
      raise StateError(f"A loader state must be a dict from Loader.get_state(); got "
                       f"{state!r} (type {type(state).__name__}).")
    version = state.get("version", STATE_VERSION)
    if version != STATE_VERSION:
      raise StateError(f"Loader state version {version!r} is not supported; this "
                       f"tunedjax reads version {STATE_VERSION}.")
    values = {}
    for field in dataclasses.fields(cls):
      if field.name not in state:
        raise StateError(f"Loader state {dict(state)!r} lacks the field {field.name!r}; "
                         f"a state has the fields {[f.name for f in dataclasses.fields(cls)]}.")
      value = state[field.name]
      want = bool if field.type in ("bool", bool) else int
      if want is int and (isinstance(value, bool) or not isinstance(value, int)):
        try:
          value = _as_int(value)
        except (TypeError, ValueError):
          raise StateError(f"Loader state field {field.name!r} must be an int, got "
                           f"{value!r}.") from None
      if want is bool:
        value = bool(value)
      if want is int and value < 0:
        raise StateError(f"Loader state field {field.name!r} must be >= 0, got {value!r}.")
      values[field.name] = value
    return cls(**values)

  def check_matches(self, other: LoaderState) -> None:
    """Raises StateError naming each field (but `position`) that differs."""
    diffs = [f"{f.name}: checkpoint {getattr(self, f.name)!r}, loader {getattr(other, f.name)!r}"
             for f in dataclasses.fields(self)
             if f.name != "position" and getattr(self, f.name) != getattr(other, f.name)]
    if diffs:
      raise StateError("The loader state comes from another stream (" + "; ".join(diffs)
                       + "). Restore it into a Loader built with the same source "
                       "length, batch_size, seed, shuffle and drop_remainder.")


def _as_int(value: Any) -> int:
  # numpy and jax scalars (orbax restores ints as arrays) are fine if integral.
  as_int = int(value)
  if as_int != value:
    raise ValueError(value)
  return as_int
