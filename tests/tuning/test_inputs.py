"""Random tuning inputs (remembered large draws) and the error measure."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunedjax._tuning import _inputs
from tunedjax._tuning import random_array, relative_error

BIG = (256, 1024)  # 1 MiB of float32: remembered


def _fresh_draws(monkeypatch):
  monkeypatch.setattr(_inputs, "_drawn", _inputs._Drawn(_inputs._DRAWN_BYTES))


def test_a_remembered_draw_equals_drawing_and_leaves_the_generator_where_drawing_would(
    monkeypatch):
  _fresh_draws(monkeypatch)
  first, second = np.random.default_rng(3), np.random.default_rng(3)
  a = random_array(BIG, "float32", first)
  b = random_array(BIG, "float32", second)  # the same state: remembered
  assert b is a and not a.flags.writeable
  # Both generators go on exactly as a generator that drew it itself.
  plain = np.random.default_rng(3)
  expected = plain.standard_normal(BIG, dtype=np.float32)
  np.testing.assert_array_equal(a, expected)
  after = plain.standard_normal(7)
  np.testing.assert_array_equal(first.standard_normal(7), after)
  np.testing.assert_array_equal(second.standard_normal(7), after)


def test_draws_differ_by_state_shape_and_dtype(monkeypatch):
  _fresh_draws(monkeypatch)
  rng = np.random.default_rng(0)
  a = random_array(BIG, "float32", rng)
  b = random_array(BIG, "float32", rng)  # the generator moved on: a new draw
  c = random_array(BIG, "float64", np.random.default_rng(0))
  d = random_array((1024, 256), "float32", np.random.default_rng(0))
  assert not np.array_equal(a, b)
  assert c.dtype == np.float64 and d.shape == (1024, 256)
  # Each floating dtype is drawn in its own precision: another draw.
  assert not np.array_equal(c.astype(np.float32), a)
  np.testing.assert_array_equal(c, np.random.default_rng(0).standard_normal(BIG))


def test_small_draws_are_writable_and_not_remembered(monkeypatch):
  _fresh_draws(monkeypatch)
  x = random_array((4, 4), "float32", np.random.default_rng(0))
  x[0, 0] = 1.0  # writable
  assert not _inputs._drawn.entries


def test_remembered_draws_are_bounded(monkeypatch):
  monkeypatch.setattr(_inputs, "_drawn", _inputs._Drawn(3 << 20))
  for seed in range(5):
    random_array(BIG, "float32", np.random.default_rng(seed))
  assert len(_inputs._drawn.entries) == 3 and _inputs._drawn.bytes == 3 << 20
  # The least recently used went first: seeds 2, 3 and 4 remain.
  rng = np.random.default_rng(4)
  assert random_array(BIG, "float32", rng) is list(_inputs._drawn.entries.values())[-1][0]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["float16", "float32", "bfloat16"]),
       st.floats(min_value=1e-7, max_value=0.5), st.integers(0, 2**31 - 1))
def test_the_float32_error_matches_float64_on_narrow_floats(dtype, scale, seed):
  rng = np.random.default_rng(seed)
  dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  ref = (rng.standard_normal(300) * 10).astype(dtype)
  out = (ref.astype(np.float64) * (1 + scale * rng.standard_normal(300))).astype(dtype)
  exact = (np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64)))
           / np.max(np.abs(ref.astype(np.float64))))
  assert relative_error(out, ref) == pytest.approx(exact, rel=1e-5, abs=1e-12)


def test_the_error_of_wide_or_mixed_inputs_is_float64():
  ref = np.array([1.0, 1.0 + 1e-12])
  assert relative_error(ref + 1e-15, ref) == pytest.approx(1e-15 / (1.0 + 1e-12), rel=1e-3)
  assert relative_error(np.array([1, 2]), np.array([1, 3])) == pytest.approx(1 / 3)
  assert relative_error(np.ones(2, np.float32), np.ones(3, np.float32)) == float("inf")
  assert relative_error(np.array([np.nan], np.float32), np.ones(1, np.float32)) == float("inf")
