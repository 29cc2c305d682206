"""`tj.jit`'s report book: what each pass did per signature, and first calls.

`SignatureReport` (one per compiled program and signature), `JitReport`
(`Jitted.report()`), `MemoryFigures`, and `ReportBook`, which files a report
per trace, the first call's stages on it, and memory figures on request.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from tunedjax import _errors
from tunedjax import _pipeline
from tunedjax import _tuning
from tunedjax._tuning import _anatomy
from tunedjax.autotune._report import KernelReport
from tunedjax.layout._report import LayoutReport

logger = logging.getLogger("tunedjax.jit")

PassReport = _pipeline.PassReport


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
  """What the compiled program needs, from `compiled.memory_analysis()`.

  Attributes:
    argument_bytes: inputs (parameters, optimizer state, batch).
    output_bytes: outputs.
    temp_bytes: temporaries (activations and intermediates).
    alias_bytes: outputs that reuse donated inputs.
    generated_code_bytes: the executable's code.
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  generated_code_bytes: int

  @classmethod
  def from_compiled(cls, compiled: Any) -> MemoryFigures | None:
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report memory
      return None
    return cls(argument_bytes=int(stats.argument_size_in_bytes),
               output_bytes=int(stats.output_size_in_bytes),
               temp_bytes=int(stats.temp_size_in_bytes),
               alias_bytes=int(stats.alias_size_in_bytes),
               generated_code_bytes=int(stats.generated_code_size_in_bytes))

  def __str__(self) -> str:
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # pylint: disable=unnecessary-lambda-assignment
    return (f"arguments {mib(self.argument_bytes)}, outputs {mib(self.output_bytes)}, "
            f"temporaries {mib(self.temp_bytes)}, aliased {mib(self.alias_bytes)}")


@dataclasses.dataclass(frozen=True)
class SignatureReport:
  """What `tunedjax.jit` did for one input signature: one typed report per pass.

  Attributes:
    signature: the traced input types and static values.
    level: ``"O0"``, ``"O1"`` or ``"O2"``.
    reports: one report per pass that ran, in order: `AutocastReport`,
      `LayoutReport`, `KernelReport`, `CleanupReport` (each has a ``name``
      and the seconds it spent tuning, ``tuning_s``).
    trace_s: seconds to trace the function and run the passes (compiling
      not included).
    memory: the compiled program's `MemoryFigures` (filled by `report()`).
    first_call: where the wall time of the call that traced this signature
      went, seconds per stage (`tunedjax.FirstCall`); None when no call
      traced it (``lower``, ``trace``, a call under another transformation
      such as `jax.grad`, or inside another `tunedjax.jit` function).

  The properties below read the typed reports: `passes`, `policy`, `casts`,
  `layout`, `kernel_report`, `kernels`, `cache_hits`, `cache_misses`,
  `tuning_s`, `cleanup`.
  """

  signature: str
  level: str
  reports: tuple[PassReport, ...] = ()
  trace_s: float = 0.0
  memory: MemoryFigures | None = None
  first_call: _tuning.FirstCall | None = None

  def report(self, name: str) -> PassReport | None:
    """The report of the pass called `name` (``"layout"``, ...), or None if it did not run."""
    for r in self.reports:
      if r.name == name:
        return r
    return None

  @property
  def passes(self) -> tuple[str, ...]:
    """The passes that ran, in order."""
    return tuple(r.name for r in self.reports)

  @property
  def policy(self) -> str | None:
    """The mixed-precision policy, or None when that pass did not run."""
    r = self.report("mixed_precision")
    return None if r is None else r.policy

  @property
  def casts(self) -> Mapping[str, int]:
    """The autocast pass's counters (casts inserted, ops per dtype)."""
    r = self.report("mixed_precision")
    return {} if r is None else dict(r.casts)

  @property
  def layout(self) -> LayoutReport | None:
    """The layout pass's `LayoutReport`, or None when it did not run."""
    return self.report("layout")

  @property
  def kernel_report(self) -> KernelReport | None:
    """Kernel selection's `KernelReport`, or None when it did not run."""
    return self.report("kernel_selection")

  @property
  def kernels(self) -> Mapping[str, int]:
    """``{"<op> <kernel> (<why>)": count}`` for display (read `kernel_report` in code)."""
    r = self.kernel_report
    return {} if r is None else dict(r.counts())

  @property
  def cache_hits(self) -> int:
    """Kernel buckets found in the tuning cache."""
    r = self.kernel_report
    return 0 if r is None else r.hits

  @property
  def cache_misses(self) -> int:
    """Kernel buckets not found (tuned now, or the default in the apply phase)."""
    r = self.kernel_report
    return 0 if r is None else r.misses

  @property
  def tuning_s(self) -> float:
    """Seconds spent tuning kernels and measuring layouts in this trace."""
    return float(sum(r.tuning_s for r in self.reports))

  @property
  def cleanup(self) -> Mapping[str, int]:
    """The cleanup pass's counters (casts and transposes folded)."""
    r = self.report("cleanup")
    return {} if r is None else dict(r.folded)

  @property
  def hit_rate(self) -> float:
    """cache_hits / (cache_hits + cache_misses); 1.0 when nothing was looked up."""
    total = self.cache_hits + self.cache_misses
    return self.cache_hits / total if total else 1.0

  def __str__(self) -> str:
    lines = [f"signature {self.signature}  (level {self.level})",
             f"  passes: {', '.join(self.passes) or 'none'}; traced and rewritten in "
             f"{self.trace_s:.3f} s"]
    for r in self.reports:
      if isinstance(r, LayoutReport):
        lines.append(f"  layout: {r.decision} -> {r.target} ({r.reason}); {_counts(r.counts)}")
      elif isinstance(r, KernelReport):
        lines.append(f"  kernels: {r}")
      elif isinstance(r, _pipeline.CleanupReport) and not r.folded:
        continue
      else:
        lines.append(f"  {r}")
    if self.memory is not None:
      lines.append(f"  memory: {self.memory}")
    if self.first_call is not None:
      lines += [f"  {line}" for line in str(self.first_call).splitlines()]
    return "\n".join(lines)


def _counts(counts: Mapping[str, int]) -> str:
  return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "nothing to do"


@dataclasses.dataclass(frozen=True)
class JitReport:
  """`Jitted.report()`: one `SignatureReport` per signature compiled, oldest first.

  Iterate over it, index it, or ``print`` it.
  """

  function: str
  signatures: tuple[SignatureReport, ...]

  def __iter__(self):
    return iter(self.signatures)

  def __len__(self) -> int:
    return len(self.signatures)

  def __getitem__(self, i: int) -> SignatureReport:
    return self.signatures[i]

  @property
  def last(self) -> SignatureReport:
    """The most recently traced signature."""
    if not self.signatures:
      raise _errors.TunedJaxError(
          f"tunedjax.jit({self.function}) has not been called yet: nothing to report.")
    return self.signatures[-1]

  def __str__(self) -> str:
    if not self.signatures:
      return f"tunedjax.jit({self.function}): not called yet."
    return "\n".join([f"tunedjax.jit({self.function}): {len(self.signatures)} signature(s)"]
                     + [str(s) for s in self.signatures])


class ReportBook:
  """The reports of one `Jitted`: one per (program key, signature), oldest
  first, with the abstract arguments that traced it (for memory figures)
  and the first calls being recorded (`_anatomy.Pending`).

  Example:
    >>> book = ReportBook("f")
    >>> book.report(lambda key: None).function
    'f'
  """

  def __init__(self, name: str):
    self.name = name
    self.firsts = _anatomy.Pending()  # first calls being recorded (`first_call_done`)
    self._lock = threading.Lock()
    # Per (compiled program key, signature): a config change is a new entry.
    self._reports: dict[tuple[Hashable, str], SignatureReport] = {}
    self._abstract: dict[tuple[Hashable, str], tuple[Hashable, tuple[Any, Any]]] = {}

  def file(self, key: tuple[Hashable, str], report: SignatureReport,
           abstract: tuple[Any, Any]) -> None:
    """Files the report of a trace (`key`: its program key and signature) and
    labels the first call recording it."""
    with self._lock:
      self._reports.pop(key, None)
      self._reports[key] = report
      self._abstract[key] = (key[0], abstract)
    _anatomy.label(self.firsts, key)
    logger.info("tunedjax.jit(%s):\n%s", self.name, report)

  def first_call_done(self, out: Any) -> Any:
    """Files this thread's first-call record, if this call traced one, on its
    signature's report (`_anatomy.finish`: blocks on a first call's outputs)."""
    done = _anatomy.finish(self.firsts, out)
    if done is not None:
      key, first_call = done
      with self._lock:
        if key in self._reports:
          self._reports[key] = dataclasses.replace(self._reports[key], first_call=first_call)
    return out

  def report(self, program_of: Callable[[Hashable], Any], *, memory: bool = True) -> JitReport:
    """The `JitReport`; with `memory`, each program's memory figures
    (`program_of`: the compiled function of a program key, or None)."""
    with self._lock:
      items = list(self._reports.items())
      abstract = dict(self._abstract)
    out = []
    for key, rep in items:
      if memory and rep.memory is None and key in abstract:
        figures = self._memory_of(program_of(abstract[key][0]), abstract[key][1])
        if figures is not None:
          rep = dataclasses.replace(rep, memory=figures)
          with self._lock:
            if self._reports.get(key) is not None:
              rep = self._reports[key] = dataclasses.replace(self._reports[key], memory=figures)
      out.append(rep)
    return JitReport(self.name, tuple(out))

  def _memory_of(self, fn: Any, saved: tuple[Any, Any]) -> MemoryFigures | None:
    (d_args, d_kwargs), static = saved
    if fn is None:
      return None
    args = list(d_args)
    for i in sorted(k for k in static if isinstance(k, int)):
      args.insert(i, static[i])
    kwargs = {**d_kwargs, **{k: v for k, v in static.items() if isinstance(k, str)}}
    try:
      with _anatomy.not_a_call():
        return MemoryFigures.from_compiled(fn.lower(*args, **kwargs).compile())
    except Exception as e:  # pylint: disable=broad-except  # a report never fails a job
      logger.debug("tunedjax.jit: no memory figures for %s (%s)", self.name, e)
      return None
