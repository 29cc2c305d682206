"""JAX's CPU client made synchronous before its backend starts, so that a first process can reuse memory.

With JAX's default asynchronous dispatch, XLA:CPU runs each program, and
allocates its temporary buffer, on a thread of its own pool. Each such thread
has its own glibc arena, which cannot hold a block over 64 MiB: glibc maps it
afresh and unmaps it on ``free``, whatever ``mallopt`` says after the thread
picked its arena. With ``jax_cpu_enable_async_dispatch`` off, the client runs
each single-device program on the thread that calls it (Python's main thread),
which allocates from glibc's main arena: there ``M_MMAP_MAX=0`` and a high trim
threshold, set at any time, keep the freed block for the next call. So
`tunedjax._host_memory` turns dispatch synchronous where a process may have to
decide in-process (``auto`` mode, nothing decided for its workload), and sets
those two settings the moment a measurement shows they pay.

The flag is read once, when JAX creates its CPU client. `request` sets it now
when JAX is imported and its backend has not started, or else when JAX's
``xla_bridge`` module has been imported (an import hook that acts once and
removes itself). Nothing here imports JAX.

Example:
  >>> state()["requested"] in (True, False)
  True
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from typing import Any

FLAG = "jax_cpu_enable_async_dispatch"
_BRIDGE = "jax._src.xla_bridge"

_LOCK = threading.RLock()
_HOOK: _AfterBridge | None = None
_SET = False  # this module turned the flag off before JAX's backend started
_FIRED: Callable[[bool], None] | None = None  # told whether the flag was set, when it acts


def _config() -> Any:
  """JAX's config object, if JAX's config module is loaded (never imports JAX)."""
  module = sys.modules.get("jax._src.config")
  return getattr(module, "config", None)


def _backend_started() -> bool:
  started = getattr(sys.modules.get(_BRIDGE), "backends_are_initialized", None)
  return started is not None and started()


def _set_flag(allowed: Callable[[], bool]) -> bool:
  """Turns the flag off if JAX's backend has not started and `allowed()`; True if set."""
  global _SET
  config = _config()
  if config is None or _backend_started() or not allowed():
    return False
  try:
    config.update(FLAG, False)
  except AttributeError:  # a JAX without the flag: nothing to set
    return False
  _SET = True
  return True


class _Loader(importlib.abc.Loader):
  """Runs the real loader of ``jax._src.xla_bridge``, then `then` (once)."""

  def __init__(self, inner: Any, then: Callable[[], None]):
    self._inner = inner
    self._then = then

  def create_module(self, spec: Any) -> Any:
    return self._inner.create_module(spec)

  def exec_module(self, module: Any) -> None:
    self._inner.exec_module(module)
    self._then()

  def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the real one's
    return getattr(self._inner, name)


class _AfterBridge(importlib.abc.MetaPathFinder):
  """An import hook that acts once, after JAX's ``xla_bridge`` module has run."""

  def __init__(self, allowed: Callable[[], bool]):
    self._allowed = allowed
    self._module = _BRIDGE

  def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
    if fullname != self._module:
      return None
    _remove_hook()
    spec = None
    for finder in list(sys.meta_path):
      find = getattr(finder, "find_spec", None)
      spec = find(fullname, path, target) if find is not None else None
      if spec is not None:
        break
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
      return spec
    spec.loader = _Loader(spec.loader, self._act)
    return spec

  def _act(self) -> None:
    try:
      done = _set_flag(self._allowed)
    except Exception:  # pylint: disable=broad-except  # never break JAX's import
      done = False
    fired = _FIRED
    if fired is not None:
      fired(done)


def _remove_hook() -> None:
  global _HOOK
  with _LOCK:
    if _HOOK is not None and _HOOK in sys.meta_path:
      sys.meta_path.remove(_HOOK)
    _HOOK = None


def request(allowed: Callable[[], bool], fired: Callable[[bool], None]) -> str:
  """Makes JAX's CPU client synchronous, now or when JAX is imported.

  Args:
    allowed: asked when the flag would be set (JAX will run on the CPU only, say).
    fired: called with True or False when the import hook acts (not when set now).

  Returns:
    ``"set"`` (set now), ``"pending"`` (when JAX's ``xla_bridge`` is imported),
    ``"too late"`` (JAX's backend already started) or ``"not allowed"``.
  """
  global _HOOK, _FIRED
  with _LOCK:
    if _BRIDGE in sys.modules:
      if _backend_started():
        return "too late"
      return "set" if _set_flag(allowed) else "not allowed"
    _FIRED = fired
    if _HOOK is None:
      _HOOK = _AfterBridge(allowed)
      sys.meta_path.insert(0, _HOOK)
    return "pending"


def withdraw() -> None:
  """Leaves JAX's dispatch as JAX's default (asynchronous) where that is still possible:
  the import hook removed, or the flag turned back on before the backend starts."""
  global _SET
  _remove_hook()
  with _LOCK:
    config = _config()
    if _SET and config is not None and not _backend_started():
      config.update(FLAG, True)
      _SET = False


def synchronous() -> bool:
  """True when this module turned the flag off and it is still off (JAX's CPU client then
  runs single-device programs on the calling thread)."""
  config = _config()
  if not _SET or config is None:
    return False
  try:
    return config.read(FLAG) is False
  except AttributeError:
    return False


def state() -> dict[str, bool]:
  """``requested`` (a hook waits for JAX), ``set`` (the flag turned off here), ``synchronous``."""
  return {"requested": _HOOK is not None, "set": _SET, "synchronous": synchronous()}
