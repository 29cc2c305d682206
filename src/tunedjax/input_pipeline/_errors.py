"""`TransformError`: a user transform that failed on one record, named.

`_worker` raises it where a transform fails (in a worker process too) and
imports this module on that error path only; this module imports no other
part of the input pipeline, so the two depend one way.
"""

from __future__ import annotations

import functools
from typing import Any

from tunedjax._errors import TunedJaxError


class TransformError(TunedJaxError):
  """A user transform raised while processing one record.

  The message names the transform, its position in `transforms`, the record's
  index in the source, and holds the original traceback (also when the
  transform ran in a worker process).

  Attributes:
    record_index: the index of the failing record in the source.
    transform: a readable name of the transform.
    original_traceback: the transform's traceback, formatted.

  Example:
    >>> err = TransformError("boom", 7, "parse", "Traceback ...")
    >>> err.record_index
    7
  """

  def __init__(self, message: str, record_index: int, transform: str,
               original_traceback: str):
    super().__init__(message, record_index, transform, original_traceback)
    self.record_index = record_index
    self.transform = transform
    self.original_traceback = original_traceback

  def __str__(self) -> str:
    return self.args[0]


TRANSFORM_FAILED = (
    "Transform {position} ({name}) failed on record {index} of the source: "
    "{error}\n\nThe transform's traceback:\n{tb}"
)


def name_of(obj: Any) -> str:
  """A stable, readable name of a transform (no memory addresses).

  Example:
    >>> import numpy as np
    >>> name_of(np.sqrt)
    'numpy.sqrt'
  """
  if isinstance(obj, functools.partial):
    return f"partial({name_of(obj.func)})"
  target = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
  module = getattr(target, "__module__", None) or ""
  qualname = getattr(target, "__qualname__", type(obj).__name__)
  return f"{module}.{qualname}" if module else qualname


def transform_error(position: int, transform: Any, index: int, error: Exception,
                    tb: str) -> TransformError:
  """The `TransformError` of transform `position` failing on record `index`.

  Example:
    >>> str(transform_error(0, len, 3, ValueError("bad"), "tb")).splitlines()[0]
    'Transform 0 (builtins.len) failed on record 3 of the source: ValueError: bad'
  """
  name = name_of(transform)
  message = TRANSFORM_FAILED.format(position=position, name=name, index=index,
                                    error=f"{type(error).__name__}: {error}", tb=tb)
  return TransformError(message, index, name, tb)
