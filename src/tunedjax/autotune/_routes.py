"""Routes: what an op family does while a program is traced for kernel selection.

Some sites of a family cannot be seen in a jaxpr as a primitive or a
pattern, but only in the Python code that writes the program: a Flax layer
whose call can be sent to the family's call-site function (Flax's
``BatchNorm`` layers, its attention modules). A family registers a **route**
for them: a function returning a context manager, entered around the trace
of every program `tunedjax.jit` compiles with kernel selection on (the
Trainer's train step included), so the program reaches the family without
the user naming it. This registry names no family.

Example:
  >>> import contextlib
  >>> seen = []
  >>> @contextlib.contextmanager
  ... def route():
  ...   seen.append("in")
  ...   yield
  >>> register_route("example", route)
  >>> with routed():
  ...   pass
  >>> unregister_route("example"); seen
  ['in']
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

from tunedjax._errors import AutotuneError
from tunedjax.autotune import _registry

Route = Callable[[], ContextManager[Any]]

_LOCK = threading.Lock()
_ROUTES: dict[str, Route] = {}


def register_route(name: str, route: Route, *, replace: bool = False) -> None:
  """Registers `route` under `name` (an op family's name, by convention).

  Args:
    name: who registers it; a second registration under one name raises
      unless `replace`.
    route: ``route() -> context manager``, entered around each program's
      trace under kernel selection, in the order of registration.
    replace: replace a route of this name.

  Raises:
    AutotuneError: `route` is not callable, or `name` is taken and not `replace`.
  """
  if not callable(route):
    raise AutotuneError(f"register_route({name!r}, route): route must be a function "
                        f"returning a context manager, got {route!r}.")
  with _LOCK:
    if name in _ROUTES and not replace:
      raise AutotuneError(f"register_route: a route named {name!r} is registered "
                          "already; pass replace=True to replace it.")
    _ROUTES[name] = route


def unregister_route(name: str) -> None:
  """Removes the route called `name` (nothing if there is none)."""
  with _LOCK:
    _ROUTES.pop(name, None)


def route_names() -> tuple[str, ...]:
  """The registered routes' names, in the order they are entered."""
  _registry.load_op_families()
  with _LOCK:
    return tuple(_ROUTES)


@contextlib.contextmanager
def routed() -> Iterator[None]:
  """Enters every registered route (the op families loaded first), innermost last."""
  _registry.load_op_families()
  with _LOCK:
    routes = list(_ROUTES.values())
  with contextlib.ExitStack() as stack:
    for route in routes:
      stack.enter_context(route())
    yield
