"""Patterns: a rewrite of several equations at once (a batch norm, an attention).

A rule (`Rule`) replaces one equation of a primitive. A *pattern* is a
function ``(ctx, jaxpr) -> [Match, ...]`` that a `Pass` carries
(``Pass(patterns=...)``): the engine calls it once per jaxpr it evaluates
(nested bodies too), before evaluating it. A `Match` names the equations it
replaces (indices into ``jaxpr.eqns``, whole equations: a call or a
``custom_jvp_call`` is replaced whole or not at all, though a pattern may
look into its body to recognise it), the values it reads from outside
(``inputs``), the values it defines that other equations read
(``outputs``), and ``rule(ctx, invals) -> outvals``.

`plan` decides which matches fire, and where:

- overlapping matches: the first wins (a match overlapping one that fires
  is dropped);
- each match fires at the first point where all its inputs are defined,
  and only if that point is before every equation outside it that reads
  one of its outputs, and only if every value its equations define that
  is read outside them is among its ``outputs``; otherwise it is dropped
  (left alone: its equations are evaluated as written);
- matches linked by ``requires`` fire together or not at all, a match never
  before those it requires (a forward and the backward that uses its
  residuals).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tunedjax import rewrite
  >>> def sin_times_two(ctx, jaxpr):  # sin(x) * 2.0 -> 2.0 * cos(x), as one site
  ...   found = []
  ...   for i, e in enumerate(jaxpr.eqns):
  ...     for j, f in enumerate(jaxpr.eqns):
  ...       if (e.primitive.name == "sin" and f.primitive.name == "mul"
  ...           and f.invars[0] is e.outvars[0]):
  ...         found.append(rewrite.Match(
  ...             eqns=(i, j), inputs=(e.invars[0],), outputs=(f.outvars[0],),
  ...             rule=lambda ctx, invals: [2.0 * jnp.cos(invals[0])], name="sin*2"))
  ...   return found
  >>> p = rewrite.Pass("toy", patterns=(sin_times_two,))
  >>> f = lambda x: jnp.sin(x) * 2.0 + 1.0
  >>> [e.primitive.name for e in jax.make_jaxpr(rewrite.transform(f, p))(0.5).eqns]
  ['cos', 'mul', 'add']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tunedjax.rewrite import _compat


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Match:
  """Equations of one jaxpr a pattern replaces with one rule.

  Attributes:
    eqns: indices into ``jaxpr.eqns`` of the equations replaced.
    inputs: the values (jaxpr variables or literals) the rule reads, defined
      outside `eqns`, in the order the rule takes them.
    outputs: the variables defined by `eqns` that the rule returns: every
      one read outside `eqns` (by other equations, other matches or the
      jaxpr's outputs) must be here.
    rule: ``rule(ctx, invals) -> outvals``, one value per output (arrays,
      tracers, or whatever the pass keeps in its environment).
    name: what the match is, for logs (``"batch_norm two-pass"``).
    requires: matches that must fire for this one to fire (and fire before
      it); if any of them is dropped, so is this one, and the other way
      round.
  """

  eqns: tuple[int, ...]
  inputs: tuple[Any, ...]
  outputs: tuple[Any, ...]
  rule: Callable[[Any, Sequence[Any]], Sequence[Any]]
  name: str = "pattern"
  requires: tuple[Match, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "eqns", tuple(int(i) for i in self.eqns))
    object.__setattr__(self, "inputs", tuple(self.inputs))
    object.__setattr__(self, "outputs", tuple(self.outputs))
    object.__setattr__(self, "requires", tuple(self.requires))
    if not callable(self.rule):
      raise TypeError(f"Match {self.name!r}: rule must be callable "
                      f"(ctx, invals) -> outvals, got {self.rule!r}.")
    if not self.eqns:
      raise TypeError(f"Match {self.name!r}: eqns must name at least one equation.")


Pattern = Callable[[Any, "_compat.Jaxpr"], Sequence[Match]]


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which matches fire in one jaxpr, and where.

  Attributes:
    fire: ``{i: matches}``: the matches to fire just before equation ``i``
      (``i == len(jaxpr.eqns)``: after the last), in firing order.
    skip: the equations the firing matches replace.
    matches: every firing match, in firing order.
    dropped: the matches left alone, with why (for logs and tests).
  """

  fire: Mapping[int, tuple[Match, ...]]
  skip: frozenset[int]
  matches: tuple[Match, ...]
  dropped: tuple[tuple[Match, str], ...] = ()


EMPTY_PLAN = Plan({}, frozenset(), ())


def _group(match: Match, by_id: Mapping[int, Match]) -> list[Match]:
  """`match` and every match linked to it through `requires`, either way."""
  linked: dict[int, list[Match]] = {}
  for m in by_id.values():
    for r in m.requires:
      linked.setdefault(id(m), []).append(r)
      linked.setdefault(id(r), []).append(m)
  seen, todo = {id(match): match}, [match]
  while todo:
    for other in linked.get(id(todo.pop()), ()):
      if id(other) not in seen:
        seen[id(other)] = other
        todo.append(other)
  return list(seen.values())


def _definitions(jaxpr: Any) -> dict[Any, int]:
  """``{var: index of the equation defining it}`` (inputs and consts: -1)."""
  where: dict[Any, int] = {v: -1 for v in (*jaxpr.constvars, *jaxpr.invars)}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.outvars:
      if not isinstance(v, _compat.DropVar):
        where[v] = i
  return where


def _readers(jaxpr: Any) -> dict[Any, list[int]]:
  """``{var: indices of the equations reading it}`` (the jaxpr's outputs read at len(eqns))."""
  readers: dict[Any, list[int]] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, _compat.Literal):
        readers.setdefault(v, []).append(i)
  for v in jaxpr.outvars:
    if not isinstance(v, _compat.Literal):
      readers.setdefault(v, []).append(len(jaxpr.eqns))
  return readers


class _Planner:
  """`plan`'s state: the live matches and what they define."""

  def __init__(self, jaxpr: Any, matches: Sequence[Match]):
    self.jaxpr = jaxpr
    self.defined_at = _definitions(jaxpr)
    self.readers = _readers(jaxpr)
    self.live: dict[int, Match] = {}
    self.dropped: list[tuple[Match, str]] = []
    n = len(jaxpr.eqns)
    taken: set[int] = set()
    for m in matches:
      bad = [i for i in m.eqns if not 0 <= i < n]
      if bad:
        self.dropped.append((m, f"equation indices {bad} out of range 0..{n - 1}"))
      elif taken.intersection(m.eqns):
        self.dropped.append((m, "overlaps an earlier match"))
      else:
        taken.update(m.eqns)
        self.live[id(m)] = m
    for m in list(self.live.values()):  # a match requiring one not offered
      if any(id(r) not in self.live for r in m.requires) and id(m) in self.live:
        self.drop(m, "requires a match that was dropped")

  def drop(self, match: Match, why: str) -> None:
    for m in _group(match, self.live):
      if self.live.pop(id(m), None) is not None:
        self.dropped.append((m, why if m is match else f"linked to a match that {why}"))

  def points(self) -> dict[int, int] | None:
    """Each live match's firing point, or None after dropping one that cannot fire."""
    skip = {i for m in self.live.values() for i in m.eqns}
    made_by = {v: m for m in self.live.values() for v in m.outputs}
    point: dict[int, int] = {}
    for _ in range(len(self.live) + 1):
      changed = False
      for m in self.live.values():
        p = max([point.get(id(r), 0) for r in m.requires] + [0])
        for v in m.inputs:
          if isinstance(v, _compat.Literal):
            continue
          if v in made_by and made_by[v] is not m:
            p = max(p, point.get(id(made_by[v]), 0))
          elif v not in self.defined_at:
            self.drop(m, f"reads {v}, which this jaxpr does not define")
            return None
          elif self.defined_at[v] in skip:
            self.drop(m, f"reads {v}, defined by an equation another match replaces")
            return None
          else:
            p = max(p, self.defined_at[v] + 1)
        if point.get(id(m)) != p:
          point[id(m)], changed = p, True
      if not changed:
        return point
    first = next(iter(self.live.values()))
    self.drop(first, "is part of a cycle of matches")
    return None

  def check(self, point: dict[int, int]) -> bool:
    """Drops one match that cannot fire at its point; True when all can."""
    owner = {i: m for m in self.live.values() for i in m.eqns}
    for m in self.live.values():
      group = {id(g) for g in _group(m, self.live)}
      mine = set(m.eqns)
      for i in m.eqns:
        for v in self.jaxpr.eqns[i].invars:
          if isinstance(v, _compat.Literal) or v in m.inputs:
            continue
          at = self.defined_at.get(v, -1)
          if at not in mine and not (at in owner and id(owner[at]) in group):
            self.drop(m, f"reads {v} without taking it as an input")
            return False
        for v in self.jaxpr.eqns[i].outvars:
          outside = [r for r in self.readers.get(v, ()) if r not in owner]
          if not outside and not any(v in o.inputs for o in self.live.values()):
            continue
          if v not in m.outputs:
            self.drop(m, f"defines {v}, read outside it but not among its outputs")
            return False
          if outside and min(outside) < point[id(m)]:
            self.drop(m, f"cannot fire before equation {min(outside)}, which reads {v}")
            return False
    return True


def plan(jaxpr: Any, matches: Sequence[Match]) -> Plan:
  """Decides which of `matches` fire in `jaxpr`, and where (see the module docstring).

  Args:
    jaxpr: the (open) jaxpr the matches index into.
    matches: what the patterns found, first wins on overlaps.

  Returns:
    A `Plan`.
  """
  if not matches:
    return EMPTY_PLAN
  planner = _Planner(jaxpr, matches)
  while planner.live:
    point = planner.points()
    if point is not None and planner.check(point):
      break
  else:
    return Plan({}, frozenset(), (), tuple(planner.dropped))
  order = sorted(planner.live.values(), key=lambda m: point[id(m)])  # stable: list order
  fire: dict[int, list[Match]] = {}
  for m in order:
    fire.setdefault(point[id(m)], []).append(m)
  return Plan({i: tuple(ms) for i, ms in fire.items()},
              frozenset(i for m in order for i in m.eqns), tuple(order),
              tuple(planner.dropped))
