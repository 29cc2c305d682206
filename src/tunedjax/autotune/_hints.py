"""Kernel hints: a user's choice of kernel, which always beats the tuner.

A hint names a kernel per op (``conv="fft"``). It comes from the config
(``kernel.hints``) or from the `hint` context manager, which wins over the
config and nests (the innermost wins). A hinted kernel is used for every
convolution it can handle, without tuning; where it cannot, the selection
goes on as if there were no hint, and a `HintWarning` says so once per kernel
and convolution shape. Hints are read when a function is traced, so a jitted
function keeps the hints of its first trace (`select_kernels(..., jit=True)`
re-traces when they change).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from tunedjax._config import HINT_OPS, FrozenDict, get_config
from tunedjax._errors import TunedJaxError, did_you_mean, format_choices
from tunedjax.autotune import _registry


class HintWarning(UserWarning):
  """A hinted kernel cannot run a convolution it was hinted for.

  The convolution uses the normal selection instead (cache, tuner, or xla).
  """


_HINTS: contextvars.ContextVar[FrozenDict] = contextvars.ContextVar(
    "tunedjax_kernel_hints", default=FrozenDict())
_WARNED: set[tuple[str, str, str]] = set()


def check_hints(hints: Mapping[str, Any], *, where: str = "autotune.hint") -> FrozenDict:
  """Validates ``{op: kernel name}``; raises naming the bad op or kernel.

  Args:
    hints: the hints, e.g. ``{"conv": "fft"}``.
    where: how the error message names the source of the hints.

  Returns:
    The hints as a `FrozenDict`.

  Raises:
    TunedJaxError: an unknown op, or a kernel name not registered for it.

  Example:
    >>> check_hints({"conv": "xla"})
    FrozenDict({'conv': 'xla'})
    >>> check_hints({"conv": "fftt"})
    Traceback (most recent call last):
    ...
    tunedjax._errors.TunedJaxError: autotune.hint: unknown conv kernel 'fftt'...
  """
  for op, name in hints.items():
    if op not in HINT_OPS:
      raise TunedJaxError(
          f"{where}: unknown op {op!r}{did_you_mean(str(op), HINT_OPS)}; hints "
          f"can be given for {format_choices(HINT_OPS)}.")
    known = [k.name for k in _registry.kernels(op)]
    if not isinstance(name, str) or name not in known:
      raise TunedJaxError(
          f"{where}: unknown {op} kernel {name!r}{did_you_mean(str(name), known)}. "
          f"Known {op} kernels: {format_choices(known)}.")
  return FrozenDict(hints)


@contextlib.contextmanager
def hint(**kernels: str) -> Iterator[FrozenDict]:
  """Pins kernels by op inside a ``with`` block (beats the tuner and the config).

  Args:
    **kernels: op to kernel name, e.g. ``conv="fft"``. Ops: ``conv``.

  Yields:
    The hints in force inside the block (outer ones merged in).

  Raises:
    TunedJaxError: an unknown op or kernel name (the message lists the
      known ones).

  Example:
    >>> with hint(conv="xla"):
    ...   active_hints()["conv"]
    'xla'
  """
  check_hints(kernels)
  merged = FrozenDict({**_HINTS.get(), **kernels})
  token = _HINTS.set(merged)
  try:
    yield merged
  finally:
    _HINTS.reset(token)


def active_hints(config: Any = None) -> FrozenDict:
  """The hints in force: the config's ``kernel.hints`` overlaid by `hint` blocks.

  Args:
    config: a `tunedjax.Config`; default `get_config()`.

  Returns:
    ``{op: kernel name}``.

  Example:
    >>> import tunedjax as tj
    >>> with tj.config_context({"kernel": {"hints": {"conv": "xla"}}}):
    ...   dict(active_hints())
    {'conv': 'xla'}
  """
  config = get_config() if config is None else config
  configured = config.kernel.hints
  if configured:
    check_hints(configured, where="config kernel.hints")
  return FrozenDict({**configured, **_HINTS.get()})


def hinted_kernel(op: str, spec: Any, candidates: Any, hints: Mapping[str, str],
                  label: str = "") -> str | None:
  """The hinted kernel for this convolution, or None (no hint, or not applicable).

  Warns once per (op, kernel, bucket label) where the hint cannot apply.

  Args:
    op: the op, ``"conv"``.
    spec: the convolution's `ConvSpec` (only used in the message).
    candidates: the kernels applicable to it.
    hints: the active hints.
    label: the bucket's description (for the message and the warn-once key).

  Returns:
    The kernel name, or None.
  """
  del spec
  name = hints.get(op)
  if name is None:
    return None
  if name in {k.name for k in candidates}:
    return name
  key = (op, name, label)
  if key not in _WARNED:
    _WARNED.add(key)
    warnings.warn(
        f"The kernel hint {op}={name!r} does not apply to {label or 'a convolution'}; "
        f"it uses the normal selection among {format_choices(k.name for k in candidates)}.",
        HintWarning, stacklevel=2)
  return None
