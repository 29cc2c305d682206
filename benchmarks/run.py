"""The benchmarks' one command line.

  benchmarks/run.py NAME [NAME ...]|all [--quick] [--write] [--json]

NAME is a benchmark of `harness.registry` (``all``: every one `make bench`
runs). ``--quick`` is the smoke run (small sizes, 2 rounds), ``--write``
rewrites the benchmark's sections of BENCHMARKS.md, ``--json`` prints what was
measured as JSON instead of Markdown. Every benchmark is a module of
`measure(quick, ...)` and `render(result)`, with no options of its own: a
run other than the default (more rounds, some parts only) is a call of
`measure` with its keyword arguments, from Python. A result saved with
``--json`` (the GPU run's, on the device) is rendered and written here by
``python -m harness.saved RESULT.json [--write]``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import harness  # noqa: E402  pylint: disable=wrong-import-position
from harness import registry  # noqa: E402  pylint: disable=wrong-import-position


def run(bench: registry.Benchmark, *, quick: bool, write: bool, as_json: bool) -> int:
  """Runs one benchmark; prints (and with `write` writes) its sections."""
  module = importlib.import_module(bench.name)
  load = os.getloadavg()[0]
  result = module.measure(quick=quick)
  result.load = [load, os.getloadavg()[0]]
  if as_json:
    print(result.to_json())
    return 0
  rendered = module.render(result)  # one section's text, or {section: text}
  bodies = rendered if isinstance(rendered, dict) else {(*bench.sections, bench.name)[0]: rendered}
  for section, body in bodies.items():
    print(body)
    if write and bench.writes:  # a benchmark that prints only (writes=False) writes nothing
      harness.write_section(section, body)
      print(f"\nwrote {section} in {harness.BENCHMARKS_MD}", file=sys.stderr)
  return 0


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  names = ", ".join(registry.BY_NAME)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   epilog=f"benchmarks: {names}")
  parser.add_argument("names", nargs="+", metavar="NAME|all")
  parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 2 rounds")
  parser.add_argument("--write", action="store_true", help="rewrite its sections of BENCHMARKS.md")
  parser.add_argument("--json", action="store_true", help="print the result as JSON")
  args = parser.parse_args(argv)
  if args.names == ["all"]:
    chosen = [b for b in registry.BENCHMARKS if b.bench]
  else:
    unknown = [n for n in args.names if n not in registry.BY_NAME]
    if unknown:
      parser.error(f"unknown benchmark {', '.join(map(repr, unknown))}; valid: all, {names}")
    chosen = [registry.BY_NAME[n] for n in args.names]
  status = 0
  for bench in chosen:
    status |= run(bench, quick=args.quick, write=args.write, as_json=args.json)
  return status


if __name__ == "__main__":
  raise SystemExit(main())
