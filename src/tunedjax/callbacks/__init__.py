"""Callbacks for `tunedjax.Trainer.fit`: logging, early stopping, best checkpoints.

`TensorBoard` (the ``tensorboard`` extra), `CSVLogger` and `JSONLinesLogger`
write each step's and epoch's figures (only process 0 of a multi-process job
writes); `EarlyStopping` ends `fit` when a logged quantity stops improving;
`BestCheckpoint` keeps the best checkpoints by an evaluation metric through
orbax. `Callback` is the base class to write your own. docs/callbacks.md is
the manual.

Example:
  >>> import tunedjax as tj
  >>> stop = tj.callbacks.EarlyStopping("eval_loss", patience=3)
  >>> isinstance(stop, tj.callbacks.Callback)
  True
"""

from tunedjax.callbacks._best_checkpoint import BestCheckpoint as BestCheckpoint
from tunedjax.callbacks._early_stopping import EarlyStopping as EarlyStopping
from tunedjax.callbacks._files import CSVLogger as CSVLogger
from tunedjax.callbacks._files import JSONLinesLogger as JSONLinesLogger
from tunedjax.callbacks._tensorboard import TensorBoard as TensorBoard
from tunedjax.trainer._callbacks import Callback as Callback

__all__ = [
    "BestCheckpoint",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "JSONLinesLogger",
    "TensorBoard",
]
