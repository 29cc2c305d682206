"""`LayerRoute`: a Flax layer class's calls sent to an op family while programs are traced.

A family whose sites are Flax layers (batch norm's ``BatchNorm``, layer norm's
``LayerNorm``) routes them with one `LayerRoute`: while any thread is inside
`LayerRoute.routed`, the nnx class's ``__call__`` is the family's replacement
(installed by the first thread in, put back by the last out), which routes
only calls made in a thread that is inside (`LayerRoute.routing`: inside, and
kernel selection active) and runs `LayerRoute.original` otherwise; linen layers
go through `flax.linen.intercept_methods`, which is per-thread itself. The
family's public context manager subclasses `RouteContext`, which also
decorates. This module names no family.

Example:
  >>> from flax import nnx
  >>> def call(self, x, **kwargs):  # a replacement that routes nothing
  ...   return ROUTE.original(self, x, **kwargs)
  >>> ROUTE = LayerRoute(lambda: nnx.LayerNorm, call,
  ...                    lambda next_fun, args, kwargs, context: next_fun(*args, **kwargs))
  >>> before = nnx.LayerNorm.__call__
  >>> with ROUTE.routed():
  ...   inside, routing = nnx.LayerNorm.__call__ is call, ROUTE.routing()
  >>> inside, routing, nnx.LayerNorm.__call__ is before  # no kernel selection: not routing
  (True, False, True)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Self


class LayerRoute:
  """One Flax layer class routed to a family: the nnx method swap and the linen interceptor.

  Args:
    nnx_class: ``() -> the nnx class`` (Flax is imported when the route is entered).
    nnx_call: the replacement ``__call__``; it calls `original` for calls it does not route.
    linen_interceptor: a `flax.linen.intercept_methods` interceptor for the linen layers.
  """

  def __init__(self, nnx_class: Callable[[], type], nnx_call: Callable[..., Any],
               linen_interceptor: Callable[..., Any]):
    self._nnx_class, self._nnx_call, self._interceptor = nnx_class, nnx_call, linen_interceptor
    self._lock, self._local = threading.Lock(), threading.local()
    self._count = 0
    self.original: Callable[..., Any] | None = None

  def routing(self) -> bool:
    """Whether this thread is inside `routed` with kernel selection active."""
    if not getattr(self._local, "depth", 0):
      return False
    from tunedjax.autotune import _select  # pylint: disable=import-outside-toplevel
    return _select.active_selection() is not None

  def _install(self) -> None:
    with self._lock:
      if self._count == 0:
        cls = self._nnx_class()
        self.original = cls.__call__
        cls.__call__ = self._nnx_call
      self._count += 1

  def _uninstall(self) -> None:
    with self._lock:
      self._count -= 1
      if self._count == 0:
        self._nnx_class().__call__ = self.original

  @contextlib.contextmanager
  def routed(self) -> Iterator[None]:
    """This thread inside the route: the nnx swap installed, linen's calls intercepted."""
    from flax import linen as nn  # pylint: disable=import-outside-toplevel
    self._install()
    self._local.depth = getattr(self._local, "depth", 0) + 1
    try:
      with nn.intercept_methods(self._interceptor):
        yield
    finally:
      self._local.depth -= 1
      self._uninstall()

  def push(self, context: Any) -> None:
    """Keeps an entered context for this thread (`RouteContext.__enter__`)."""
    self._local.contexts = [*getattr(self._local, "contexts", []), context]

  def pop(self) -> Any:
    """This thread's last entered context (`RouteContext.__exit__`)."""
    return self._local.contexts.pop()


class RouteContext:
  """A family's public route: a context manager that also decorates.

  Subclasses set `route` (their `LayerRoute`); entering routes this thread's
  calls of the layer class while kernel selection is active, and a decorated
  function runs inside it on every call.
  """

  route: ClassVar[LayerRoute]

  def __enter__(self) -> Self:
    context = self.route.routed()
    context.__enter__()  # pylint: disable=unnecessary-dunder-call
    # Per thread, not on this object: one instance may be entered by several threads.
    self.route.push(context)
    return self

  def __exit__(self, *exc: object) -> bool:
    return bool(self.route.pop().__exit__(*exc))

  def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, run inside the context on every call."""

    @functools.wraps(fn)
    def routed(*args: Any, **kwargs: Any) -> Any:
      with self.route.routed():
        return fn(*args, **kwargs)

    return routed
