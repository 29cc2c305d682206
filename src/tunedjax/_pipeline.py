"""The pass pipeline of `tunedjax.jit`: which passes run, in order, and what each reports.

`plan(config, platform)` reads the config once and returns the stages of one
trace: mixed precision (``mixed_precision.enable``), layout
(``layout.enable``), kernel selection (``kernel.enable``; it shares one
evaluation with cleanup, since the two touch different primitives), and a
cleanup that folds the casts and transposes the others leave next to each
other. Each stage wraps the program (`Stage.apply`) and, once the program has
run, gives a typed report (`Stage.reports`): `AutocastReport`,
`LayoutReport`, `KernelReport`, `CleanupReport`. Adding a pass is adding a
stage here; nothing reads reports back from strings.

Example:
  >>> import tunedjax as tj
  >>> with tj.config_context({"layout": {"enable": True}}):
  ...   [s.name for s in plan(tj.get_config(), "cpu")]
  ['layout', 'cleanup']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tunedjax import layout as layout_lib
from tunedjax import rewrite
from tunedjax.autotune import _select
from tunedjax.autotune._report import KernelReport
from tunedjax.layout._report import LayoutReport
from tunedjax.mixed_precision._autocast import autocast_transform
from tunedjax.rewrite._cleanup import cleanup_pass

Program = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class AutocastReport:
  """The mixed-precision pass's report for one trace.

  Attributes:
    policy: the policy applied (``str(Policy)``).
    casts: the pass's counters: casts inserted, ops run per dtype.
  """

  policy: str
  casts: Mapping[str, int] = dataclasses.field(default_factory=dict)
  name = "mixed_precision"
  tuning_s = 0.0

  def __str__(self) -> str:
    return f"mixed precision [{self.policy}]: {_counts(self.casts)}"


@dataclasses.dataclass(frozen=True)
class CleanupReport:
  """The cleanup pass's report: casts and transposes folded, by kind."""

  folded: Mapping[str, int] = dataclasses.field(default_factory=dict)
  name = "cleanup"
  tuning_s = 0.0

  def __str__(self) -> str:
    return f"cleanup: {_counts(self.folded)}"


PassReport = AutocastReport | LayoutReport | KernelReport | CleanupReport


def _counts(counts: Mapping[str, int]) -> str:
  return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "nothing to do"


class Stage:
  """One pass of the pipeline, for one trace: wraps the program, then reports."""

  name = "stage"

  def apply(self, program: Program, platform: str | None) -> Program:
    raise NotImplementedError

  def reports(self) -> tuple[PassReport, ...]:
    raise NotImplementedError


class _CountingStage(Stage):
  """A stage whose report is its rewrite pass's counters."""

  def __init__(self) -> None:
    self.counts: dict[str, int] = {}

  def on_trace(self, ctx: rewrite.Context) -> None:
    self.counts = dict(ctx.counts)


class AutocastStage(_CountingStage):
  """Mixed precision: the autocast pass with the config's policy."""

  name = "mixed_precision"

  def __init__(self, policy: str):
    super().__init__()
    self.policy = policy

  def apply(self, program: Program, platform: str | None) -> Program:
    return autocast_transform(program, self.policy, platform=platform, on_trace=self.on_trace)

  def reports(self) -> tuple[PassReport, ...]:
    return (AutocastReport(self.policy, self.counts),)


class LayoutStage(Stage):
  """Layout: convolutions moved to the preferred layout (heuristic or measured)."""

  name = "layout"

  def __init__(self, mode: str):
    self.mode = mode
    self.optimized: Any = None

  def apply(self, program: Program, platform: str | None) -> Program:
    self.optimized = layout_lib.optimize(program, mode=self.mode, platform=platform)
    return self.optimized

  def reports(self) -> tuple[PassReport, ...]:
    report = self.optimized.report() if self.optimized is not None else None
    return () if report is None else (report,)


class CleanupStage(_CountingStage):
  """Cleanup alone (when kernel selection is off)."""

  name = "cleanup"

  def apply(self, program: Program, platform: str | None) -> Program:
    return rewrite.transform(program, cleanup_pass(), platform=platform,
                             on_trace=self.on_trace)

  def reports(self) -> tuple[PassReport, ...]:
    return (CleanupReport(self.counts),)


class KernelStage(_CountingStage):
  """Kernel selection and cleanup in one evaluation (they touch different primitives).

  The sites are decided with the trace's `Selection` (`tunedjax.jit` sets
  `selection` and makes it current around the trace), whose tally is this
  stage's `KernelReport`; the engine's counters are cleanup's.
  """

  name = "kernel_selection"

  def __init__(self) -> None:
    super().__init__()
    self.selection: _select.Selection | None = None

  def apply(self, program: Program, platform: str | None) -> Program:
    cleanup = cleanup_pass()
    kernels = _select.kernel_pass(post=cleanup)
    merged = rewrite.Pass("kernel_selection+cleanup", {**kernels.rules, **cleanup.rules},
                          patterns=kernels.patterns)
    return rewrite.transform(program, merged, platform=platform, on_trace=self.on_trace)

  def reports(self) -> tuple[PassReport, ...]:
    kernel = self.selection.tally.report() if self.selection is not None else KernelReport()
    return (kernel, CleanupReport(self.counts))


def plan(config: Any, platform: str | None) -> list[Stage]:
  """The stages the config enables, in order (fresh for every trace).

  Args:
    config: the active `tunedjax.Config`.
    platform: the platform passes rewrite for (None: JAX's default backend).

  Returns:
    A list of `Stage`; empty when nothing is enabled.
  """
  del platform  # every stage takes it in `apply`; kept for stages that depend on it
  stages: list[Stage] = []
  if config.mixed_precision.enable:
    stages.append(AutocastStage(config.mixed_precision.policy))
  if config.layout.enable:
    stages.append(LayoutStage(config.layout.mode))
  if config.kernel.enable:
    stages.append(KernelStage())
  elif stages:
    stages.append(CleanupStage())
  return stages


def stage_names(stages: list[Stage]) -> tuple[str, ...]:
  """The pass names a list of stages runs (kernel selection brings cleanup with it)."""
  names: list[str] = []
  for stage in stages:
    names.append(stage.name)
    if isinstance(stage, KernelStage):
      names.append("cleanup")
  return tuple(names)
