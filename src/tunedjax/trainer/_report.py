"""What the tuners chose, as JSON-able dicts for `History.tuning`."""

from __future__ import annotations

from typing import Any

from tunedjax.autotune._report import VERIFYING
from tunedjax.input_pipeline import TuningResult


def loader_summary(result: TuningResult) -> dict[str, Any]:
  """The loader tuner's choice and every trial it measured.

  Example:
    >>> from tunedjax.input_pipeline import TuningResult
    >>> r = TuningResult(worker_count=2, read_threads=1, batches_per_s=40.0, start=(0, 16),
    ...                  trials=(), seconds=3.0, batches=100, stopped="converged")
    >>> loader_summary(r)["worker_count"]
    2
  """
  return {
      "worker_count": result.worker_count, "read_threads": result.read_threads,
      "batches_per_s": result.batches_per_s, "from_cache": result.from_cache,
      "seconds": result.seconds, "stopped": result.stopped,
      "reason": result.reason, "step_s": result.step_s, "batch_s": result.batch_s,
      "trials": [{"worker_count": t.worker_count, "read_threads": t.read_threads,
                  "batches_per_s": t.batches_per_s, "phase": t.phase}
                 for t in result.trials],
  }


def jit_summary(jitted: Any) -> dict[str, Any]:
  """What `tunedjax.jit` did to the training step's latest signature.

  Of the programs compiled for it, the latest outside kernel selection's
  observe phase (which runs xla everywhere before tuning starts) and the
  variants the whole-program check compared; ``"verification"`` says what
  that check found (`Jitted.verification`): decisions it undid run their
  default although ``"kernels"`` lists the tuned program's choices.
  ``"first_call"`` is where that program's first call spent its time
  (`tunedjax.FirstCall.as_dict`: ``total_s`` and seconds per stage), and
  ``"first_calls"`` the same for every signature compiled, oldest first.
  """
  report = jitted.report(memory=False)
  if not len(report):
    return {}
  # The program the run ends with: not the observe phase's (all xla), even
  # when that one was compiled last (the loader's tuning compiles ahead).
  selected = [r for r in report if r.kernel_report is None or not (
      r.kernel_report.observed or any(c.why == VERIFYING for c in r.kernel_report.choices))]
  last = selected[-1] if selected else report.last
  layout = last.layout
  return {
      "level": last.level,
      "passes": list(last.passes),
      "kernels": dict(last.kernels),
      "kernel_cache_hits": last.cache_hits,
      "kernel_cache_misses": last.cache_misses,
      "layout": None if layout is None else {"decision": layout.decision,
                                             "target": layout.target,
                                             "reason": layout.reason},
      "casts": dict(last.casts),
      "tuning_s": last.tuning_s,
      "verification": jitted.verification(),
      "first_call": None if last.first_call is None else last.first_call.as_dict(),
      "first_calls": [{"signature": r.signature, **r.first_call.as_dict()}
                      for r in report if r.first_call is not None],
  }
