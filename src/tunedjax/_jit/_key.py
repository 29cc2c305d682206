"""The key a compiled program is filed under: what the passes depended on.

A `ProgramKey` names its fields; with kernel selection off only ``level``
(and, above O0, ``config``) are set.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax

UNTUNED = "untuned"  # the variant with every decision on its default (its phase key)
SELECT = "select"  # the tune phase's key (`TuningSession.phase_key`)
OBSERVE = "observe"  # the observe phase's key


class ProgramKey(NamedTuple):
  """What a compiled program depends on.

  Attributes:
    level: ``"O0"``, ``"O1"`` or ``"O2"``.
    config: the `Config` (None at O0).
    session: the `TuningSession` (None with kernel selection off).
    phase: the session's phase key (``"select"``, ``"observe"``, ... or
      `UNTUNED` for the whole-program check's untuned variant).
    hints: the active kernel hints.
    native_suspended: whether native kernels are suspended.
    vetoed: the buckets put back on their defaults (a variant of the check).

  Example:
    >>> key = ProgramKey("O1", None, object(), SELECT, (), False)
    >>> key.selects, key.variant(UNTUNED).phase
    (True, 'untuned')
  """

  level: str
  config: Any = None
  session: Any = None
  phase: Hashable = None
  hints: Hashable = None
  native_suspended: bool = False
  vetoed: frozenset[str] = frozenset()

  @property
  def selects(self) -> bool:
    """Whether kernel selection is on for this program."""
    return self.session is not None

  def base(self) -> Hashable | None:
    """The key less what only kernel sites depend on (phase, hints, vetoed
    buckets); None without kernel selection."""
    if not self.selects:
      return None
    return (self.level, self.config, self.session, self.native_suspended)

  def variant(self, variant: Any) -> ProgramKey:
    """This key's program for a variant of the check: None (as tuned),
    `UNTUNED`, or a set of vetoed buckets."""
    if variant is None:
      return self._replace(vetoed=frozenset())
    if variant == UNTUNED:
      return self._replace(phase=UNTUNED, vetoed=frozenset())
    return self._replace(vetoed=variant)


def arg_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
  """The structure, shapes and dtypes of a call's arguments: calls with the
  same key run the same program (only those are compared)."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  return treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))))
                        for x in leaves)
