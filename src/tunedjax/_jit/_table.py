"""`tj.jit`'s program table: the compiled programs per `ProgramKey`, the
per-call fast path, and the programs one key's trace lets other keys share.

A call's program is looked up by what the passes depend on (the level, the
config, the kernel-selection phase, the active hints, whether native kernels
are suspended, and the whole-program check's variant). Working that key out
costs microseconds, so each call first compares a cheap token (read by
identity) with the last call's: equal, it runs the same program.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from tunedjax import _native
from tunedjax import _tuning
from tunedjax._config import Config
from tunedjax._config import get_config
from tunedjax._jit._key import OBSERVE
from tunedjax._jit._key import SELECT
from tunedjax._jit._key import UNTUNED
from tunedjax._jit._key import ProgramKey
from tunedjax._jit._options import JitOptions
from tunedjax.autotune import _hints


class _Shared:
  """Programs a key may run without a trace of its own.

  Programs with no kernel site do not depend on the phase, hints or verdicts:
  per key less those (`ProgramKey.base`), whether every trace so far found no
  site, and the program built first, which serves every such key. An observe
  program with every site on its default is the untuned variant's; one whose
  sites all found their kernels in the cache is the tune phase's (`warm`).
  """

  def __init__(self):
    self.site_free: dict[Hashable, bool] = {}
    self.base_fn: dict[Hashable, Any] = {}
    self.untuned_fn: dict[ProgramKey, Any] = {}  # keyed by the untuned variant's key
    self.warm: dict[ProgramKey, ProgramKey] = {}  # select key -> observe key, same program

  def lookup(self, key: ProgramKey) -> Any:
    """A program built for another key that `key` may run, or None."""
    base = key.base()
    fn = self.base_fn.get(base) if self.site_free.get(base) else None
    if fn is None and base is not None and key.phase == UNTUNED and not key.vetoed:
      fn = self.untuned_fn.get(key)
    return fn


class ProgramTable:
  """The compiled programs of one `Jitted`, per `ProgramKey`.

  `program` is the per-call path; `after_trace` files what a trace found
  (site-free programs, the untuned and warm programs); `keep` records the
  variant the whole-program check kept for a tuned program.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> table = ProgramTable(JitOptions(), lambda level, key: jax.jit(jnp.sin))
    >>> fn = table.program()
    >>> table.program() is fn  # the same token: the fast path
    True
  """

  def __init__(self, options: JitOptions, build: Callable[[str, ProgramKey], Any]):
    self._options = options
    self._build = build  # (level, key) -> the compiled function
    self._lock = threading.Lock()
    self._compiled: dict[ProgramKey, Any] = {}
    self._last: tuple[ProgramKey, Any] | None = None  # (key, jitted)
    self._fast: tuple[Any, Any] | None = None  # (token, jitted): the fast path
    self._memo: tuple[Any, ProgramKey] | None = None  # (token, key)
    self._shared = _Shared()
    self._kept: dict[ProgramKey, Any] = {}  # select key -> the variant the check kept
    self._traces = 0

  @property
  def trace_count(self) -> int:
    """Traces with kernel selection so far."""
    return self._traces

  def compiled(self, key: ProgramKey) -> Any:
    """The compiled function filed under `key`, or None."""
    with self._lock:
      return self._compiled.get(key)

  def program(self) -> Any:
    """The compiled function for the key now; a call whose token did not
    move since the last one takes it without working the key out."""
    fast = self._fast
    if fast is not None and fast[0] == self._token():
      return fast[1]
    return self.lookup()[0]

  def lookup(self, variant: Any = None) -> tuple[Any, bool]:
    """The compiled function for the key now, running `variant` (None: the
    program in use; `UNTUNED`; or vetoed buckets), and whether it was built
    just now."""
    token = self._token(variant)
    level, key = self._key(token)
    last = self._last
    if last is not None and last[0] == key:
      self._fast = (token, last[1])
      return last[1], False
    new = False
    with self._lock:
      fn = self._compiled.get(key)
      if fn is None:
        fn = self._shared.lookup(key)
        if fn is None:
          fn, new = self._build(level, key), True
          base = key.base()
          if base is not None:
            self._shared.base_fn.setdefault(base, fn)
        self._compiled[key] = fn
      self._last = (key, fn)
      self._fast = (token, fn)
    return fn, new

  def _key(self, token: tuple[Any, ...]) -> tuple[str, ProgramKey]:
    """The level, and what the compiled program depends on (`ProgramKey`).
    The whole-program check's untuned variant has the phase key ``"untuned"``
    (it shares the observe phase's program when that one has every site on
    its default)."""
    config = token[0]
    level = self._options.level or config.level
    if level == "O0":
      return level, ProgramKey(level)
    if not config.kernel.enable:  # the phase and hints only matter to kernel selection
      return level, ProgramKey(level, config)
    # Working the key out costs microseconds (hints, phase): a call whose
    # inputs to it did not move reuses the last one.
    memo = self._memo
    if memo is not None and memo[0] == token:
      return level, memo[1]
    key = self._kernel_key(level, config, token[1], token[5])
    self._memo = (token, key)
    return level, key

  def _token(self, variant: Any = None) -> tuple[Any, ...]:
    """What `_key` depends on, read cheaply (every call reads it): the config
    and, with kernel selection on, the session, its phase, the hint blocks,
    whether native kernels are suspended and the variant the check runs.
    Compared element by element, by identity first."""
    config = get_config()
    if not config.kernel.enable:
      return (config,)
    session = self._options.session or _tuning.current_session()
    return (config, session, session.quick_phase_key(config), _hints.hint_blocks(),
            _native.is_suspended(), variant)

  def _kernel_key(self, level: str, config: Config, session: Any, variant: Any) -> ProgramKey:
    key = ProgramKey(level, config, session, session.phase_key(config),
                     _hints.active_hints(config), _native.is_suspended())
    if variant is None and self._kept:
      variant = self._kept.get(key)
    return key.variant(variant)

  def after_trace(self, selection: Any, key: ProgramKey) -> bool:
    """Files what a trace with kernel selection found: whether its program
    has kernel sites (a site-free one serves every key with its base), the
    observe phase's untuned program, and whether the tune phase's program is
    this one (returned: every site found its final kernel in the cache)."""
    base, shared = key.base(), self._shared
    with self._lock:
      self._traces += 1
      free = selection.seen == 0
      if not free and shared.site_free.get(base):  # a key may share this program: no more
        gone = shared.base_fn.pop(base, None)
        self._compiled = {k: v for k, v in self._compiled.items() if v is not gone}
        self._last = self._fast = None
      shared.site_free[base] = shared.site_free.get(base, True) and free
      warm = False
      if key.phase == OBSERVE and not key.vetoed:
        fn = self._compiled.get(key)
        if not selection.decisions:  # every site on its default: the untuned program
          shared.untuned_fn.setdefault(key.variant(UNTUNED), fn)
        # Every site found its final kernel in the cache: the tune phase's
        # program is this one (compiled once for both phases).
        warm = selection.seen > 0 and selection.observed == 0
        if warm and fn is not None:
          select_key = key._replace(phase=SELECT)
          self._compiled.setdefault(select_key, fn)
          shared.warm[select_key] = key
    return warm

  def has_untuned(self, select_key: ProgramKey) -> bool:
    """Whether the untuned variant of `select_key`'s program is compiled already."""
    untuned = select_key.variant(UNTUNED)
    with self._lock:
      return untuned in self._compiled or untuned in self._shared.untuned_fn

  def keep(self, select_key: ProgramKey, variant: Any) -> None:
    """From now on `select_key` (and the observe key that runs its program)
    runs `variant` (None: the tuned program)."""
    with self._lock:
      if variant is not None:
        self._kept[select_key] = variant
        if select_key in self._shared.warm:  # the observe phase runs the same program
          self._kept[self._shared.warm[select_key]] = variant
      self._last = self._fast = None
      self._memo = None  # the kept variant changes the key
