"""A result saved with ``benchmarks/run.py NAME --json`` (on another machine: the
GPU's), made into its sections again here, and with ``--write`` put into BENCHMARKS.md:

  PYTHONPATH=src:benchmarks python -m harness.saved RESULT.json [--write]
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

from . import registry
from .report import Result, write_section
from .timing import Timings


def load(path: str | pathlib.Path) -> Result:
  """The `Result` that `Result.to_json` wrote."""
  d = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  d["timings"] = {k: Timings(runs=t["runs"], baseline=t["baseline"])
                  for k, t in d.get("timings", {}).items()}
  return Result(**d)


def sections(result: Result) -> dict[str, str]:
  """``{section: markdown}``: its benchmark module's `render` of it."""
  rendered = importlib.import_module(result.name).render(result)
  section = (*registry.BY_NAME[result.name].sections, result.name)[0]
  return rendered if isinstance(rendered, dict) else {section: rendered}


def main(argv: list[str]) -> int:
  if not argv or argv[0].startswith("-"):
    raise SystemExit(__doc__)
  for name, body in sections(load(argv[0])).items():
    print(body + "\n")
    if "--write" in argv:
      write_section(name, body)
      print(f"wrote {name}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
