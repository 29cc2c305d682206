"""LoaderSettings and the knob table: validation, conversion, grain options,
neighbours, and the memory bound on the per-worker prefetch buffer."""

from __future__ import annotations

import dataclasses

import grain
import numpy as np
import pytest

from tunedjax import input_pipeline as ip
from tunedjax.input_pipeline import _processes
from tunedjax.input_pipeline import _settings

S = ip.LoaderSettings


def test_the_table_has_one_row_per_field_and_names_are_unique():
  fields = {f.name for f in dataclasses.fields(S)}
  assert {k.name for k in _settings.KNOBS} == fields
  assert len(set(_settings.TUNE_NAMES)) == len(_settings.KNOBS)
  for k in _settings.KNOBS:  # every row maps onto grain options that exist
    for cls_name, kwargs in k.grain(max(k.low, 1)).items():
      params = {f.name for f in dataclasses.fields(getattr(grain, cls_name))}
      assert set(kwargs) <= params, (k.name, cls_name, kwargs)


def test_settings_are_frozen_hashable_and_checked():
  s = S(worker_count=2, read_threads=1, prefetch_buffer=4)
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.worker_count = 3
  assert {s: 1}[S(2, 1, 4)] == 1
  assert S(np.int64(2), 1) == S(2, 1) and type(S(np.int64(2)).worker_count) is int
  for bad in ({"worker_count": -1}, {"read_threads": 1.5}, {"prefetch_buffer": 0},
              {"worker_count": True}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      S(**bad)


def test_from_dict_converts_entries_that_lack_a_knob():
  old = {"worker_count": 3, "read_threads": 1, "batches_per_s": 9.0}  # before the buffer
  assert S.from_dict(old) == S(3, 1, 2)
  assert S.from_dict(old, missing=S(prefetch_buffer=8)) == S(3, 1, 8)
  with pytest.raises(ValueError, match="prefetch_buffer"):
    S.from_dict({**old, "prefetch_buffer": "x"})
  assert S.of((2, 1)) == S(2, 1, 2) and S.of(S(1), read_threads=0) == S(1, 0)
  assert S.of({"worker_count": 4}) == S(4)
  with pytest.raises(ValueError, match="at most 3 values"):
    S.of((1, 2, 3, 4))


def test_grain_options_follow_the_settings():
  read, mp = _processes.grain_options(S(worker_count=3, read_threads=2, prefetch_buffer=5))
  assert (read.num_threads, read.prefetch_buffer_size) == (2, 4)
  assert (mp.num_workers, mp.per_worker_buffer_size) == (3, 5)
  # what the trial's warm-up drains grows with the buffer
  assert _processes.buffered_batches(S(3, 2, 5)) - _processes.buffered_batches(S(3, 2, 1)) == 12
  assert _processes.buffered_batches(S(0, 2, 5)) == _processes.buffered_batches(S(0, 2, 1)) == 4


def _space(batches_in_memory=None, buffers=(1, 2, 4, 8, 16)):
  return _settings.Space({"worker_count": [0, 1, 2, 4, 8], "read_threads": [1],
                          "prefetch_buffer": list(buffers)},
                         batches_in_memory=batches_in_memory)


def test_memory_rule_caps_the_buffer_by_workers_times_batches():
  # 20 batches fit the budget: buffer <= 20 // workers, the largest value within.
  space = _space(batches_in_memory=20)
  assert space.fit(S(1, 1, 16)) == S(1, 1, 16)
  assert space.fit(S(2, 1, 16)) == S(2, 1, 8)
  assert space.fit(S(4, 1, 16)) == S(4, 1, 4)
  assert space.fit(S(8, 1, 4)) == S(8, 1, 2)
  # Over budget even at one batch per worker: the smallest buffer grain allows.
  assert _space(batches_in_memory=3).fit(S(8, 1, 4)) == S(8, 1, 1)
  # Without workers the buffer is unused, so unbounded; no budget: no bound;
  # a buffer the climb does not tune (one value) is the user's and stays.
  assert space.fit(S(0, 1, 16)) == S(0, 1, 16)
  assert _space().fit(S(8, 1, 16)) == S(8, 1, 16)
  assert _space(batches_in_memory=3, buffers=(16,)).fit(S(8, 1, 16)) == S(8, 1, 16)
  for w in (1, 2, 4, 8):
    for b in (1, 2, 4, 8, 16):
      fitted = space.fit(S(w, 1, b))
      assert fitted.worker_count * fitted.prefetch_buffer <= 20 or fitted.prefetch_buffer == 1
      assert fitted.prefetch_buffer <= b


def test_batches_in_memory_and_batch_bytes():
  batch = {"x": np.zeros((16, 32, 32, 3), np.float32), "y": np.zeros(16, np.int32)}
  nbytes = 16 * 32 * 32 * 3 * 4 + 16 * 4
  assert _settings.batch_nbytes(batch) == nbytes
  assert _settings.batches_in_memory(nbytes, 10 * nbytes + 1) == 10
  assert _settings.batches_in_memory(nbytes, None) is None
  budget = _settings.default_memory_budget()
  assert budget is None or 0 < budget <= (_settings.available_memory() or 0)


def test_neighbours_step_each_knob_and_the_buffer_only_with_workers():
  space = _space(batches_in_memory=8)
  assert space.neighbours(S(0, 1, 2)) == [S(1, 1, 2)]  # no buffer steps without workers
  got = space.neighbours(S(2, 1, 2))
  assert got == [S(1, 1, 2), S(4, 1, 2), S(2, 1, 1), S(2, 1, 4)]
  # 4 workers: a buffer of 4 would hold 16 batches, over the 8: not a neighbour,
  # and the step to 8 workers lowers the buffer to fit.
  assert space.neighbours(S(4, 1, 2)) == [S(2, 1, 2), S(8, 1, 1), S(4, 1, 1)]
