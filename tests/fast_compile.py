"""The XLA flags `make test`'s parallel phase compiles with, for the jaxlib at hand.

Its tests check what programs compute, not how fast they run, and most of the
suite's time is XLA compiling small programs, so that phase trades run-time
speed for compile time (the serial phase, which times, compiles as users do).
A flag this jaxlib does not know would abort XLA at start-up, so each candidate
is tried in a child process first.

Run by the Makefile: `python tests/fast_compile.py auto` prints the candidates
this jaxlib knows on one line; any other arguments are printed as they are
(`make test FAST_COMPILE="--xla_backend_optimization_level=0"`); none, nothing
(`make test FAST_COMPILE=`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

CANDIDATES = (
    # LLVM without its optimisations; XLA's HLO passes all still run.
    "--xla_backend_optimization_level=0",
    # jaxlib 0.10 (Python 3.11): the loop emitters instead of the MLIR fusion
    # emitters compile a test's program in ~0.6x the CPU time (later jaxlibs
    # have only the fusion emitters and no such flag).
    "--xla_cpu_use_fusion_emitters=false",
)


def known(flags: Sequence[str], python: str = sys.executable) -> bool:
  """Whether XLA starts with `flags` (it aborts on a flag it does not know)."""
  env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
  probe = subprocess.run([python, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, timeout=300)
  return probe.returncode == 0


def fast_compile_flags(requested: Sequence[str]) -> list[str]:
  """The flags to compile with: `requested` as given, or for ["auto"] the
  `CANDIDATES` this jaxlib knows."""
  if list(requested) != ["auto"]:
    return list(requested)
  if known(CANDIDATES):
    return list(CANDIDATES)
  return [flag for flag in CANDIDATES if known([flag])]


if __name__ == "__main__":
  print(" ".join(fast_compile_flags(sys.argv[1:])))
