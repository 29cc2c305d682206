"""A `Trainer`'s checkpoint glue: what its checkpoints hold (the state in the
model's own layout, the history, the data position and the trainer's
settings) and how a restored one goes back (in the layout the state is
stored in). `Checkpointer` does the orbax side."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from tunedjax.trainer._checkpoint import Checkpointer
from tunedjax.trainer._history import History
from tunedjax.trainer._programs import StepPrograms


class TrainerCheckpoints:
  """Saves and restores one `Trainer`'s checkpoints.

  Args:
    programs: the trainer's `StepPrograms` (the layout its state is stored in).
    settings: the trainer's settings a checkpoint records
      (``steps_per_execution``, ``seed``, ``kind``).
  """

  def __init__(self, programs: StepPrograms, settings: Mapping[str, Any]):
    self._programs = programs
    self._settings = dict(settings)

  def save(self, checkpointer: Checkpointer, step: int, state: Any, history: History,
           stream: Any, *, force: bool = False,
           metrics: Mapping[str, float] | None = None) -> bool:
    """Saves `state` (in the model's own layout), `history` and `stream`'s data
    position, with orbax `metrics` for a best-checkpoint policy."""
    metadata = {"history": history.to_dict(),
                "data": stream.get_state() if stream is not None else None,
                "trainer": dict(self._settings)}
    return checkpointer.save(step, self._programs.logical(state), metadata, force=force,
                             metrics=metrics)

  def restore(self, checkpointer: Checkpointer, state: Any, step: int | None, *,
              wait: bool) -> tuple[Any, History, dict[str, Any]]:
    """The state (as stored), history and metadata of a checkpoint (`step`,
    default the latest), restored onto `state`'s shardings; `wait`: let this
    trainer's own saves in flight finish first."""
    weights = self._programs.weights
    if weights is None:
      target = jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    else:  # checkpoints hold the model's own layout
      target = weights.logical_abstract(state)
    if wait:
      checkpointer.wait()
    restored, metadata = checkpointer.restore(step, target=target)
    restored = restored if weights is None else weights.to_stored(restored)
    return restored, History.from_dict(metadata["history"]), metadata
