"""Input pipeline: a grain loader that tunes its parallelism and resumes exactly.

`Loader` batches any random-access source in an order that no setting
changes, checkpoints as a position in global batches, measures its best
`LoaderSettings` (worker processes, read threads, batches each worker keeps
ready within a memory budget) when asked (`tune_worker_count`, kept in the
persistent tuning cache), and leaves no worker process behind.

Example:
  >>> import numpy as np
  >>> from tunedjax import input_pipeline as ip
  >>> loader = ip.Loader({"x": np.arange(12.0)}, batch_size=4, seed=1,
  ...                    worker_count=0, read_threads=0)
  >>> next(loader)["x"].shape
  (4,)
  >>> state = loader.get_state()
  >>> again = ip.Loader({"x": np.arange(12.0)}, batch_size=4, seed=1,
  ...                   worker_count=0, read_threads=2)
  >>> again.set_state(state)
  >>> bool((next(again)["x"] == next(loader)["x"]).all())
  True
"""

from __future__ import annotations

from tunedjax.input_pipeline._errors import TransformError as TransformError
from tunedjax.input_pipeline._loader import Loader as Loader
from tunedjax.input_pipeline._settings import LoaderSettings as LoaderSettings
from tunedjax.input_pipeline._state import LoaderState as LoaderState
from tunedjax.input_pipeline._state import StateError as StateError
from tunedjax.input_pipeline._result import Trial as Trial
from tunedjax.input_pipeline._result import TuningResult as TuningResult
from tunedjax.input_pipeline._tuner import tune_worker_count as tune_worker_count

__all__ = [
    "Loader",
    "LoaderSettings",
    "LoaderState",
    "StateError",
    "TransformError",
    "Trial",
    "TuningResult",
    "tune_worker_count",
]
