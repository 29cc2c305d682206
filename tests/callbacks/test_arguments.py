"""Every callback option given a wrong value: a TrainerError naming the option, never an
error from deep inside (the same rule and junk as tests/test_bad_input.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_bad_input import EXAMPLES, JUNK, attempt
from tunedjax import callbacks

OPTIONS = {
    callbacks.TensorBoard: ("log_dir", "every_n_steps", "histograms", "flush_secs"),
    callbacks.CSVLogger: ("directory", "every_n_steps", "append"),
    callbacks.JSONLinesLogger: ("path", "every_n_steps", "append"),
    callbacks.EarlyStopping: ("monitor", "mode", "patience", "min_delta",
                              "restore_best_weights"),
    callbacks.BestCheckpoint: ("directory", "monitor", "mode", "keep"),
}
PATHS = {"log_dir", "directory", "path"}
ARGS = [(cls, name) for cls, names in OPTIONS.items() for name in names]


@settings(max_examples=3 * EXAMPLES)
@given(st.sampled_from(ARGS), JUNK)
def test_callback_options(where, value):
  cls, name = where
  kwargs = {name: value}
  args = () if name in PATHS or cls is callbacks.EarlyStopping else ("unused-folder",)
  if name in PATHS:
    args, kwargs = (value,), {}
  attempt(lambda: cls(*args, **kwargs), name)
