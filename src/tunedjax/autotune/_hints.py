"""Kernel hints: a user's choice of kernel, which always beats the tuner.

A hint names a kernel per op family (``conv="fft"``, ``attention="blocked"``). It comes from the config
(``kernel.hints``) or from the `hint` context manager, which wins over the
config and nests (the innermost wins). A hinted kernel is used for every
convolution it can handle, without tuning; where it cannot, the selection
goes on as if there were no hint, and a `HintWarning` says so once per kernel
and bucket in a tuning session. Hints are read when a function is traced, so a jitted
function keeps the hints of its first trace (`select_kernels(..., jit=True)`
re-traces when they change).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from tunedjax import _tuning
from tunedjax._config import FrozenDict, get_config
from tunedjax._errors import AutotuneError, did_you_mean, format_choices
from tunedjax.autotune import _registry


class HintWarning(UserWarning):
  """A hinted kernel cannot run a site it was hinted for.

  The site uses the normal selection instead (cache, tuner, or xla).
  """


_HINTS: contextvars.ContextVar[FrozenDict] = contextvars.ContextVar(
    "tunedjax_kernel_hints", default=FrozenDict())


def check_hints(hints: Mapping[str, Any], *, where: str = "autotune.hint") -> FrozenDict:
  """Validates ``{op family: kernel name}``; raises naming the bad family or kernel.

  Args:
    hints: the hints, e.g. ``{"conv": "fft"}``.
    where: how the error message names the source of the hints.

  Returns:
    The hints as a `FrozenDict`.

  Raises:
    AutotuneError: an unknown op family, or a kernel name not registered for it.

  Example:
    >>> check_hints({"conv": "xla"})
    FrozenDict({'conv': 'xla'})
    >>> check_hints({"conv": "fftt"})
    Traceback (most recent call last):
    ...
    tunedjax._errors.AutotuneError: autotune.hint: unknown conv kernel 'fftt'...
  """
  families = [f.name for f in _registry.op_families()]
  for op, name in hints.items():
    if op not in families:
      raise AutotuneError(
          f"{where}: unknown op family {op!r}{did_you_mean(str(op), families)}; hints "
          f"can be given for {format_choices(families)}.")
    known = [k.name for k in _registry.kernels(op)]
    if not isinstance(name, str) or name not in known:
      raise AutotuneError(
          f"{where}: unknown {op} kernel {name!r}{did_you_mean(str(name), known)}. "
          f"Known {op} kernels: {format_choices(known)}.")
  return FrozenDict(hints)


@contextlib.contextmanager
def hint(**kernels: str) -> Iterator[FrozenDict]:
  """Pins kernels by op inside a ``with`` block (beats the tuner and the config).

  Args:
    **kernels: op family to kernel name, e.g. ``conv="fft"``; the families
      are those registered (``conv`` built in).

  Yields:
    The hints in force inside the block (outer ones merged in).

  Raises:
    AutotuneError: an unknown op family or kernel name (the message lists
      the known ones).

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


def hint_blocks() -> FrozenDict:
  """The hints of the `hint` blocks in force (not the config's): a new object
  whenever a block is entered or left, so a caller can tell by identity.

  Example:
    >>> with hint(conv="xla"):
    ...   dict(hint_blocks())
    {'conv': 'xla'}
  """
  return _HINTS.get()


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


def hinted_kernel(op: str, candidates: Any, hints: Mapping[str, str], label: str = "",
                  *, session: _tuning.TuningSession | None = None) -> str | None:
  """The hinted kernel for this site, or None (no hint, or not applicable).

  Warns once per (op, kernel, bucket label) and session where the hint cannot apply.

  Args:
    op: the op family.
    candidates: the kernels applicable to the site.
    hints: the active hints.
    label: the bucket's description (for the message and the warn-once key).
    session: the tuning session that remembers the warnings (default: the current one).

  Returns:
    The kernel name, or None.
  """
  name = hints.get(op)
  if name is None:
    return None
  if name in {k.name for k in candidates}:
    return name
  session = _tuning.current_session() if session is None else session
  if session.first_time(("hint", op, name, label)):
    warnings.warn(
        f"The kernel hint {op}={name!r} does not apply to {label or 'a ' + op + ' site'}; "
        f"it uses the normal selection among {format_choices(k.name for k in candidates)}.",
        HintWarning, stacklevel=2)
  return None
