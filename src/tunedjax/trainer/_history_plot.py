"""`History.plot`: the loss and step-time curves of a `History`, with matplotlib."""

from __future__ import annotations

import math
from typing import Any

PLOT_HINT = "History.plot() needs matplotlib: pip install 'tunedjax[plot]'"


def plot(history: Any, *, ax: Any = None, smoothing: int = 1) -> Any:
  """Draws `history`'s loss and step-time curves: `History.plot`, which
  documents it (matplotlib is optional, so there is no doctest here)."""
  try:
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(PLOT_HINT) from e
  if not isinstance(smoothing, int) or isinstance(smoothing, bool) or smoothing < 1:
    raise ValueError(f"History.plot(smoothing=...) must be an int >= 1, got "
                     f"{smoothing!r}.")
  if ax is None:
    fig = Figure(figsize=(11, 4), layout="constrained")
    loss_ax, time_ax = fig.subplots(1, 2)
    _plot_loss(history, loss_ax, smoothing)
    _plot_step_time(history, time_ax)
    return fig
  _plot_loss(history, ax, smoothing)
  return ax.figure


def _plot_loss(history: Any, ax: Any, smoothing: int) -> None:
  smoothed = smoothing > 1 and len(history.losses) > 1
  ax.plot(history.steps, history.losses, color="C0", alpha=0.3 if smoothed else 1.0,
          linewidth=1, label="train loss", gid="train_loss")
  if smoothed:
    ax.plot(history.steps, _moving_average(history.losses, smoothing), color="C0",
            linewidth=2, label=f"train loss ({smoothing}-step mean)", gid="train_loss_mean")
  evals = [(e["step"], e["loss"]) for e in history.evals if "loss" in e]
  if evals:
    ax.plot([s for s, _ in evals], [v for _, v in evals], "o", color="C1",
            label="eval loss", gid="eval_loss")
  if history.skipped:
    # x in data coordinates, y in axes coordinates: the marks sit on the
    # bottom edge whatever the (possibly nan) loss was.
    ax.plot(history.skipped, [0.03] * len(history.skipped), "x", color="C3",
            transform=ax.get_xaxis_transform(), label=f"skipped update ({len(history.skipped)})",
            gid="skipped")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_title("training loss")
  ax.grid(True, alpha=0.3)
  if history.losses or evals:
    ax.legend(loc="upper right")

def _plot_step_time(history: Any, ax: Any) -> None:
  ms = [t * 1e3 for t in history.step_times]
  ax.plot(history.steps, ms, color="C2", linewidth=1, marker="." if len(ms) < 50 else None,
          label="step time", gid="step_time")
  ax.set_xlabel("step")
  ax.set_ylabel("step time (ms)")
  ax.set_title("step time")
  ax.grid(True, alpha=0.3)
  rest = [t for t in ms[1:] if math.isfinite(t)]
  if rest and ms[0] > 3 * max(rest) > 0:
    ax.set_ylim(0, 1.15 * max(rest))
    ax.text(0.98, 0.95, f"first step (compiles): {ms[0]:.4g} ms, off the scale",
            transform=ax.transAxes, ha="right", va="top", fontsize="small")


def _moving_average(values: list[float], window: int) -> list[float]:
  """Trailing mean over the last `window` finite values (nan where none)."""
  out = []
  total, count = 0.0, 0
  for i, v in enumerate(values):
    if math.isfinite(v):
      total, count = total + v, count + 1
    if i >= window:
      old = values[i - window]
      if math.isfinite(old):
        total, count = total - old, count - 1
    out.append(total / count if count else math.nan)
  return out
