"""`optimize(f)`: runs `f` with its convolutions in the layout that is fastest.

The function is traced to a jaxpr at each call (inside the caller's own trace,
so `jax.jit` caches it), the target layout is chosen, and the jaxpr is
evaluated through the layout pass (`tunedjax.layout._rules`). Its inputs and
outputs keep their layout: only the inside changes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import layout
  >>> conv = lambda x, w: jax.nn.relu(jax.lax.conv(x, w, (1, 1), "SAME"))
  >>> fast = jax.jit(layout.optimize(conv, target="NHWC"))
  >>> fast(jnp.ones((1, 2, 4, 4)), jnp.ones((3, 2, 1, 1))).shape
  (1, 3, 4, 4)
  >>> fast.__wrapped__.report().decision
  'relaid'
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tunedjax import _errors
from tunedjax._config import LAYOUT_MODES
from tunedjax import rewrite
from tunedjax.layout import _measure
from tunedjax.layout._prefer import canonical_platform
from tunedjax.layout._prefer import check_target
from tunedjax.layout._prefer import preferred
from tunedjax.layout._report import LayoutReport
from tunedjax.layout._rules import CONV
from tunedjax.layout._rules import make_pass
from tunedjax.layout._value import LayoutState

MODES = LAYOUT_MODES  # one list of valid choices: the config's
_NO_PASS = rewrite.Pass("layout-unchanged")


def _check_mode(mode: str) -> str:
  if not isinstance(mode, str) or mode not in MODES:
    raise _errors.LayoutError(
        f"layout mode must be one of {_errors.format_choices(MODES)}, got {mode!r}"
        f"{_errors.did_you_mean(str(mode), MODES)}.")
  return mode


def _first_conv(closed: Any) -> Any | None:
  return next((e for e in rewrite.iter_equations(closed) if e.primitive.name == CONV), None)


XLA_GPU_ASSIGNS = (
    "XLA:GPU assigns each convolution's layout itself (layout_assignment.cc: NHWC for "
    "2-D convolutions on Hopper, and for float16/bfloat16 on Volta and newer), so a "
    "transpose written into the program does not steer it")


def _user_layout(conv: Any) -> str:
  """The activation layout the user wrote a convolution in (feature dim first or last)."""
  lhs_spec = conv.params["dimension_numbers"].lhs_spec
  return "NCHW" if lhs_spec[1] == 1 else "NHWC"


def _count(closed: Any, name: str) -> int:
  return rewrite.count_primitives(closed)[name]


def _has_tracer_consts(closed: Any) -> bool:
  return any(isinstance(c, jax.core.Tracer) for c in closed.consts)


def _run_plain(closed: Any, flat: list[Any]) -> list[Any]:
  return rewrite.eval_jaxpr(closed, flat, _NO_PASS)


def _run_relaid(closed: Any, flat: list[Any], target: str, platform: str
                ) -> tuple[list[Any], LayoutState]:
  state = LayoutState(target)
  state.track_inputs(flat)
  pass_ = make_pass(state)
  ctx = rewrite.Context(pass_, platform=platform)
  return rewrite.eval_jaxpr(closed, flat, pass_, context=ctx), state


class Optimized:
  """A function whose convolutions run in the chosen layout (see `optimize`).

  Calling it is calling the original function; `report()` says what the
  layout pass did the last time it traced a new input signature.
  """

  def __init__(self, fun: Callable[..., Any], target: str, mode: str,
               platform: str | None):
    self.__wrapped__ = fun
    self.target = target
    self.mode = mode
    self._platform = platform
    self._lock = threading.Lock()
    self._reports: dict[str, LayoutReport] = {}
    self._last: str | None = None
    functools.update_wrapper(self, fun)

  def __repr__(self) -> str:
    name = getattr(self.__wrapped__, "__name__", repr(self.__wrapped__))
    return f"layout.optimize({name}, target={self.target!r}, mode={self.mode!r})"

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    closed, flat, out_tree = rewrite.trace(self.__wrapped__, *args, **kwargs)
    outs, report = self._evaluate(closed, flat)
    key = report.signature
    with self._lock:
      self._reports[key] = report
      self._last = key
    return jax.tree_util.tree_unflatten(out_tree, outs)

  def _evaluate(self, closed: Any, flat: list[Any]) -> tuple[list[Any], LayoutReport]:
    signature = ", ".join(a.str_short() for a in closed.in_avals)
    platform = canonical_platform(self._platform or jax.default_backend())
    convs = _count(closed, CONV)
    first = _first_conv(closed)
    base = dict(signature=signature, mode=self.mode, convolutions=convs,
                transposes_before=_count(closed, "transpose"))
    if first is None:
      return _run_plain(closed, flat), LayoutReport(
          target=self.target, decision="unchanged",
          reason="no convolutions", **base)
    target, reason = self.target, f"target={self.target!r} given"
    if target == "auto" and platform == "gpu":
      return self._gpu(closed, flat, _user_layout(first), base)
    if target == "auto":
      dtype = np.dtype(first.invars[0].aval.dtype).name
      target = preferred(dtype, platform)
      reason = f"{dtype} convolutions on {platform} prefer {target}"
    if self.mode == "measure":
      return self._measured(closed, flat, target, platform, reason, base)
    outs, state = _run_relaid(closed, flat, target, platform)
    return outs, self._relaid_report(state, target, reason, base)

  def _gpu(self, closed: Any, flat: list[Any], user: str, base: dict[str, Any]
           ) -> tuple[list[Any], LayoutReport]:
    """On a GPU the user's layout stays unless measure mode timed the other one here."""
    other = "NCHW" if user == "NHWC" else "NHWC"
    keep = f"{XLA_GPU_ASSIGNS}; the pass keeps the user's {user}"
    if self.mode == "measure" and _measure.can_measure("gpu"):
      return self._measured(closed, flat, other, "gpu", keep + f" unless {other} times faster",
                            base)
    value = None if _has_tracer_consts(closed) else _measure.lookup(closed, other, "gpu")
    if value is not None and value["choice"] != "original":
      outs, state = _run_relaid(closed, flat, other, "gpu")
      return outs, self._relaid_report(state, other, f"measured on this GPU: {other} faster",
                                       base, seconds=value.get("seconds") or None, cached=True)
    why = ("measure mode has no GPU here to time " + other) if self.mode == "measure" else (
        "nothing measured on this GPU (mode='measure' times " + other + ")")
    return _run_plain(closed, flat), LayoutReport(
        target=user, decision="unchanged", reason=f"{keep}; {why}", **base)

  def _relaid_report(self, state: LayoutState, target: str, reason: str,
                     base: dict[str, Any], **extra: Any) -> LayoutReport:
    counts = dict(state.counts)
    inserted = sum(v for k, v in counts.items() if k.startswith("transposes")
                   and k != "transposes absorbed")
    decision = "relaid" if counts.get("convolutions re-laid") else "unchanged"
    if decision == "unchanged":
      reason += f"; every convolution is already in {target}"
    return LayoutReport(target=target, decision=decision, reason=reason, counts=counts,
                        transposes_after=inserted, kernel_inputs=dict(state.kernel_inputs),
                        **base, **extra)

  def _measured(self, closed: Any, flat: list[Any], target: str, platform: str,
                reason: str, base: dict[str, Any]) -> tuple[list[Any], LayoutReport]:
    unmeasured = ("the function closes over traced values" if _has_tracer_consts(closed)
                  else None if _measure.can_measure(platform)
                  else f"no {platform} here to time it on")  # never another platform's times
    if unmeasured:
      outs, state = _run_relaid(closed, flat, target, platform)
      return outs, self._relaid_report(
          state, target, reason + f"; not measured: {unmeasured}, so the heuristic decided",
          base)
    value = _measure.lookup(closed, target, platform)
    cached = value is not None
    if value is None:
      value = _measure.measure(
          closed, target,
          lambda *a: _run_plain(closed, list(a)),
          lambda *a: _run_relaid(closed, list(a), target, platform)[0], platform=platform)
    seconds = value.get("seconds") or None
    timing = ""
    if seconds and "original" in seconds and "relaid" in seconds:
      timing = f" ({seconds['relaid'] / seconds['original']:.2f}x the original's time)"
    if value["choice"] == "original":
      return _run_plain(closed, flat), LayoutReport(
          target=target, decision="original",
          reason=f"measured: {target} was not faster{timing}", seconds=seconds,
          cached=cached, **base)
    outs, state = _run_relaid(closed, flat, target, platform)
    return outs, self._relaid_report(state, target, f"measured: {target} faster{timing}",
                                     base, seconds=seconds, cached=cached)

  def report(self, signature: str | None = None) -> LayoutReport:
    """What the layout pass did for the last traced input signature.

    Args:
      signature: report on this signature instead (as in
        `LayoutReport.signature`); see `signatures()`.

    Returns:
      A `LayoutReport`; ``print`` it for a readable summary.
    """
    with self._lock:
      key = signature if signature is not None else self._last
      if key is None or key not in self._reports:
        known = list(self._reports)
        raise _errors.LayoutError(
            f"No layout report for signature {key!r}: call the function first "
            f"(under jax.jit, the first call traces it). Traced signatures: {known}.")
      return self._reports[key]

  def signatures(self) -> list[str]:
    """The input signatures traced so far, oldest first."""
    with self._lock:
      return list(self._reports)


def optimize(f: Callable[..., Any], *, target: str = "auto", mode: str = "heuristic",
             platform: str | None = None) -> Optimized:
  """Returns `f` with its convolutions and pooling run in the best layout.

  Convolutions are moved to the target layout and the layout is carried
  through the ops between them (elementwise ops, normalisation statistics,
  pooling, concatenation), so transposes appear only where a region in the
  target layout begins or ends. The inputs and outputs of `f` keep their
  layout: the result computes the same function. A function without
  convolutions runs unchanged.

  Args:
    f: the function; its arguments are pytrees of arrays (close over static
      values with `functools.partial`).
    target: ``"auto"`` (from the first convolution's dtype and the platform,
      see `preferred`), ``"NHWC"`` (channels last) or ``"NCHW"``.
    mode: ``"heuristic"`` (default; use `target` as chosen) or ``"measure"``
      (compile and time the original and the re-laid function on random
      inputs of the traced signature, keep the faster; the decision is cached
      per function, signature and device, in the process and in the
      persistent tuning cache). `tunedjax.jit` passes
      ``get_config().layout.mode`` here; called directly the default is
      ``"heuristic"``.
    platform: the platform to choose for; default `jax.default_backend()`.

  Returns:
    An `Optimized` function with `f`'s signature and a `report()` method.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import layout
    >>> f = layout.optimize(lambda x, w: jax.lax.conv(x, w, (1, 1), "VALID"))
    >>> f(jnp.ones((1, 2, 3, 3)), jnp.ones((4, 2, 1, 1))).shape
    (1, 4, 3, 3)
    >>> f.report().counts["convolutions re-laid"]
    1
  """
  if not callable(f):
    raise TypeError(f"layout.optimize expects a function, got {f!r}.")
  if platform is not None and (not isinstance(platform, str) or not platform):
    raise _errors.LayoutError(f"layout.optimize(platform=...) must be None or a platform "
                              f"name such as 'cpu', 'gpu' or 'tpu', got {platform!r}.")
  return Optimized(f, check_target(target), _check_mode(mode), platform)
