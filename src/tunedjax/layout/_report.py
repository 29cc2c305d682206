"""What the layout pass did to one function signature, in words.

Example:
  >>> r = LayoutReport(signature="f32[8,3,32,32]", target="NHWC", mode="heuristic",
  ...                  decision="relaid", reason="float32 on cpu prefers NHWC",
  ...                  convolutions=2, counts={"convolutions re-laid": 2})
  >>> print(r.summary())
  layout: re-laid to NHWC (float32 on cpu prefers NHWC); 2 of 2 convolutions re-laid
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

DECISIONS = ("relaid", "original", "unchanged")

_COUNT_ORDER = (
    "convolutions re-laid", "pooling ops re-laid", "axis ops remapped",
    "custom_jvp calls re-laid", "transposes into the target layout",
    "transposes between layouts", "transposes back to the original layout",
    "transposes absorbed",
)


@dataclasses.dataclass(frozen=True)
class LayoutReport:
  """The layout pass's decision for one input signature, and what it changed.

  Attributes:
    signature: the flat input types, e.g. ``"f32[8,3,32,32], f32[64,3,7,7]"``.
    target: the layout convolutions were (or would have been) moved to.
    mode: ``"heuristic"`` or ``"measure"``.
    decision: ``"relaid"`` (the rewritten function runs), ``"original"``
      (measured slower, the function runs as written) or ``"unchanged"``
      (nothing to re-lay: no convolutions, or already in the target layout).
    reason: why, in words.
    convolutions: convolutions in the traced function (sub-jaxprs included).
    counts: the pass's counters: convolutions and pooling ops re-laid, axis
      ops remapped, transposes inserted at region edges ("into the target
      layout", "back to the original layout"), user transposes absorbed.
    transposes_before: transposes in the original jaxpr (None if not counted).
    transposes_after: transposes in the rewritten jaxpr (None if not counted).
    seconds: measured median seconds per call, ``{"original": s, "relaid": s}``
      (measure mode only).
    cached: the decision came from the in-process or persistent cache.
    kernel_inputs: ``{input index: perm}``: the inputs (flat, in the order
      of ``jax.tree_util.tree_leaves(args)``) that are convolution kernels
      the pass transposes at every call, each to ``transpose(input, perm)``.
      A caller that keeps such an input stored as ``transpose(input, perm)``
      and undoes that at the top of the function (the pass absorbs the
      user's transpose) saves those transposes: the Trainer does this.
  """

  signature: str
  target: str
  mode: str
  decision: str
  reason: str
  convolutions: int = 0
  counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
  transposes_before: int | None = None
  transposes_after: int | None = None
  seconds: Mapping[str, float] | None = None
  cached: bool = False
  kernel_inputs: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  name = "layout"

  @property
  def tuning_s(self) -> float:
    """Seconds measure mode spent timing in this trace (0 for a cached or heuristic decision)."""
    if self.cached or not self.seconds:
      return 0.0
    return float(sum(self.seconds.values()))

  def summary(self) -> str:
    """One line: the decision, why, and how many convolutions were re-laid."""
    if self.decision == "relaid":
      head = f"re-laid to {self.target}"
    elif self.decision == "original":
      head = f"kept the original layout (not {self.target})"
    else:
      head = "unchanged"
    relaid = self.counts.get("convolutions re-laid", 0)
    return (f"layout: {head} ({self.reason}); {relaid} of {self.convolutions} "
            "convolutions re-laid")

  def __str__(self) -> str:
    lines = [self.summary(), f"  signature: {self.signature}",
             f"  mode: {self.mode}{' (cached decision)' if self.cached else ''}"]
    names = [*[n for n in _COUNT_ORDER if n in self.counts],
             *sorted(n for n in self.counts if n not in _COUNT_ORDER)]
    for name in names:
      lines.append(f"  {name}: {self.counts[name]}")
    if self.transposes_before is not None and self.transposes_after is not None:
      lines.append(f"  transposes in the jaxpr: {self.transposes_before} before, "
                   f"{self.transposes_after} after (weights included)")
    if self.kernel_inputs:
      lines.append(f"  kernel inputs transposed at every call: {len(self.kernel_inputs)}")
    if self.seconds:
      timed = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.seconds.items())
      lines.append(f"  measured median per call: {timed}")
    return "\n".join(lines)
