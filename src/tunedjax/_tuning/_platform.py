"""Platform names, the one spelling every tuner uses.

JAX names GPU backends ``"cuda"`` or ``"rocm"`` and devices ``"gpu"``; the
tuners key their choices by ``"cpu"``, ``"gpu"`` or ``"tpu"``.

Example:
  >>> canonical_platform("CUDA"), canonical_platform("cpu")
  ('gpu', 'cpu')
"""

from __future__ import annotations

import os

import jax

from tunedjax import _errors

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def canonical_platform(platform: str | None = None) -> str:
  """Maps a platform or backend name to ``"cpu"``, ``"gpu"`` or ``"tpu"``.

  Args:
    platform: a JAX platform or backend name in any case (``"cuda"`` and
      ``"rocm"`` mean ``"gpu"``); None for JAX's default backend.

  Returns:
    One of `PLATFORMS`.

  Raises:
    ConfigError: an unknown name (the message lists the valid ones).

  Example:
    >>> canonical_platform("rocm")
    'gpu'
  """
  if platform is None:
    platform = jax.default_backend()
  name = str(platform).lower()
  name = _ALIASES.get(name, name)
  if name not in PLATFORMS:
    raise _errors.ConfigError(
        f"Unknown platform {platform!r}{_errors.did_you_mean(name, PLATFORMS)}. "
        f"Valid platforms: {_errors.format_choices(PLATFORMS + tuple(_ALIASES))}.")
  return name


def usable_cores() -> int:
  """The cores this process may run on (its CPU affinity), not the machine's count.

  Example:
    >>> usable_cores() >= 1
    True
  """
  try:
    return len(os.sched_getaffinity(0)) or 1
  except (AttributeError, OSError):  # no affinity on this platform
    return os.cpu_count() or 1
