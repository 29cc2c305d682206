"""Measure mode: time the original and the re-laid function, keep the faster.

A decision is remembered per (jaxpr fingerprint, input signature, target,
device): in the current `TuningSession` (so a readonly cache still serves
what this run measured), and in the persistent tuning cache (namespace
``"layout"``), so a restarted program does not measure again. Keys are stored in full (the jaxpr
digest, the signature, the target, the jax version); the device is the cache
file's own key. The device is the one of the platform rewritten for: a
program laid out for a GPU is timed on a GPU, and where this process has
none nothing is measured (`can_measure`: the heuristic decides); a CPU's
timing never decides a GPU's layout.

Example:
  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(jnp.sin)(jnp.ones((2, 3)))
  >>> cache_key(closed, "NHWC")["signature"]
  ['float32[2,3]']
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from typing import Any

import jax

from tunedjax import _tuning
from tunedjax.layout._prefer import LAYOUTS

NAMESPACE = "layout"
CHOICES = ("relaid", "original")


def validate(value: dict[str, Any]) -> None:
  """Raises if a stored layout decision is not one this version can use.

  Example:
    >>> validate({"choice": "relaid", "target": "NHWC", "seconds": {"relaid": 0.1}})
  """
  if value.get("choice") not in CHOICES:
    raise ValueError(f"layout decision 'choice' must be one of {CHOICES}, got {value.get('choice')!r}")
  if value.get("target") not in LAYOUTS:
    raise ValueError(f"layout decision 'target' must be one of {LAYOUTS}, got {value.get('target')!r}")
  seconds = value.get("seconds", {})
  if not isinstance(seconds, dict) or not all(
      isinstance(v, (int, float)) and not isinstance(v, bool) for v in seconds.values()):
    raise TypeError(f"layout decision 'seconds' must map names to numbers, got {seconds!r}")


_tuning.register_validator(NAMESPACE, validate)


def cache_key(closed: Any, target: str) -> dict[str, Any]:
  """The full key of a layout decision (JSON): jaxpr digest, signature, target, jax version."""
  text = str(closed.jaxpr) + "|" + ",".join(
      jax.typeof(c).str_short() for c in closed.consts)
  return {
      "jaxpr_sha256": hashlib.sha256(text.encode()).hexdigest(),
      "signature": [a.str_short() for a in closed.in_avals],
      "target": target,
      "jax": jax.__version__,
  }


def can_measure(platform: str | None) -> bool:
  """Whether this process has a `platform` device to time layouts on."""
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


def _default_cache(platform: str | None = None) -> Any:
  try:
    return _tuning.resolve_cache(None, platform=platform)
  except Exception as e:  # a broken cache never stops the program  # pylint: disable=broad-except
    warnings.warn(f"tunedjax.layout: tuning cache not usable ({e}); measuring again.",
                  stacklevel=3)
    return None


def lookup(closed: Any, target: str, platform: str | None = None) -> dict[str, Any] | None:
  """A remembered decision for `platform` (None: the default backend): the current
  session's first, then the persistent cache of that platform's device."""
  try:
    return _tuning.current_session().lookup(_default_cache(platform), NAMESPACE,
                                            cache_key(closed, target), platform=platform)
  except Exception as e:  # a broken cache never stops the program  # pylint: disable=broad-except
    warnings.warn(f"tunedjax.layout: tuning cache not readable ({e}); measuring again.",
                  stacklevel=2)
    return None


def measure(closed: Any, target: str, original: Callable[..., Any],
            relaid: Callable[..., Any], *, rounds: int = 5,
            budget_s: float | None = 30.0, platform: str | None = None) -> dict[str, Any]:
  """Times `original` and `relaid` (flat args in) on random inputs; stores the decision.

  Args:
    closed: the traced function (for the key and the input types).
    target: the layout `relaid` runs convolutions in.
    original: the function as written, flat arrays in, flat list out.
    relaid: the re-laid function, same signature.
    rounds: timed rounds (interleaved, order rotated).
    budget_s: stop timing after this many seconds (at least one round).
    platform: the platform to time on (its first device; `can_measure` must
      hold), and whose cache keeps the decision; None: the default backend.

  Returns:
    The decision: ``{"choice": "relaid"|"original", "target": ...,
    "seconds": {"original": median, "relaid": median}}``.
  """
  args = _tuning.random_inputs(closed.in_avals)
  # Run for real even inside a jit trace; a first call counts it as tuning.
  with jax.ensure_compile_time_eval(), _tuning.first_call_stage("tune:time"):
    device = jax.devices(platform)[0] if platform is not None else None
    args = [jax.device_put(a, device) for a in args]
    fns = {"original": jax.jit(original), "relaid": jax.jit(relaid)}
    times = _tuning.time_interleaved(
        {name: (lambda fn=fn: fn(*args)) for name, fn in fns.items()},
        rounds=rounds, warmup=1, budget_s=budget_s)
  seconds = {name: _tuning.median(ts) for name, ts in times.items()}
  choice = "relaid" if seconds["relaid"] < seconds["original"] else "original"
  value = {"choice": choice, "target": target, "seconds": seconds}
  _tuning.current_session().store(_default_cache(platform), NAMESPACE,
                                  cache_key(closed, target), value, platform=platform)
  return value
