"""The benchmarks' one harness: timing, worker processes, results, a registry.

- `timing`: interleaved rounds in a rotated order, an A/A control, a first call.
- `workers`: a variant per process, one protocol (records in JSON lines, a time
  limit, the stack of a worker that hung), a user's environment.
- `report`: `Result` (what a run measured), ratio tables, the machine line, and
  writing a section of BENCHMARKS.md.
- `registry`: every benchmark, which sections it writes, where its smoke run
  is (`make test` or `make bench-smoke`) and whether `make bench` runs it.
- `saved`: a result saved with ``--json`` (on a device) rendered and written here.

`benchmarks/run.py NAME|all [--quick] [--write] [--json]` is the one command line.

Adding a benchmark (``benchmarks/NAME.py``):

1. Write ``measure(quick: bool) -> harness.Result`` (time the variants with
   `interleaved`, put the timings and any other figures in the result) and
   ``render(result) -> str`` (the section's Markdown, with ``result.machine``
   and ``result.load_line()``; a benchmark that writes several sections
   returns ``{section: markdown}``). No argparse, no file I/O.
2. Add ``Benchmark("NAME", smoke=...)`` to `registry.BENCHMARKS` and the
   section's two markers to BENCHMARKS.md (``<!-- NAME:start -->``,
   ``<!-- NAME:end -->``). tests/test_docs.py then smoke-runs it and checks
   the markers; `make bench` runs it when ``bench=True``.

For example::

  def measure(quick):
    t = harness.interleaved({"jax.jit": f, "tj.jit": g}, baseline="jax.jit",
                            rounds=2 if quick else 9)
    return harness.Result("NAME", params={"quick": quick}, timings={"step": t})

  def render(result):
    return "\\n".join(["## NAME", result.machine, result.load_line(), "",
                      harness.ratio_table(result.timings["step"])])
"""

from .report import BENCHMARKS_MD, Result, machine_line, ratio_table, write_section
from .timing import CONTROL, Timings, first_call, interleaved, rotated

__all__ = ["BENCHMARKS_MD", "CONTROL", "Result", "Timings", "first_call", "interleaved",
           "machine_line", "ratio_table", "rotated", "write_section"]
