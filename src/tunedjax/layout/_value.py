"""How the layout pass holds values: an array plus the permutation it is stored in.

Inside the pass a value is one of three things:

* a plain array (or tracer) in the program's own, *logical* layout;
* a `Laid` value: ``array == transpose(logical, perm)``, so physical axis
  ``i`` holds logical axis ``perm[i]``;
* a `Bcast` value: a ``broadcast_in_dim`` not yet bound, so that a bias or a
  scalar broadcast against a re-laid activation is broadcast straight into
  the activation's layout instead of being transposed.

`LayoutState` holds what one trace of the pass learns (counters, conversions
already made); `to_perm` and `logical` convert between the forms and count the
transposes they insert.

Example:
  >>> import jax.numpy as jnp
  >>> st = LayoutState("NHWC")
  >>> x = jnp.arange(24.0).reshape(1, 2, 3, 4)            # NCHW
  >>> v = Laid(st.to_perm(x, (0, 2, 3, 1)), (0, 2, 3, 1))  # held as NHWC
  >>> v.array.shape, bool((st.logical(v) == x).all())
  ((1, 3, 4, 2), True)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax

Perm = tuple[int, ...]


def identity(n: int) -> Perm:
  """The permutation that leaves `n` axes in place."""
  return tuple(range(n))


def inverse(perm: Sequence[int]) -> Perm:
  """The permutation that undoes `perm`: ``inverse(p)[p[i]] == i``."""
  inv = [0] * len(perm)
  for i, a in enumerate(perm):
    inv[a] = i
  return tuple(inv)


def is_identity(perm: Sequence[int]) -> bool:
  """Whether `perm` leaves every axis in place."""
  return all(i == a for i, a in enumerate(perm))


@dataclasses.dataclass(frozen=True, eq=False)
class Laid:
  """An array stored as ``transpose(logical, perm)``.

  Attributes:
    array: the physical array (its shape is the logical shape permuted).
    perm: physical axis ``i`` holds logical axis ``perm[i]``; never the identity.
  """

  array: Any
  perm: Perm

  @property
  def logical_shape(self) -> tuple[int, ...]:
    shape = self.array.shape
    inv = inverse(self.perm)
    return tuple(shape[inv[a]] for a in range(len(shape)))


@dataclasses.dataclass(frozen=True, eq=False)
class Bcast:
  """``lax.broadcast_in_dim(operand, shape, dims)``, bound when its layout is known."""

  operand: Any
  shape: tuple[int, ...]
  dims: tuple[int, ...]


def wrap(array: Any, perm: Perm) -> Any:
  """`array` as a pass value: plain when `perm` is the identity, else `Laid`."""
  return array if is_identity(perm) else Laid(array, tuple(perm))


def perm_of(value: Any) -> Perm | None:
  """The permutation a value is held in, None for a plain (logical) value."""
  return value.perm if isinstance(value, Laid) else None


def rank_of(value: Any) -> int:
  """The logical rank of a pass value (plain, `Laid` or `Bcast`)."""
  if isinstance(value, Laid):
    return len(value.perm)
  if isinstance(value, Bcast):
    return len(value.shape)
  return len(jax.typeof(value).shape)


def _squeezable(shape: Sequence[int], perm: Perm) -> bool:
  """Whether ``transpose(x, perm)`` only moves size-1 axes (so it is a reshape)."""
  big = [a for a in range(len(shape)) if shape[a] != 1]
  return [a for a in perm if shape[a] != 1] == big


class LayoutState:
  """What one trace of the layout pass learns and has already built.

  Attributes:
    target: ``"NHWC"`` or ``"NCHW"``.
    counts: counters shown in the report ("convolutions re-laid", ...).
    kernel_inputs: ``{input index: perm}``: the function's inputs (seen
      through casts) that the pass transposes into a convolution kernel's
      layout at every call; inputs read by convolutions in two different
      layouts are left out. Filled only when `track_inputs` was called.
  """

  def __init__(self, target: str):
    self.target = target
    self.counts: collections.Counter[str] = collections.Counter()
    self.kernel_inputs: dict[int, Perm] = {}
    self._memo: dict[tuple[int, Perm], tuple[Any, Any]] = {}
    self._logical_memo: dict[int, tuple[Any, Any]] = {}
    self._inputs: dict[int, tuple[Any, int]] = {}  # id(value) -> (value, input index)
    self._conflicting: set[int] = set()

  def count(self, what: str, n: int = 1) -> None:
    self.counts[what] += n

  def track_inputs(self, values: Sequence[Any]) -> None:
    """Remembers the function's inputs, so `kernel_inputs` can name them."""
    for i, value in enumerate(values):
      self._inputs.setdefault(id(value), (value, i))

  def same_input(self, source: Any, derived: Any) -> None:
    """`derived` is `source` cast (same shape): it stands for the same input."""
    hit = self._inputs.get(id(source))
    if hit is not None:
      self._inputs.setdefault(id(derived), (derived, hit[1]))

  def note_kernel(self, value: Any, perm: Perm) -> None:
    """A plain `value` was transposed to `perm` for a convolution's kernel."""
    hit = self._inputs.get(id(value))
    if hit is None or is_identity(perm):
      return
    index = hit[1]
    if index in self._conflicting:
      return
    if self.kernel_inputs.setdefault(index, tuple(perm)) != tuple(perm):
      del self.kernel_inputs[index]  # two layouts wanted: storing either one helps neither
      self._conflicting.add(index)

  def converted(self, value: Any) -> list[tuple[Perm, Any]]:
    """The layouts a plain value was already converted to (no new transposes)."""
    return [(key[1], out) for key, (src, out) in self._memo.items() if src is value]

  def logical(self, value: Any) -> Any:
    """`value` as a plain array in its logical layout."""
    if isinstance(value, Bcast):
      return lax.broadcast_in_dim(value.operand, value.shape, value.dims)
    if not isinstance(value, Laid):
      return value
    hit = self._logical_memo.get(id(value))
    if hit is not None:
      return hit[1]
    shape = value.array.shape
    inv = inverse(value.perm)
    if _squeezable(shape, inv):
      out = lax.reshape(value.array, value.logical_shape)
    else:
      out = lax.transpose(value.array, inv)
      self.count("transposes back to the original layout")
    self._logical_memo[id(value)] = (value, out)
    return out

  def to_perm(self, value: Any, perm: Perm) -> Any:
    """`value` as a physical array held in `perm` (``transpose(logical, perm)``)."""
    perm = tuple(perm)
    if isinstance(value, Laid):
      if value.perm == perm:
        return value.array
      inv = inverse(value.perm)
      rel = tuple(inv[p] for p in perm)
      return self._transpose(value.array, rel, "transposes between layouts")
    if isinstance(value, Bcast):
      return self._broadcast(value, perm)
    if is_identity(perm):
      return value
    return self._transpose(value, perm, "transposes into the target layout")

  def _transpose(self, array: Any, perm: Perm, what: str) -> Any:
    if is_identity(perm):
      return array
    key = (id(array), perm)
    hit = self._memo.get(key)
    if hit is not None:
      return hit[1]
    shape = jax.typeof(array).shape
    if _squeezable(shape, perm):
      out = lax.reshape(array, tuple(shape[a] for a in perm))
    else:
      out = lax.transpose(array, perm)
      self.count(what)
    self._memo[key] = (array, out)
    return out

  def _broadcast(self, value: Bcast, perm: Perm) -> Any:
    inv = inverse(perm)
    dims = tuple(inv[d] for d in value.dims)
    shape = tuple(value.shape[a] for a in perm)
    if list(dims) == sorted(dims):
      return lax.broadcast_in_dim(value.operand, shape, dims)
    # The operand's own axes must be reordered first: transpose the small operand.
    order = sorted(range(len(dims)), key=lambda j: dims[j])
    operand = self._transpose(value.operand, tuple(order), "transposes into the target layout")
    return lax.broadcast_in_dim(operand, shape, tuple(sorted(dims)))
