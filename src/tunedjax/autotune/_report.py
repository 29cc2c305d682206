"""What kernel selection chose in one trace, as a typed report.

Example:
  >>> r = KernelReport((KernelChoice("conv", "depthwise", "hit", 2),
  ...                   KernelChoice("conv", "xla", "observe", 1)), tuning_s=0.0)
  >>> r.hits, r.misses, r.observed, dict(r.counts())
  (2, 0, True, {'conv depthwise (hit)': 2, 'conv xla (observe)': 1})
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Mapping

# Why a site got its kernel.
HINT, ONLY_DEFAULT, OBSERVE, HIT, TUNED, MISS, NOT_APPLICABLE, RECEIVED, FAILED = (
    "hint", "only xla", "observe", "hit", "tuned", "miss", "not applicable", "received",
    "failed at trace")
CANNOT_PAY_BACK = "cannot pay back"
# The whole-program check (`_verify`): a bucket whose kernel made the program
# slower (cached), and a bucket run on its default in a variant being compared.
LOSES_IN_CONTEXT, VERIFYING = "loses in context", "verifying"
# A GPU where nothing measured (nor a prior of its class) says a candidate wins:
# XLA's own kernel: a routed call site runs the user's code (`_select.leaves_as_written`).
XLA_FIRST = "xla first"
# Rewriting for a platform with no device here: the family's rule for it chose.
BY_RULE = "by the platform's rule"
REASONS = (HINT, ONLY_DEFAULT, OBSERVE, HIT, TUNED, MISS, NOT_APPLICABLE, RECEIVED, FAILED,
           CANNOT_PAY_BACK, LOSES_IN_CONTEXT, VERIFYING, XLA_FIRST, BY_RULE)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """How many sites of one op family got one kernel, for one reason.

  Attributes:
    op: the op family (``"conv"``, ``"attention"``).
    kernel: the kernel that runs.
    why: ``"hint"``, ``"only xla"`` (nothing else applies), ``"observe"``,
      ``"hit"`` (from the cache), ``"tuned"``, ``"miss"`` (apply phase: the
      default), ``"not applicable"``, ``"received"`` (from process 0),
      ``"failed at trace"`` (the chosen kernel raised; the default runs), or
      ``"cannot pay back"`` (not in the cache, and tuning it could not pay
      back within the session's horizon: the default, untuned, its
      decision cached with the horizon; a later trace reusing that
      decision counts as a ``"hit"``), ``"loses in context"`` (the whole-program
      check found its tuned kernel makes this program slower: the default,
      from a cached verdict), ``"verifying"`` (the default, in a variant
      of the program the whole-program check compares), or ``"xla first"``
      (a GPU where nothing measured nor a prior says a candidate wins: XLA's
      own kernel, nothing compiled).
    count: how many sites.
  """

  op: str
  kernel: str
  why: str
  count: int = 1

  def __str__(self) -> str:
    return f"{self.op} {self.kernel} ({self.why})"


@dataclasses.dataclass(frozen=True)
class BucketTemporaries:
  """The temporaries of one tuned bucket's kernel against its family's default.

  From the tuner's record (each candidate's compiled forward, or
  forward+backward, as the family is timed), so what a choice saves in memory
  shows beside what it saves in time.

  Attributes:
    bucket: the bucket's label.
    kernel: the kernel that runs.
    default_bytes: the default kernel's temporaries.
    kernel_bytes: the chosen kernel's temporaries.

  Example:
    >>> t = BucketTemporaries("attention 1x4096x4096 h8/8 d64 float32", "blocked_128",
    ...                       2**30, 2**27)
    >>> t.saved_bytes == 7 * 2**27
    True
  """
  bucket: str
  kernel: str
  default_bytes: int
  kernel_bytes: int

  @property
  def saved_bytes(self) -> int:
    """Bytes of temporaries the choice saves (negative: it needs more)."""
    return self.default_bytes - self.kernel_bytes

  def __str__(self) -> str:
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    return (f"{self.bucket}: {self.kernel} {mib(self.kernel_bytes)} against "
            f"{mib(self.default_bytes)}")


@dataclasses.dataclass(frozen=True)
class BucketDecision:
  """How one bucket tuned during a trace was decided.

  Attributes:
    bucket: the bucket's label.
    op: the op family.
    kernel: the kernel chosen.
    decided: ``"predicted"`` (only the candidates a prediction said could
      win were compiled), ``"timed"`` (every candidate) or ``"kept"``
      (tuning could not pay back: the default, untuned).
    compiled: candidates compiled (the default included).
    candidates: candidates that applied.
    compile_s: seconds compiling them took, in all.
    regret: the predicted winner's measured time over the best measured
      time, where both are known (1.0: the prediction was right).

  Example:
    >>> print(BucketDecision("conv 8x32x32x64 * 3x3x1x64", "conv", "depthwise_native",
    ...                      "predicted", 2, 5, 0.4, 1.0))
    conv 8x32x32x64 * 3x3x1x64: depthwise_native, predicted (2 of 5 compiled, 0.40 s), regret 1.00
  """

  bucket: str
  op: str
  kernel: str
  decided: str
  compiled: int
  candidates: int
  compile_s: float = 0.0
  regret: float | None = None

  def __str__(self) -> str:
    regret = "" if self.regret is None else f", regret {self.regret:.2f}"
    return (f"{self.bucket}: {self.kernel}, {self.decided} ({self.compiled} of "
            f"{self.candidates} compiled, {self.compile_s:.2f} s){regret}")


@dataclasses.dataclass(frozen=True)
class MatchedSite:
  """One place where an op family's pattern found its computation written out.

  Attributes:
    op: the op family (``"batch_norm"``).
    spelling: which way of writing it the pattern recognised (``"two-pass rsqrt"``).
    where: the user's source line of its first equation.
    kernel: the kernel that runs it (the default: the equations as written).
    replaced: ``"forward"`` (the forward replaced; an outer `jax.grad` uses
      the kernel's backward), ``"forward+backward"`` (in a differentiated
      jaxpr, the forward and its backward replaced together) or ``"none"``
      (the default kernel: nothing replaced).
    bucket: the site's bucket label (as `autotune.explain` lists it).

  Example:
    >>> str(MatchedSite("batch_norm", "two-pass rsqrt", "net.py:12 (block)", "fused",
    ...                 "forward+backward"))
    'batch_norm two-pass rsqrt at net.py:12 (block): fused, forward+backward'
  """

  op: str
  spelling: str
  where: str
  kernel: str
  replaced: str
  bucket: str = ""

  def __str__(self) -> str:
    return f"{self.op} {self.spelling} at {self.where}: {self.kernel}, {self.replaced}"


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """The kernel-selection pass's report for one trace.

  Attributes:
    choices: one `KernelChoice` per (op, kernel, why), in first-seen order.
    tuning_s: seconds spent tuning buckets during this trace.
    temporaries: one `BucketTemporaries` per bucket decided by the tuner or
      the cache whose record has temporaries for both its kernel and the
      default (hinted, observed and default-only buckets have none).
    decisions: one `BucketDecision` per bucket tuned during this trace:
      predicted, timed or kept, what was compiled, and the regret.
    matched: one `MatchedSite` per site an op family's pattern found
      (also counted in `choices`).
  """

  choices: tuple[KernelChoice, ...] = ()
  tuning_s: float = 0.0
  temporaries: tuple[BucketTemporaries, ...] = ()
  decisions: tuple[BucketDecision, ...] = ()
  matched: tuple[MatchedSite, ...] = ()
  name = "kernel_selection"

  def _count(self, *whys: str) -> int:
    return sum(c.count for c in self.choices if c.why in whys)

  @property
  def hits(self) -> int:
    """Sites whose bucket was found in the cache."""
    return self._count(HIT)

  @property
  def misses(self) -> int:
    """Sites whose bucket was not in the cache (tuned now, kept because tuning it
    could not pay back, or the default when applying)."""
    return self._count(TUNED, MISS, CANNOT_PAY_BACK)

  @property
  def kept(self) -> int:
    """Sites kept on their default because tuning their bucket could not pay back."""
    return self._count(CANNOT_PAY_BACK)

  @property
  def tuned(self) -> int:
    """Sites whose bucket was tuned during this trace."""
    return self._count(TUNED)

  @property
  def observed(self) -> bool:
    """Whether this trace ran in the observe phase (every site on its default)."""
    return any(c.why == OBSERVE for c in self.choices)

  def ops(self) -> tuple[str, ...]:
    """The op families with sites in this trace."""
    return tuple(dict.fromkeys(c.op for c in self.choices))

  def of(self, op: str) -> tuple[KernelChoice, ...]:
    """The choices of one op family."""
    return tuple(c for c in self.choices if c.op == op)

  def counts(self) -> Mapping[str, int]:
    """``{"<op> <kernel> (<why>)": count}``, for display."""
    return {str(c): c.count for c in self.choices}

  @property
  def temp_bytes_saved(self) -> int:
    """Temporaries the chosen kernels save against the defaults, over the buckets."""
    return sum(t.saved_bytes for t in self.temporaries)

  def decided(self) -> Mapping[str, int]:
    """``{"predicted" | "timed" | "kept": buckets}`` of the buckets tuned in this trace."""
    return dict(collections.Counter(d.decided for d in self.decisions))

  @property
  def compiled(self) -> tuple[int, int]:
    """``(candidates compiled, candidates that applied)`` over the buckets tuned."""
    return (sum(d.compiled for d in self.decisions),
            sum(d.candidates for d in self.decisions))

  def __str__(self) -> str:
    parts = ", ".join(f"{c}: {c.count}" for c in self.choices) or "no kernel sites"
    text = f"{parts}; cache hits {self.hits}, misses {self.misses}, tuning {self.tuning_s:.1f} s"
    if self.decisions:
      how = ", ".join(f"{n} {k}" for k, n in sorted(self.decided().items()))
      regrets = sorted(d.regret for d in self.decisions if d.regret is not None)
      worst = f", worst regret {regrets[-1]:.2f}" if regrets else ""
      text += (f"; buckets {how}, {self.compiled[0]} of {self.compiled[1]} candidates "
               f"compiled{worst}")
    if any(t.saved_bytes for t in self.temporaries):
      text += f"; kernel temporaries {self.temp_bytes_saved / 2**20:+.1f} MiB saved"
    if self.matched:
      text += "; found written out: " + "; ".join(str(m) for m in self.matched)
    return text


class Tally:
  """Collects `KernelChoice` counts while one program is traced (thread-safe)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
    self._tuning_s = 0.0
    self._temps: dict[str, BucketTemporaries] = {}
    self._decisions: list[BucketDecision] = []
    self._matched: list[MatchedSite] = []

  def add_decision(self, decision: BucketDecision) -> None:
    """Records how a bucket tuned in this trace was decided."""
    with self._lock:
      self._decisions.append(decision)

  def add_matched(self, site: MatchedSite) -> None:
    """Records a site an op family's pattern found."""
    with self._lock:
      self._matched.append(site)

  def add_temporaries(self, bucket: str, kernel: str, temp_bytes: Mapping[str, int],
                      default: str) -> None:
    """Records a bucket's temporaries from its tuning record (``{kernel: bytes}``)."""
    if kernel in temp_bytes and default in temp_bytes:
      with self._lock:
        self._temps[bucket] = BucketTemporaries(bucket, kernel, int(temp_bytes[default]),
                                                int(temp_bytes[kernel]))

  def add(self, op: str, kernel: str, why: str) -> None:
    """Counts one site of `op` that runs `kernel` because of `why`."""
    with self._lock:
      self._counts[(op, kernel, why)] += 1

  def add_tuning(self, seconds: float) -> None:
    """Adds seconds spent tuning a bucket."""
    with self._lock:
      self._tuning_s += float(seconds)

  def report(self) -> KernelReport:
    with self._lock:
      return KernelReport(tuple(KernelChoice(op, k, why, n)
                                for (op, k, why), n in self._counts.items()),
                          tuning_s=self._tuning_s, temporaries=tuple(self._temps.values()),
                          decisions=tuple(self._decisions),
                          matched=tuple(self._matched))
