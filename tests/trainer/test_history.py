"""History: recording, epochs, throughput, extend, JSON round trip, summary, plot."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from tunedjax.trainer._history import History


def _history(losses, *, start=0, seconds=0.1, samples=8, skipped=()):
  h = History()
  for i, loss in enumerate(losses):
    step = start + i
    h.record_step(step, loss, seconds, samples=samples, metrics={"acc": i / 10},
                  skipped=step in skipped)
  return h


def test_record_step_fills_every_list():
  h = History()
  h.record_step(10, np.float32(0.5), 0.25, samples=32, metrics={"acc": np.float64(0.75)})
  h.record_step(11, float("nan"), 0.125, samples=16, skipped=True)
  assert h.steps == [10, 11]
  assert h.losses[0] == 0.5 and math.isnan(h.losses[1])
  assert type(h.losses[0]) is float and type(h.metrics[0]["acc"]) is float
  assert h.step_times == [0.25, 0.125]
  assert h.samples == [32, 16]
  assert h.metrics == [{"acc": 0.75}, {}]
  assert h.skipped == [11]
  assert h.skipped_steps == 1


def test_record_step_rejects_steps_that_do_not_increase():
  h = _history([1.0, 0.9])
  with pytest.raises(ValueError, match="step 1 does not follow the last recorded step 1"):
    h.record_step(1, 0.5, 0.1, samples=8)
  with pytest.raises(ValueError, match="seconds=-1"):
    h.record_step(2, 0.5, -1, samples=8)


def test_end_epoch_summarises_only_its_own_steps():
  h = _history([4.0, float("inf"), 2.0], seconds=0.5, samples=10, skipped=(1,))
  first = h.end_epoch(0, 2.0, extra={"eval_loss": np.float32(1.5)})
  assert first == {"epoch": 0, "loss": 3.0, "acc": pytest.approx(0.1), "seconds": 2.0,
                   "steps_per_s": 1.5, "samples_per_s": 15.0, "eval_loss": 1.5}
  assert list(first) == ["epoch", "loss", "acc", "seconds", "steps_per_s", "samples_per_s",
                         "eval_loss"]
  h.record_step(3, 1.0, 0.5, samples=4, metrics={"acc": 0.9})
  h.record_step(4, 0.5, 0.5, samples=4, metrics={"acc": 1.0})
  second = h.end_epoch(1, 4.0)
  assert second["loss"] == 0.75
  assert second["acc"] == pytest.approx(0.95)
  assert second["steps_per_s"] == 0.5
  assert second["samples_per_s"] == 2.0
  assert h.epochs == [first, second]
  assert [e["epoch"] for e in h.epochs] == [0, 1]


def test_end_epoch_keeps_its_own_keys_over_same_named_metrics():
  h = History()
  h.record_step(0, 1.0, 1.0, samples=4, metrics={"loss": 7.0, "seconds": 7.0, "f1": 0.5})
  assert h.end_epoch(0, 2.0) == {"epoch": 0, "loss": 1.0, "f1": 0.5, "seconds": 2.0,
                                 "steps_per_s": 0.5, "samples_per_s": 2.0}


def test_end_epoch_without_finite_losses_or_time_gives_nan():
  h = _history([float("nan")])
  e = h.end_epoch(0, 0.0)
  assert math.isnan(e["loss"]) and math.isnan(e["steps_per_s"])


def test_record_eval():
  h = History()
  h.record_eval(20, {"loss": np.float32(0.25), "acc": 0.5})
  assert h.evals == [{"loss": 0.25, "acc": 0.5, "step": 20}]


def test_throughput_leaves_out_the_first_step():
  h = History()
  h.record_step(0, 1.0, 10.0, samples=100)  # compiles
  h.record_step(1, 1.0, 1.0, samples=100)
  h.record_step(2, 1.0, 0.5, samples=100)
  assert h.throughput() == 200 / 1.5
  assert h.throughput(last=1) == 200.0
  assert h.throughput(last=100) == 200 / 1.5
  one = History()
  one.record_step(0, 1.0, 2.0, samples=10)
  assert one.throughput() == 5.0
  assert History().throughput() == 0.0
  with pytest.raises(ValueError, match="got 0"):
    h.throughput(last=0)


def test_extend_appends_a_resumed_run():
  a = _history([3.0, 2.0], skipped=(1,))
  a.end_epoch(0, 1.0)
  a.record_eval(1, {"loss": 2.5})
  a.tuning = {"dataloader": {"workers": 2}, "precision": "bf16"}
  b = _history([1.5, 1.0, 0.5], start=2)
  b.end_epoch(1, 1.0)
  b.record_step(5, 0.25, 0.1, samples=8)  # an epoch b has not ended
  b.tuning = {"precision": "f32"}
  a.extend(b)
  assert a.steps == [0, 1, 2, 3, 4, 5]
  assert a.losses == [3.0, 2.0, 1.5, 1.0, 0.5, 0.25]
  assert a.skipped == [1]
  assert [e["epoch"] for e in a.epochs] == [0, 1]
  assert a.evals == [{"loss": 2.5, "step": 1}]
  assert a.tuning == {"dataloader": {"workers": 2}, "precision": "f32"}
  assert a.end_epoch(2, 1.0)["loss"] == 0.25  # only b's open epoch
  b.losses[0] = 99.0
  assert a.losses[2] == 1.5  # a copy, not shared


def test_extend_rejects_overlapping_steps():
  a = _history([1.0] * 10)
  with pytest.raises(ValueError, match="starts at step 9.*last step 9"):
    a.extend(_history([1.0], start=9))
  a.extend(History())  # an empty run extends nothing
  assert len(a.losses) == 10


def test_json_round_trip_with_nan_and_inf(tmp_path):
  h = _history([1.0, float("nan"), float("inf"), -float("inf")], skipped=(1, 2, 3))
  h.end_epoch(0, 1.0)
  h.record_step(4, 0.5, 0.1, samples=8)  # open epoch survives the round trip
  h.record_eval(4, {"loss": float("nan")})
  h.tuning = {"dataloader": {"worker_count": 2}, "layout": None}
  text = json.dumps(h.to_dict())  # plain dumps, no allow_nan dance
  back = History.from_dict(json.loads(text))
  assert back == h
  assert math.isnan(back.losses[1]) and back.losses[2] == math.inf
  path = tmp_path / "history.json"
  h.save_json(path)
  loaded = History.load_json(path)
  assert loaded == h
  assert loaded.end_epoch(1, 1.0)["loss"] == 0.5
  assert [p.name for p in tmp_path.iterdir()] == ["history.json"]  # no temp left


def test_equality_notices_differences():
  a = _history([1.0, float("nan")])
  b = _history([1.0, float("nan")])
  assert a == b
  b.losses[1] = 0.0
  assert a != b
  c = _history([1.0, float("nan")])
  c.tuning["precision"] = "bf16"
  assert a != c
  assert a != "History"


def test_from_dict_rejects_bad_input():
  d = _history([1.0, 2.0]).to_dict()
  with pytest.raises(ValueError, match="version 99"):
    History.from_dict({**d, "version": 99})
  with pytest.raises(ValueError, match=r"unknown keys \['loss'\]"):
    History.from_dict({**d, "loss": []})
  with pytest.raises(ValueError, match="'samples': 1"):
    History.from_dict({**d, "samples": [8]})


def test_repr_and_summary():
  h = _history([2.0, 1.0, 0.12345678], seconds=0.02, samples=10, skipped=(1,))
  h.step_times[0] = 1.5
  h.end_epoch(0, 1.54, extra={"eval_loss": 0.2})
  assert repr(h) == "History(steps=3, epochs=1, last_loss=0.1235, skipped=1)"
  assert repr(History()) == "History(steps=0, epochs=0, last_loss=None, skipped=0)"
  text = h.summary()
  assert "steps         3 (0..2)" in text
  assert "final loss    0.1235 (step 2)" in text
  assert "20 ms mean" in text and "1500 ms, with compilation" in text
  assert "throughput    500 samples/s" in text
  assert "skipped       1 updates (steps 1)" in text
  table = text.splitlines()[-2:]
  assert table[0].split() == ["epoch", "loss", "acc", "seconds", "steps_per_s",
                              "samples_per_s", "eval_loss"]
  assert table[1].split() == ["0", "1.041", "0.1", "1.54", "1.948", "19.48", "0.2"]
  assert History().summary() == "steps         0"


@pytest.fixture
def agg():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  return matplotlib


def _line(ax, gid):
  lines = [l for l in ax.get_lines() if l.get_gid() == gid]
  assert len(lines) == 1, [l.get_gid() for l in ax.get_lines()]
  return lines[0]


def test_plot_two_panels(agg):
  h = _history([3.0, 2.0, 2.5, 1.0, 0.5], start=10, seconds=0.004, skipped=(12,))
  h.step_times[0] = 2.0
  h.record_eval(14, {"loss": 0.75})
  fig = h.plot(smoothing=2)
  assert isinstance(fig, agg.figure.Figure)
  loss_ax, time_ax = fig.axes
  assert (loss_ax.get_xlabel(), loss_ax.get_ylabel()) == ("step", "loss")
  assert (time_ax.get_xlabel(), time_ax.get_ylabel()) == ("step", "step time (ms)")
  assert loss_ax.get_title() and time_ax.get_title()
  raw = _line(loss_ax, "train_loss")
  assert list(raw.get_xdata()) == [10, 11, 12, 13, 14]
  assert list(raw.get_ydata()) == h.losses
  assert list(_line(loss_ax, "train_loss_mean").get_ydata()) == [3.0, 2.5, 2.25, 1.75, 0.75]
  assert list(_line(loss_ax, "eval_loss").get_ydata()) == [0.75]
  assert list(_line(loss_ax, "skipped").get_xdata()) == [12]
  assert loss_ax.get_legend() is not None
  assert list(_line(time_ax, "step_time").get_ydata()) == pytest.approx([2000, 4, 4, 4, 4])
  assert time_ax.get_ylim()[1] < 10  # the compiling step is off the scale
  buf = io.BytesIO()
  fig.savefig(buf, format="png")
  assert buf.getvalue().startswith(b"\x89PNG")


def test_plot_on_given_axes_and_with_non_finite_losses(agg):
  from matplotlib.figure import Figure
  fig = Figure()
  ax = fig.add_subplot()
  h = _history([1.0, float("nan"), float("inf"), 0.5])
  assert h.plot(ax=ax) is fig
  assert fig.axes == [ax]
  assert ax.get_ylabel() == "loss"
  np.testing.assert_array_equal(_line(ax, "train_loss").get_ydata(), h.losses)
  fig.savefig(io.BytesIO(), format="png")
  History().plot().savefig(io.BytesIO(), format="png")  # empty history draws too
  with pytest.raises(ValueError, match="got 0"):
    h.plot(smoothing=0)


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
  import builtins
  real_import = builtins.__import__

  def fake_import(name, *args, **kwargs):
    if name.startswith("matplotlib"):
      raise ImportError(f"No module named {name!r}")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", fake_import)
  with pytest.raises(ImportError, match=r"pip install 'tunedjax\[plot\]'"):
    _history([1.0]).plot()
