"""Each step's learning rate, read from the optimizer state: inject_hyperparams, a plain
schedule at its ScaleByScheduleState's count (skipped updates do not advance it), a number."""

from __future__ import annotations

import math

import numpy as np
import optax
import pytest

from tests.trainer import models as m
from tunedjax.trainer import Callback, History, Trainer, TrainerError

QUIET = {"autotune": False, "progress": False}
SCHEDULE = optax.exponential_decay(0.02, transition_steps=1, decay_rate=0.9)


class _Logs(Callback):
  def __init__(self):
    self.rates = []

  def on_step_end(self, trainer, step, logs):
    self.rates.append(logs.get("learning_rate"))


def _fit(optimizer, *, data=None, callbacks=(), **kwargs):
  trainer = Trainer(m.NnxMLP(), optimizer, m.nnx_loss, **{**QUIET, **kwargs})
  data = m.regression_data(n=96) if data is None else data
  if isinstance(data, dict):
    return trainer.fit(data, batch_size=16, epochs=2, callbacks=list(callbacks))
  return trainer.fit(data, epochs=1, callbacks=list(callbacks))


def _with_bad_step(data, bad_batch, batch_size=16):
  out = m.batches(data, batch_size)
  out[bad_batch] = {**out[bad_batch], "x": np.full_like(out[bad_batch]["x"], np.inf)}
  return out


def _f32(values):
  return np.asarray(values, np.float32).astype(np.float64).tolist()


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_inject_hyperparams_gives_the_rate_each_update_used(steps_per_execution):
  logs = _Logs()
  history = _fit(optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE), callbacks=[logs],
                 steps_per_execution=steps_per_execution)
  assert history.learning_rates == _f32([SCHEDULE(i) for i in range(12)])
  assert logs.rates == history.learning_rates
  assert history.epochs[0]["learning_rate"] == history.learning_rates[5]


def test_a_plain_schedule_is_evaluated_at_the_schedule_state_count():
  plain = _fit(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(SCHEDULE)),
               schedule=SCHEDULE)
  assert plain.learning_rates == _f32([SCHEDULE(i) for i in range(12)])
  assert _fit(optax.sgd(0.05), schedule=0.05).learning_rates == _f32([0.05] * 12)


def test_skipped_updates_do_not_advance_a_schedule():
  logs = _Logs()
  data = _with_bad_step(m.regression_data(n=128), 3)
  history = _fit(optax.adam(SCHEDULE), data=data, callbacks=[logs], schedule=SCHEDULE,
                 precision="mixed_float16")
  assert 3 in history.skipped
  applied = [sum(s not in history.skipped for s in history.steps[:i])
             for i in range(len(history.steps))]
  assert history.learning_rates == _f32([SCHEDULE(n) for n in applied])


def test_unknown_rates_are_nan_and_left_out_of_the_logs():
  logs = _Logs()
  history = _fit(optax.adam(SCHEDULE), callbacks=[logs])  # a plain schedule, not given
  assert len(history.learning_rates) == 12 and all(math.isnan(r) for r in history.learning_rates)
  assert logs.rates == [None] * 12 and "learning_rate" not in history.epochs[0]
  with pytest.raises(TrainerError, match="schedule must be None, a number or a function"):
    Trainer(m.NnxMLP(), optax.adam(1e-3), m.nnx_loss, schedule="cosine", **QUIET)


def test_a_history_written_before_learning_rates_loads_with_nan():
  h = History()
  h.record_step(0, 1.0, 0.1, samples=8, learning_rate=0.5)
  d = h.to_dict()
  assert d["learning_rates"] == [0.5] and History.from_dict(d) == h
  del d["learning_rates"]
  old = History.from_dict(d)
  assert len(old.learning_rates) == 1 and math.isnan(old.learning_rates[0])
