"""Progress: mode choice, log throttling by a fake clock, the bar, off, messages."""

from __future__ import annotations

import io
import sys
import types

import pytest

import tunedjax as tj
from tunedjax.trainer._progress import Progress
from tunedjax.trainer._progress import si


class _Clock:
  """A clock the test moves by hand."""

  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


class _Tty(io.StringIO):

  def isatty(self) -> bool:
    return True


def test_auto_is_log_on_a_non_terminal_stream():
  out = io.StringIO()
  assert not out.isatty()
  p = Progress(total=10, stream=out)
  assert p.mode == "log"
  p.close()


def test_auto_is_bar_on_a_terminal():
  out = _Tty()
  with Progress(total=10, stream=out) as p:
    assert p.mode == "bar"
    p.update(1, loss=0.5)
  assert "1/10" in out.getvalue()


def test_auto_is_bar_inside_an_ipython_kernel(monkeypatch):
  shell = types.SimpleNamespace(kernel=object())
  monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
  fake_ipython = types.ModuleType("IPython")
  fake_ipython.get_ipython = lambda: shell
  monkeypatch.setitem(sys.modules, "IPython", fake_ipython)
  out = io.StringIO()  # not a terminal, but the kernel wins
  with Progress(total=3, stream=out) as p:
    assert p.mode == "bar"
    p.update(1, loss=0.25)
  assert "loss=0.25" in out.getvalue()  # tqdm.auto falls back to the text bar here
  from tunedjax.trainer import _progress
  assert _progress._in_notebook()
  shell.__dict__.pop("kernel")  # a terminal IPython: no kernel
  assert not _progress._in_notebook()
  monkeypatch.delitem(sys.modules, "IPython")  # never imported by us
  assert not _progress._in_notebook()
  assert "IPython" not in sys.modules


def test_log_mode_throttles_by_the_clock():
  out, clock = io.StringIO(), _Clock()
  p = Progress(total=None, mode="log", log_every_s=10, stream=out, clock=clock)
  for t in range(26):
    clock.t = float(t)
    p.update(t + 1, loss=1.0 / (t + 1))
  assert out.getvalue().splitlines() == [
      "train step 1 loss 1",
      "train step 11 loss 0.09091",
      "train step 21 loss 0.04762",
  ]
  p.close()
  p.close()  # idempotent: the final line once
  assert out.getvalue().splitlines()[3:] == ["train step 26 loss 0.03846"]
  assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_log_mode_line_format_and_the_last_step_prints_at_once():
  out, clock = io.StringIO(), _Clock()
  with Progress(total=1000, mode="log", stream=out, clock=clock, desc="fit") as p:
    p.update(120, loss=0.43214, samples_per_s=1234.0, phase="apply", n=120, lr=1e-3,
             note="warm")
    clock.t = 1.0
    p.update(500, loss=0.3, n=380)  # held back
    clock.t = 2.0
    p.update(1000, loss=0.2, n=500)  # the last step: printed now
  assert out.getvalue().splitlines() == [
      "fit step 120/1000 (12%) loss 0.4321 1.23k samples/s phase apply lr 0.001 note warm",
      "fit step 1000/1000 (100%) loss 0.2",
  ]


def test_log_mode_flushes_each_line():
  class _Counting(io.StringIO):
    flushes = 0

    def flush(self):
      type(self).flushes += 1
      super().flush()

  out = _Counting()
  p = Progress(total=5, mode="log", stream=out, clock=_Clock())
  p.update(1)
  p.message("hello")
  assert _Counting.flushes == 2
  assert out.getvalue() == "train step 1/5 (20%)\nhello\n"


def test_close_without_updates_prints_nothing():
  out = io.StringIO()
  Progress(total=5, mode="log", stream=out).close()
  assert out.getvalue() == ""


def test_bar_mode_writes_the_postfix_to_the_given_stream():
  out = io.StringIO()
  with Progress(total=4, mode="bar", stream=out, desc="fit") as p:
    assert p.mode == "bar"
    for step in range(1, 5):
      p.update(step, loss=0.123456, samples_per_s=2500.0, phase="tune", acc=0.5)
    p.message("epoch 0 done")
  text = out.getvalue()
  assert "fit" in text and "4/4" in text
  assert "loss=0.1235" in text
  assert "2.5k samples/s" in text and "phase=tune" in text and "acc=0.5" in text
  assert "epoch 0 done\n" in text
  assert p.closed


def test_bar_of_a_resumed_run_starts_where_the_run_starts():
  out = io.StringIO()
  with Progress(total=20, mode="bar", stream=out) as p:
    p.update(11, n=1)
    assert p._bar.n == 11 and p._bar.initial == 10
  assert "11/20" in out.getvalue()


def test_off_mode_writes_nothing():
  out = io.StringIO()
  with Progress(total=3, mode="off", stream=out) as p:
    p.update(1, loss=1.0)
    p.message("hidden")
    p.update(3, loss=0.5, n=2)
  assert out.getvalue() == ""


def test_bad_arguments():
  with pytest.raises(ValueError, match=r"'auto', 'bar', 'log', 'off'.*got 'fancy'"):
    Progress(total=3, mode="fancy")
  with pytest.raises(tj.ConfigError, match="got -1"):
    Progress(total=-1)
  with pytest.raises(tj.ConfigError, match="log_every_s"):
    Progress(total=3, log_every_s=-1.0)


def test_update_after_close_raises():
  p = Progress(total=3, mode="log", stream=io.StringIO())
  p.close()
  with pytest.raises(RuntimeError, match="after close"):
    p.update(1)


@pytest.mark.parametrize("value,text", [
    (0.5, "0.5"), (12.0, "12"), (999.0, "999"), (1234.5, "1.23k"), (2.5e6, "2.5M"),
    (3e9, "3G"), (float("inf"), "inf"),
])
def test_si(value, text):
  assert si(value) == text


def test_figures_given_as_functions_are_computed_only_when_shown():
  out, clock = io.StringIO(), _Clock()
  calls = []

  def throughput():
    calls.append(clock.t)
    return 1000.0 + clock.t

  p = Progress(total=None, mode="log", log_every_s=10, stream=out, clock=clock)
  for t in range(25):
    clock.t = float(t)
    p.update(t + 1, loss=lambda t=t: 1.0 / (t + 1), samples_per_s=throughput)
  assert calls == [0.0, 10.0, 20.0]  # once per line written, not once per step
  p.close()  # the held-back line is formatted now, with its own step's figures
  assert calls[-1] == 24.0
  assert out.getvalue().splitlines() == [
      "train step 1 loss 1 1k samples/s",
      "train step 11 loss 0.09091 1.01k samples/s",
      "train step 21 loss 0.04762 1.02k samples/s",
      "train step 25 loss 0.04 1.02k samples/s",
  ]


def test_bar_postfix_is_formatted_once_per_redraw_and_shows_the_last_figures_at_close():
  out, clock = io.StringIO(), _Clock()
  calls = []
  with Progress(total=None, mode="bar", stream=out, clock=clock) as p:
    for step in range(1, 101):  # no clock movement: one redraw interval
      p.update(step, loss=lambda step=step: calls.append(step) or 1.0 / step)
    assert calls == [1]
  assert calls == [1, 100]  # close shows the last update's figures
  assert "loss=0.01" in out.getvalue()
