"""`tj.jit`'s options, checked once and frozen: the level, static and donated
arguments (as `jax.jit` takes them), the platform, the session, and whether
the whole-program check runs."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from tunedjax import _errors
from tunedjax import _tuning
from tunedjax._config import LEVELS

def check_level(level: Any) -> str | None:
  if level is None or (isinstance(level, str) and level in LEVELS):
    return level
  raise _errors.ConfigError(
      f"tunedjax.jit(level=...) must be one of {_errors.format_choices(LEVELS)} "
      f"(or None for the config's level), got {level!r}"
      f"{_errors.did_you_mean(str(level), LEVELS)}.")


def as_tuple(name: str, value: Any, kind: type) -> tuple[Any, ...]:
  if value is None:
    return ()
  items = (value,) if isinstance(value, kind) else value
  try:
    items = tuple(items)
  except TypeError:
    items = (value,)
  bad = [v for v in items if not isinstance(v, kind) or isinstance(v, bool)]
  if bad:
    raise TypeError(f"tunedjax.jit({name}=...) must be {'an int' if kind is int else 'a str'} "
                    f"or a sequence of them, got {value!r}.")
  return items


def _argnames_to_nums(fun: Callable[..., Any], names: Sequence[str]) -> dict[str, int]:
  """Positions of the named parameters that can be passed positionally."""
  try:
    params = list(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):
    return {}
  positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  return {p.name: i for i, p in enumerate(params) if p.kind in positional and p.name in names}


def _all_names(fun: Callable[..., Any]) -> tuple[str, ...]:
  try:
    return tuple(inspect.signature(fun).parameters)
  except (TypeError, ValueError):
    return ()


def check_static_and_donated(fun: Callable[..., Any], static_argnums: tuple[int, ...],
                              static_argnames: tuple[str, ...], donate_argnums: tuple[int, ...],
                              donate_argnames: tuple[str, ...]) -> None:
  names = _argnames_to_nums(fun, static_argnames + donate_argnames)
  static = set(static_argnums) | {names[n] for n in static_argnames if n in names}
  donated = set(donate_argnums) | {names[n] for n in donate_argnames if n in names}
  both = sorted(static & donated) + sorted(set(static_argnames) & set(donate_argnames))
  if both:
    raise _errors.ConfigError(
        f"tunedjax.jit: argument(s) {both} are both static and donated. A static "
        "argument is a Python value baked into the program, not a buffer: it cannot "
        "be donated. Remove it from donate_argnums/donate_argnames or from "
        "static_argnums/static_argnames.")


@dataclasses.dataclass(frozen=True)
class JitOptions:
  """A `Jitted`'s options, normalised as `jax.jit` does: a static name passed
  by position is static too, and back.

  Attributes:
    level: ``"O0"``, ``"O1"``, ``"O2"``, or None for the config's level at each call.
    static_argnums: the static positions (named ones included).
    static_argnames: the static names (positional ones included).
    donate_argnums: the donated positions (named ones included).
    donate_argnames: the donated names.
    platform: the platform the passes tune for (None: JAX's default backend).
    session: the `TuningSession` kernel selection follows (None: the current one).
    verify: whether the whole-program check may run.

  Example:
    >>> JitOptions.of(lambda x, n: x * n, static_argnames=("n",)).static_argnums
    (1,)
  """

  level: str | None = None
  static_argnums: tuple[int, ...] = ()
  static_argnames: tuple[str, ...] = ()
  donate_argnums: tuple[int, ...] = ()
  donate_argnames: tuple[str, ...] = ()
  platform: str | None = None
  session: _tuning.TuningSession | None = None
  verify: bool = True

  @classmethod
  def of(cls, fun: Callable[..., Any], *, static_argnums: tuple[int, ...] = (),
         static_argnames: tuple[str, ...] = (), donate_argnums: tuple[int, ...] = (),
         donate_argnames: tuple[str, ...] = (), **rest: Any) -> JitOptions:
    """The options for `fun`, each static and donated argument by position and by name."""
    positions = _argnames_to_nums(fun, static_argnames)
    names = {i: n for n, i in _argnames_to_nums(fun, _all_names(fun)).items()}
    donate_positions = _argnames_to_nums(fun, donate_argnames)
    return cls(
        static_argnums=tuple(sorted(set(static_argnums) | set(positions.values()))),
        static_argnames=tuple(dict.fromkeys(
            static_argnames + tuple(names[i] for i in static_argnums if i in names))),
        donate_argnums=tuple(sorted(set(donate_argnums) | set(donate_positions.values()))),
        donate_argnames=donate_argnames, **rest)

  @property
  def jax_jit(self) -> dict[str, Any]:
    """The keywords for `jax.jit`, given in full: the rewriting wrapper's
    (*args, **kwargs) hides the names from jax.jit."""
    return dict(static_argnums=self.static_argnums, static_argnames=self.static_argnames,
                donate_argnums=self.donate_argnums, donate_argnames=self.donate_argnames)

  def split_static(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """A call's static arguments, its dynamic ones, and a function that puts them back."""
    n = len(args)
    static_pos = {i % n if n else i for i in self.static_argnums if -n <= i < n}
    static = {i: args[i] for i in sorted(static_pos)}
    static.update({k: kwargs[k] for k in self.static_argnames if k in kwargs})
    dyn_pos = [i for i in range(n) if i not in static_pos]
    dyn_args = tuple(args[i] for i in dyn_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static}

    def rebuild(*d_args: Any, **d_kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
      full = list(args)
      for i, x in zip(dyn_pos, d_args):
        full[i] = x
      return tuple(full), {**{k: kwargs[k] for k in static if isinstance(k, str)}, **d_kwargs}

    return static, dyn_args, dyn_kwargs, rebuild
