"""Runs the notebooks top to bottom and saves their outputs in the files.

    .venv/bin/python notebooks/execute.py                 # every notebook, full sizes
    .venv/bin/python notebooks/execute.py 03_kernels_and_cache.ipynb
    TUNEDJAX_NOTEBOOK_QUICK=1 .venv/bin/python notebooks/execute.py --check   # the tests' run

Each notebook runs in a fresh kernel (this Python's ``python3``) with the
notebook folder as its working directory and a private tuning cache, so a run
never reads or writes ``~/.cache/tunedjax``. ``--check`` executes without
writing anything back (what `tests/test_notebooks.py` does, with
``TUNEDJAX_NOTEBOOK_QUICK=1`` for small sizes).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent
CELL_TIMEOUT_S = 600


def notebooks() -> list[pathlib.Path]:
  """The notebooks in order: 01_..., 02_..., ..."""
  return sorted(HERE.glob("[0-9][0-9]_*.ipynb"))


def execute(path: pathlib.Path, *, write: bool) -> float:
  """Executes one notebook; returns seconds. Raises on any cell error."""
  nb = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="tunedjax-nb-") as cache:
    old = os.environ.get("TUNEDJAX_CACHE_DIR")
    os.environ["TUNEDJAX_CACHE_DIR"] = cache
    try:
      client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                       resources={"metadata": {"path": str(HERE)}})
      client.execute()
    finally:
      if old is None:
        os.environ.pop("TUNEDJAX_CACHE_DIR", None)
      else:
        os.environ["TUNEDJAX_CACHE_DIR"] = old
  if write:
    nbformat.write(nb, path)
  return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help="notebook file names (default: all)")
  parser.add_argument("--check", action="store_true", help="execute without saving outputs")
  args = parser.parse_args(argv)
  paths = [HERE / n for n in args.names] if args.names else notebooks()
  for path in paths:
    seconds = execute(path, write=not args.check)
    print(f"{path.name}: ran in {seconds:.1f} s" + ("" if args.check else ", outputs saved"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
