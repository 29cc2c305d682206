"""Results and rendering: a result object, ratio tables, the machine-and-load line,
and the BENCHMARKS.md section a benchmark rewrites."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
from collections.abc import Mapping
from typing import Any

from .timing import Timings

BENCHMARKS_MD = pathlib.Path(__file__).resolve().parents[2] / "BENCHMARKS.md"


@dataclasses.dataclass
class Result:
  """What one benchmark run measured: `render` turns it into its section.

  Attributes:
    name: the benchmark's registry name.
    params: what was run (rounds, shapes, flags).
    timings: named `Timings` (interleaved rounds).
    figures: any other measured numbers, JSON-ready.
    machine: `machine_line()` at the start of the run.
    load: the 1-minute load average before and after the run.
  """

  name: str
  params: dict[str, Any] = dataclasses.field(default_factory=dict)
  timings: dict[str, Timings] = dataclasses.field(default_factory=dict)
  figures: dict[str, Any] = dataclasses.field(default_factory=dict)
  machine: str = dataclasses.field(default_factory=lambda: machine_line())
  load: list[float] = dataclasses.field(default_factory=lambda: [os.getloadavg()[0]])

  def done(self) -> "Result":
    """Records the load at the end of the run; returns self."""
    self.load = [self.load[0], os.getloadavg()[0]]
    return self

  def load_line(self) -> str:
    """The load beside the figures: the machine is shared."""
    loads = " -> ".join(f"{x:.2f}" for x in self.load)
    return f"Load average (1 min) {loads}; the machine was shared."

  def to_json(self) -> str:
    timings = {k: {"baseline": t.baseline, "runs": dict(t.runs)} for k, t in self.timings.items()}
    return json.dumps({"name": self.name, "params": self.params, "timings": timings,
                       "figures": self.figures, "machine": self.machine, "load": self.load},
                      indent=1, default=str)


def ratio_table(t: Timings, *, unit: str = "ms", scale: float = 1e3,
                notes: Mapping[str, str] | None = None) -> str:
  """A markdown table: median time, ratio to baseline, per-round spread."""
  notes = notes or {}
  lines = [f"| variant | median ({unit}) | ratio to baseline | per-round range | note |",
           "|---|---:|---:|---:|---|"]
  for name in t.runs:
    lo, hi = t.spread(name)
    lines.append(f"| {name} | {t.median(name) * scale:.1f} | {t.ratio(name):.3f} | "
                 f"{lo:.2f}-{hi:.2f} | {notes.get(name, '')} |")
  return "\n".join(lines)


def machine_line() -> str:
  """Where and when a table was measured."""
  cpu = platform.processor() or platform.machine()
  try:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  import jax  # pylint: disable=import-outside-toplevel  (a GPU driver must not start a backend)
  today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
  return (f"Measured {today} on {os.cpu_count()} cores of {cpu}, "
          f"{jax.default_backend()} backend, jax {jax.__version__}.")


def write_section(name: str, body: str, path: pathlib.Path = BENCHMARKS_MD) -> None:
  """Replaces the section between `<!-- name:start -->` and `<!-- name:end -->`
  in BENCHMARKS.md with `body`, or appends it."""
  start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
  block = f"{start}\n{body.strip()}\n{end}"
  text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
  pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
  if pattern.search(text):
    text = pattern.sub(lambda _: block, text)
  else:
    text = text.rstrip() + "\n\n" + block + "\n"
  path.write_text(text, encoding="utf-8")
