"""`Trainer`: a drop-in training loop with every tuner behind one flag.

Example:
  >>> from tunedjax.trainer import Trainer, History, Callback
  >>> History().losses
  []
"""

from tunedjax.trainer._callbacks import Callback as Callback
from tunedjax.trainer._checkpoint import Checkpointer as Checkpointer
from tunedjax.trainer._history import History as History
from tunedjax.trainer._model import TrainerError as TrainerError
from tunedjax.trainer._progress import Progress as Progress
from tunedjax.trainer._step import TrainState as TrainState
from tunedjax.trainer._trainer import Trainer as Trainer

__all__ = [
    "Callback",
    "Checkpointer",
    "History",
    "Progress",
    "TrainState",
    "Trainer",
    "TrainerError",
]
