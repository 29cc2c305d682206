"""The benchmarks' timing harness (`benchmarks/harness/timing.py`): every variant runs
and is timed each round, and a self-timed variant's own figure is what is recorded."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import timing  # noqa: E402  pylint: disable=wrong-import-position


def _work(calls: list[str], name: str):
  def run():
    calls.append(name)
    return sum(i * i for i in range(20_000))  # some work to time (a number, not seconds)
  return run


import pytest  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order


@pytest.fixture(autouse=True)
def _no_collections(monkeypatch):
  """`interleaved` collects garbage before each variant; in a test worker that has
  built many programs one collection takes about a second, and these tests time nothing."""
  monkeypatch.setattr(timing.gc, "collect", lambda *args: 0)


def test_every_variant_runs_and_is_timed_each_round_in_a_rotated_order():
  calls: list[str] = []
  t = timing.interleaved({"a": _work(calls, "a"), "b": _work(calls, "b")}, baseline="a",
                         rounds=3, warmup=1, burst=2)
  # Per round: a, b and the A/A control (a again), each `burst` times.
  assert calls.count("a") == 2 * 2 * 4 and calls.count("b") == 2 * 4
  assert set(t.runs) == {"a", "b", timing.CONTROL}
  for name, runs in t.runs.items():
    assert len(runs) == 3 and all(r > 0 for r in runs), (name, runs)
  assert calls[:6] == ["a", "a", "b", "b", "a", "a"]  # round 0: a, b, control
  assert calls[6:12] == ["b", "b", "a", "a", "a", "a"]  # round 1 starts one later


def test_a_self_timed_variant_records_the_seconds_it_returns():
  seconds = iter([0.5, 0.25, 0.125, 1.0, 2.0, 4.0] * 10)
  t = timing.interleaved({"base": lambda: 1.0, "own": lambda: next(seconds)}, baseline="base",
                         rounds=2, warmup=0, self_timed=True)
  assert t.runs["base"] == [1.0, 1.0] and t.runs[timing.CONTROL] == [1.0, 1.0]
  assert t.runs["own"] == [0.5, 0.25]
  assert t.ratio("own") == 0.375
