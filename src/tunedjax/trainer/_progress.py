"""`Progress`: a tqdm bar in terminals and notebooks, throttled log lines elsewhere."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from tunedjax._errors import ConfigError

MODES = ("auto", "bar", "log", "off")


def _in_notebook() -> bool:
  """True inside a Jupyter/IPython kernel; never imports IPython itself."""
  if "ipykernel" not in sys.modules:
    return False
  ipython = sys.modules.get("IPython")
  get_ipython = getattr(ipython, "get_ipython", None)
  if get_ipython is None:
    return False
  try:
    shell = get_ipython()
  except Exception:  # pylint: disable=broad-except
    return False
  return shell is not None and hasattr(shell, "kernel")


def _isatty(stream: Any) -> bool:
  try:
    return bool(stream.isatty())
  except Exception:  # pylint: disable=broad-except  # closed or odd streams
    return False


def si(value: float) -> str:
  """3 significant digits with a k/M/G suffix: ``1234.5 -> "1.23k"``."""
  if not math.isfinite(value):
    return str(value)
  for suffix in ("", "k", "M", "G", "T"):
    if abs(value) < 999.5:
      return f"{value:.3g}{suffix}"
    value /= 1000
  return f"{value:.3g}P"


Figure = Any  # a number or a string, a function returning one, or None (not shown)


def _shown(figure: Figure) -> Any:
  """A figure's value: a function given for it is called now."""
  return figure() if callable(figure) else figure


def _value(v: Any) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


class Progress:
  """Shows training progress: a tqdm bar, plain log lines, or nothing.

  ``mode="auto"`` shows a bar when `stream` is a terminal or when running in
  a Jupyter/IPython kernel (a notebook widget, through ``tqdm.auto``), and
  plain log lines otherwise (a file, a pipe, a CI log): at most one line every
  `log_every_s` seconds, the first update's and the last one always
  written, with no carriage returns or terminal codes. ``"bar"`` and
  ``"log"`` force either; ``"off"`` writes nothing.

  Args:
    total: the step count the run ends at (the bar's 100%), or None if unknown.
    mode: "auto", "bar", "log" or "off".
    desc: the label in front of the bar or line.
    unit: what a step is called.
    log_every_s: log mode's least interval between lines, in `clock` seconds.
    stream: where to write (default: ``sys.stderr`` at construction).
    clock: the clock log mode throttles by (default `time.monotonic`).

  Attributes:
    mode: the mode in use: "bar", "log" or "off" (never "auto").

  Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with Progress(total=100, stream=out) as p:  # not a terminal: log lines
    ...   p.update(50, loss=0.123456, samples_per_s=1234.5, phase="apply", n=50)
    ...   p.update(100, loss=0.1, n=50)
    >>> print(out.getvalue(), end="")
    train step 50/100 (50%) loss 0.1235 1.23k samples/s phase apply
    train step 100/100 (100%) loss 0.1
  """

  def __init__(self, *, total: int | None, mode: str = "auto", desc: str = "train",
               unit: str = "step", log_every_s: float = 10.0,
               stream: IO[str] | None = None,
               clock: Callable[[], float] = time.monotonic):
    if mode not in MODES:
      raise ConfigError(f"Progress(mode=...) must be one of {', '.join(map(repr, MODES))}; "
                        f"got {mode!r}.")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool)
                              or total < 0):
      raise ConfigError(f"Progress(total=...) must be an int >= 0 or None, got {total!r}.")
    if not isinstance(log_every_s, (int, float)) or log_every_s < 0:
      raise ConfigError(f"Progress(log_every_s=...) must be a number >= 0, got "
                        f"{log_every_s!r}.")
    self._stream = sys.stderr if stream is None else stream
    self._total = total
    self._desc = desc
    self._unit = unit
    self._log_every_s = float(log_every_s)
    self._clock = clock
    notebook = _in_notebook()
    if mode == "auto":
      mode = "bar" if notebook or _isatty(self._stream) else "log"
    self.mode = mode
    self._closed = False
    self._last_print: float | None = None  # clock time of the last log line / bar postfix
    # The figures of an update not shown yet: log mode's held-back line, or
    # the bar's postfix between refreshes (formatted only when shown).
    self._pending: tuple[int, tuple[Any, ...]] | None = None
    self._started = False
    self._bar: Any = None
    if mode == "bar":
      if notebook:
        from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      else:
        from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._stream,
                       dynamic_ncols=True)

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  @property
  def closed(self) -> bool:
    """Whether `close` has run."""
    return self._closed

  def _postfix(self, loss: Figure, samples_per_s: Figure, phase: Figure,
               extra: dict[str, Any], sep: str) -> list[str]:
    loss, samples_per_s, phase = _shown(loss), _shown(samples_per_s), _shown(phase)
    extra = {k: _shown(v) for k, v in extra.items()}
    parts = []
    if loss is not None:
      parts.append(f"loss{sep}{float(loss):.4g}")
    if samples_per_s is not None:
      parts.append(f"{si(float(samples_per_s))} samples/s")
    if phase is not None:
      parts.append(f"phase{sep}{phase}")
    parts.extend(f"{k}{sep}{_value(v)}" for k, v in extra.items())
    return parts

  def update(self, step: int, *, loss: Figure = None, samples_per_s: Figure = None,
             phase: Figure = None, n: int = 1, **extra: Figure) -> None:
    """Advances by `n` steps and shows the latest figures.

    Each figure may be given as a function of no arguments instead of a
    value: it is called only if the figures are shown (a log line is
    written, the bar's postfix is refreshed), so a figure that costs host
    time is not computed on every step. Figures are formatted only when shown.

    Args:
      step: the global step count after this update (the 120 of "step
        120/1000"); a resumed run's bar starts at ``step - n``.
      loss: the latest training loss (shown with 4 significant digits).
      samples_per_s: the throughput.
      phase: what the tuners are doing, e.g. "observe", "tune", "apply" or
        "tuning loader".
      n: how many steps this update covers (0 to only refresh the figures).
      **extra: more figures to show, by name.

    Raises:
      RuntimeError: the progress is closed.
    """
    if self._closed:
      raise RuntimeError("Progress.update() after close(); make a new Progress.")
    if self.mode == "off":
      return
    figures = (loss, samples_per_s, phase, extra)
    now = self._clock()
    last = self._total is not None and step >= self._total
    due = self._last_print is None or last
    if self.mode == "bar":
      bar = self._bar
      if not self._started and step - n > 0:
        # A resumed run: start the bar where the run starts; tqdm's rate
        # counts from `initial`.
        bar.initial = bar.n = bar.last_print_n = step - n
      self._started = True
      # tqdm redraws at most every `mininterval` seconds: the postfix is
      # formatted as often, and the held figures at `close`.
      if due or now - self._last_print >= bar.mininterval:
        self._set_postfix(figures)
        self._last_print, self._pending = now, None
      else:
        self._pending = (step, figures)
      bar.update(n)
      return
    if due or now - self._last_print >= self._log_every_s:
      self._write(self._line(step, figures))
      self._last_print, self._pending = now, None
    else:
      self._pending = (step, figures)

  def _set_postfix(self, figures: tuple[Any, ...]) -> None:
    loss, samples_per_s, phase, extra = figures
    self._bar.set_postfix_str(", ".join(self._postfix(loss, samples_per_s, phase, extra, "=")),
                              refresh=False)

  def _line(self, step: int, figures: tuple[Any, ...]) -> str:
    loss, samples_per_s, phase, extra = figures
    line = f"{self._desc} {self._unit} {step}"
    if self._total is not None:
      line += f"/{self._total}"
      if self._total > 0:
        line += f" ({100 * step // self._total}%)"
    return " ".join([line, *self._postfix(loss, samples_per_s, phase, extra, " ")])

  def _write(self, line: str) -> None:
    self._stream.write(line + "\n")
    self._stream.flush()

  def message(self, text: str) -> None:
    """Writes a line of text without breaking the bar (nothing in "off" mode)."""
    if self.mode == "off":
      return
    if self._bar is not None and not self._closed:
      self._bar.write(text, file=self._stream)
    else:
      self._write(text)

  def close(self) -> None:
    """Ends the bar, or writes log mode's last line if it was held back.

    Calling it again does nothing.
    """
    if self._closed:
      return
    self._closed = True
    pending, self._pending = self._pending, None
    if self._bar is not None:
      if pending is not None:
        self._set_postfix(pending[1])
      self._bar.close()
    elif pending is not None:
      self._write(self._line(*pending))
