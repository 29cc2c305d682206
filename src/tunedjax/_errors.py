"""Errors raised by tunedjax.

Every error says what was wrong, shows the offending value, and says how to fix
it (equinox and grain style). Long message templates live here as constants so
that the code raising them stays readable and the wording stays consistent.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TunedJaxError(Exception):
  """Base class of every error tunedjax raises on purpose.

  Catch this to handle any tunedjax error; the subclasses say which part failed.
  """


class ConfigError(TunedJaxError, ValueError):
  """A configuration key, type or value is not valid.

  Raised by `tunedjax.set_config`, `tunedjax.config_context` and when reading
  the file named by ``$TUNEDJAX_CONFIG``. The message names the key, shows the
  value and lists what is allowed.

  Example:
    >>> import tunedjax as tj
    >>> try:
    ...   tj.set_config({"kernel": {"tuning_range": [10, 1]}})
    ... except tj.ConfigError as e:
    ...   print("kernel.tuning_range" in str(e))
    True
  """


class RewriteError(TunedJaxError):
  """A rewrite pass produced something that does not fit the program.

  For example a rule returned a value of another shape or dtype than the
  equation it replaced, where the program needs the original type (a loop
  carry, the output of a sub-jaxpr). The message names the pass, the primitive
  and the expected and received types.
  """


class AutotuneError(TunedJaxError):
  """Kernel selection was asked for something it cannot do.

  An unknown op family or kernel name, a kernel that does not fit its
  family, tuning options out of range.
  """


class ShapeError(AutotuneError, ValueError):
  """An op's array arguments do not fit: a rank, shape or dtype that is not valid.

  A `ValueError` too, as JAX's and Flax's own checks raise, so a caller's
  ``except ValueError`` catches it where it caught theirs (`tunedjax.attention`,
  and Flax's attention through `tunedjax.use_tuned_attention`). The message
  names the argument, its shape or dtype and what is allowed.

  Example:
    >>> import numpy as np
    >>> import tunedjax as tj
    >>> q = np.ones((1, 4, 2, 8), np.float32)
    >>> try:
    ...   tj.attention(q, q[:, :, :, :4], q[:, :, :, :4])
    ... except ValueError as e:
    ...   print(type(e).__name__, "head_dim" in str(e))
    ShapeError True
  """


class ShapeTypeError(ShapeError, TypeError):
  """A `ShapeError` where JAX raises a `TypeError`: an argument that is not an
  array, or a mask or bias that does not broadcast to the logits' shape.

  Both a `ValueError` and a `TypeError`, so either ``except`` catches it.
  """


class LayoutError(ConfigError):
  """The layout pass was asked for something it cannot do (an unknown target, mode or platform).

  A `ConfigError` too: these are bad option values.
  """


UNKNOWN_KEY = (
    "Unknown configuration key {key!r}{suggestion}. Valid keys here: {valid}."
)
BAD_TYPE = (
    "Configuration key {key!r} must be {expected}, got {value!r} "
    "(type {type_name})."
)
BAD_CHOICE = (
    "Configuration key {key!r} must be one of {choices}, got {value!r}."
)
BAD_RANGE = (
    "Configuration key {key!r} must be {expected}, got {value!r}."
)
BAD_FILE = (
    "Could not read a tunedjax configuration from {path!r}: {reason}. The file "
    "must hold one JSON object with the keys of tunedjax.Config, for example "
    '{{"kernel": {{"enable": true, "tuning_range": [1, 10]}}}}.'
)
BAD_SOURCE = (
    "{func} expects {accepted}; got {value!r} (type {type_name})."
)
IN_FILE = (
    "In the tunedjax configuration file {path!r}: {message}"
)
FROM_ENV = (
    " The path comes from the environment variable ${var}: fix the file or "
    "unset ${var}."
)
REWRITE_TYPE_MISMATCH = (
    "Pass {pass_name!r} changed the type of {where}: expected {expected}, got "
    "{got}. A rule may change types inside a region, but values that leave a "
    "sub-jaxpr (a loop carry, a branch output, a call result) or the function "
    "must keep their original type: give the Pass a `materialize` hook that "
    "converts them back."
)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
  """Returns ' (did you mean X?)' for the closest choice, or ''."""
  close = difflib.get_close_matches(word, list(choices), n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def format_choices(choices: Iterable[object]) -> str:
  """Formats valid choices as a readable list: 'a', 'b' or 'c'."""
  items = [repr(c) for c in choices]
  if len(items) <= 1:
    return "".join(items)
  return ", ".join(items[:-1]) + " or " + items[-1]


class CacheWarning(UserWarning):
  """A tuning cache could not be used as it is: unreadable, corrupt, invalid.

  tunedjax never crashes on a bad cache and never uses a bad entry: it warns
  with this category, moves an unusable file aside and measures again. Filter
  it like any warning (``warnings.simplefilter("error", tj.CacheWarning)``
  makes a bad cache fatal, e.g. in a CI job that checks a shared cache).
  """


class HostMemoryWarning(UserWarning):
  """tunedjax could not set up host memory as a CPU step needs it.

  Given when the host-memory settings are wanted (``TUNEDJAX_HOST_MEMORY=retain``,
  or a recorded measurement that they pay for this workload) but JAX's CPU
  backend started before tunedjax was imported (so each step may fault its
  temporary buffer in again), when ``$TUNEDJAX_HOST_MEMORY`` has a value that
  is not valid, or when the recorded decisions cannot be read (they are
  measured again). See `tunedjax.host_memory_status`.
  """


def show_value(value: object) -> str:
  """`value` for an error message: its repr (shortened), with its type unless plain.

  Example:
    >>> show_value(3), show_value([1, 2])
    ('3', '[1, 2] (type list)')
  """
  shown = repr(value)
  if len(shown) > 80:
    shown = shown[:77] + "..."
  if isinstance(value, (bool, int, float, str, type(None))):
    return shown
  return f"{shown} (type {type(value).__name__})"


def is_int(value: object) -> bool:
  """Whether `value` is an integer (Python or NumPy), not a bool.

  Example:
    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
  """
  import numpy as np  # pylint: disable=import-outside-toplevel
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))

