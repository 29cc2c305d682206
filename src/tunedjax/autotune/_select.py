"""The kernel-selection pass: each convolution runs on its bucket's best kernel.

`kernel_pass` is a `tunedjax.rewrite.Pass` with one rule, for
`conv_general_dilated`. A function that contains `jax.grad` has its backward
convolutions (input and weight gradients) as equations of their own, so each
is a bucket of its own and gets its own kernel. For every convolution the
rule decides, in this order:

1. a user's hint (`hint`, or ``kernel.hints`` in the config) that applies;
2. ``xla`` in the observe phase (see `step`), or when nothing else applies;
3. the cached winner of its bucket (a hit);
4. on a miss: in the tune phase (or without a step counter) tune the bucket
   now, store the result and use its winner; in the apply phase use ``xla``.

In a multi-process job, steps 3 and 4 happen on process 0 only and the
others receive its choice. `select_kernels` applies the pass to a function.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import jax

from tunedjax._config import get_config
from tunedjax.autotune import _cache as cache_lib
from tunedjax.autotune import _hints, _multihost, _phases, _registry, _tuner
from tunedjax.autotune._bucket import NAMESPACE, bucket_key, describe
from tunedjax.rewrite import _compat, _engine

logger = logging.getLogger("tunedjax.autotune")

OP = "conv"
PRIMITIVE = "conv_general_dilated"
CacheLike = Any  # Cache | str | os.PathLike | None

# Winners tuned in this process, by (cache file, key): a readonly cache still
# remembers what this process measured.
_TUNED: dict[tuple[str, str], dict[str, Any]] = {}
_TUNED_LOCK = threading.Lock()


def _resolve_cache(cache: CacheLike) -> cache_lib.Cache:
  if cache is None:
    return cache_lib.default_cache()
  if isinstance(cache, cache_lib.Cache):
    return cache
  if isinstance(cache, (str, os.PathLike)):
    return cache_lib.Cache(cache)
  raise TypeError(f"cache must be None, an autotune.Cache or a folder path, got "
                  f"{cache!r} (type {type(cache).__name__}).")


def _lookup(cache: cache_lib.Cache, key: dict[str, Any]) -> dict[str, Any] | None:
  memo = (str(cache.path), json.dumps(key, sort_keys=True))
  with _TUNED_LOCK:
    found = _TUNED.get(memo)
  if found is not None:
    return found
  return cache.get(NAMESPACE, key)


def _store(cache: cache_lib.Cache, key: dict[str, Any], value: dict[str, Any]) -> None:
  memo = (str(cache.path), json.dumps(key, sort_keys=True))
  with _TUNED_LOCK:
    _TUNED[memo] = value
  try:
    cache.put(NAMESPACE, key, value)
  except OSError as e:  # an unwritable folder must not stop training
    logger.warning("autotune: could not write the tuning cache %s (%s); the "
                   "result is kept for this process only.", cache.path, e)


def forget_tuned() -> None:
  """Forgets the winners this process tuned (the cache files are kept)."""
  with _TUNED_LOCK:
    _TUNED.clear()


@functools.lru_cache(maxsize=None)
def _measurable(platform: str) -> bool:
  """Whether this process has a `platform` device to time kernels on."""
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


def decide(spec: _registry.ConvSpec, platform: str, *, cache: CacheLike = None,
           options: _tuner.TuneOptions = _tuner.TuneOptions(),
           config: Any = None) -> tuple[str, str]:
  """Chooses the kernel for one convolution.

  Args:
    spec: the convolution.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    cache: the tuning cache (None: the config's default cache).
    options: how to tune a bucket on a miss.
    config: the active `Config` (default `get_config()`).

  Returns:
    ``(kernel name, why)``, why being one of ``"hint"``, ``"only xla"``,
    ``"observe"``, ``"hit"``, ``"tuned"``, ``"miss"`` (apply phase: xla),
    ``"no gpu here"`` (rewriting for a platform this process has no device
    of, e.g. to export: nothing can be timed, and this device's cache does
    not hold that platform's timings: xla),
    ``"not applicable"`` (a cached winner that cannot run this member of
    a pow2 bucket: xla).
  """
  config = get_config() if config is None else config
  platform = _registry.canonical_platform(platform)
  candidates = _registry.applicable_kernels(spec, platform)
  names = [k.name for k in candidates]
  key = bucket_key(spec, candidates, bucket=config.kernel.bucket, op=OP)
  label = describe(key)
  hinted = _hints.hinted_kernel(OP, spec, candidates, _hints.active_hints(config), label)
  if hinted is not None:
    return hinted, "hint"
  if names == [_tuner.DEFAULT]:
    return _tuner.DEFAULT, "only xla"
  if not _measurable(platform):  # rewriting for another machine (an export): no timings
    return _tuner.DEFAULT, f"no {platform} here"
  phase = _phases.current_phase(config)
  if phase == _phases.OBSERVE:
    return _tuner.DEFAULT, "observe"
  why = {}

  def leader_decides() -> str:
    store = _resolve_cache(cache)
    value = _lookup(store, key)
    if value is not None:
      _phases.record(hit=True, config=config)
      why["why"] = "hit"
      return value["winner"]
    if phase == _phases.APPLY:
      _phases.record(hit=False, config=config)
      why["why"] = "miss"
      return _tuner.DEFAULT
    result = _tuner.tune_bucket(spec, candidates, platform=platform, options=options,
                                label=label)
    _store(store, key, result.to_value())
    _phases.record(hit=False, tuning_s=result.tuning_s, tuned=True, config=config)
    why["why"] = "tuned"
    return result.winner

  all_names = sorted(k.name for k in _registry.kernels(OP))
  name = _multihost.agree(leader_decides, all_names)
  reason = why.get("why", "received")
  if name not in names:
    return _tuner.DEFAULT, "not applicable"
  return name, reason


def _run_kernel(ctx: _engine.Context, fn: Callable[..., Any], invals: list[Any],
                post: _engine.Pass | None) -> Any:
  """Calls the kernel `fn` on `invals`, its equations through `post` if given.

  The kernel is traced to a jaxpr and evaluated with `post`'s rules in the
  caller's trace, so a pass like cleanup sees the kernel's own equations next
  to the program's (a kernel that transposes into its layout folds with a
  transpose the layout pass put before it). `post`'s counts join `ctx`'s.
  """
  if post is None:
    return fn(*invals)
  closed, flat, _ = _engine.trace(fn, *invals)
  sub = _engine.Context(post, platform=ctx.platform, config=ctx.config)
  (out,) = sub.finish(sub.eval_jaxpr(closed.jaxpr, closed.consts, flat), closed.out_avals,
                      "a kernel")
  for what, n in sub.counts.items():
    ctx.count(what, n)
  return out


def kernel_pass(*, cache: CacheLike = None, rounds: int = _tuner.DEFAULT_ROUNDS,
                budget_s: float = _tuner.DEFAULT_BUDGET_S,
                margin: float = _tuner.DEFAULT_MARGIN, seed: int = 0,
                post: _engine.Pass | None = None) -> _engine.Pass:
  """The kernel-selection `Pass`, for `tunedjax.rewrite.transform` or `tunedjax.jit`.

  Args:
    cache: the tuning cache: an `autotune.Cache`, a folder, or None for the
      config's (``cache.dir``, ``$TUNEDJAX_CACHE_DIR``, ``~/.cache/tunedjax``).
    rounds: timed rounds per candidate when tuning a bucket.
    budget_s: seconds tuning one bucket may take.
    margin: how much faster than ``xla`` a kernel must be to be chosen
      (0.10: more than 10%).
    seed: seed of the random tuning inputs.
    post: a pass the chosen kernel's own equations go through (`tunedjax.jit`
      gives its cleanup pass, whose rules it merges with this one's, so that
      one evaluation selects kernels and folds the transposes and casts a
      kernel makes against those around it).

  Returns:
    A `Pass` named ``"kernel_selection"``. Its rule counts, per trace,
    ``"conv <kernel> (<why>)"`` in the engine's `Context.counts`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import rewrite
    >>> from tunedjax.autotune._select import kernel_pass
    >>> import tempfile
    >>> f = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
    >>> x, w = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 1, 1))
    >>> p = kernel_pass(cache=tempfile.mkdtemp(), rounds=1, budget_s=1.0)
    >>> rewrite.transform(f, p)(x, w).shape
    (1, 3, 5, 5)
  """
  options = _tuner.TuneOptions(rounds=rounds, budget_s=budget_s, margin=margin, seed=seed)

  def conv_rule(ctx: _engine.Context, eqn: Any, invals: list[Any]) -> list[Any]:
    spec = _registry.ConvSpec.from_equation(eqn)
    name, why = decide(spec, ctx.platform, cache=cache, options=options, config=ctx.config)
    ctx.count(f"conv {name} ({why})")
    if name == _tuner.DEFAULT:
      return ctx.default(eqn, invals)
    want = eqn.outvars[0].aval
    try:
      kernel = _registry.get_kernel(OP, name).fn
      # Explicitly sharded operands (jax 0.11+ meshes): the kernel runs on Auto axes.
      out = _compat.on_auto_axes(
          lambda lhs, rhs: _run_kernel(ctx, lambda l, r: kernel(l, r, spec), [lhs, rhs], post),
          invals, want)
      got = jax.typeof(out)
      if got.shape != want.shape or got.dtype != want.dtype:
        raise TypeError(f"it returned {got.str_short()} for {want.str_short()}")
    except Exception as e:  # pylint: disable=broad-except  # never worse than xla
      logger.warning("autotune: kernel %r could not be applied to %s (%s: %s); "
                     "using xla.", name, spec.lhs_shape, type(e).__name__, e)
      ctx.count(f"conv {name} failed at trace, xla used")
      return ctx.default(eqn, invals)
    return [out]

  return _engine.Pass("kernel_selection", {PRIMITIVE: conv_rule})


def select_kernels(f: Callable[..., Any], *, cache: CacheLike = None,
                   platform: str | None = None, jit: bool = False,
                   rounds: int = _tuner.DEFAULT_ROUNDS,
                   budget_s: float = _tuner.DEFAULT_BUDGET_S,
                   margin: float = _tuner.DEFAULT_MARGIN,
                   on_trace: Callable[[_engine.Context], None] | None = None,
                   ) -> Callable[..., Any]:
  """Runs `f` with each convolution on the fastest kernel for its shape.

  The choice is made when the returned function is traced (see `kernel_pass`
  for the order: hint, phase, cache, tuner). Without ``jit`` the result is a
  plain function that composes with `jax.jit`, `jax.grad` and `jax.vmap`;
  note that `jax.jit` then keeps the kernels of its first trace. With
  ``jit=True`` the result is jitted and traced again when the phase leaves
  observe, when the hints change or when the config changes.

  Args:
    f: the function; it may contain `jax.grad` (the backward convolutions
      are selected too).
    cache: an `autotune.Cache`, a folder, or None for the config's cache.
    platform: the platform kernels must run on (default: JAX's default backend).
    jit: return a jitted function that re-traces when the selection would change.
    rounds: timed rounds per candidate when tuning.
    budget_s: seconds tuning one bucket may take.
    margin: the fraction by which a kernel must beat ``xla`` to be chosen.
    on_trace: called with the rewrite `Context` after each trace (its
      ``counts`` say which kernel each convolution got and why).

  Returns:
    A function with `f`'s signature and results.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax.autotune._hints import hint
    >>> conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME").sum()
    >>> x, w = jnp.ones((1, 2, 6, 6)), jnp.ones((2, 2, 3, 3))
    >>> with hint(conv="xla"):
    ...   float(jax.jit(select_kernels(conv))(x, w))
    1024.0
  """
  pass_ = kernel_pass(cache=cache, rounds=rounds, budget_s=budget_s, margin=margin)
  transformed = _engine.transform(f, pass_, platform=platform, on_trace=on_trace)
  if not jit:
    return transformed
  jitted: dict[Any, Callable[..., Any]] = {}
  lock = threading.Lock()

  @functools.wraps(f)
  def run(*args: Any, **kwargs: Any) -> Any:
    config = get_config()
    state = (_phases.phase_key(config), _hints.active_hints(config), config)
    with lock:
      fn = jitted.get(state)
      if fn is None:
        # A new function object per state: jax.jit caches traces by function.
        fn = jitted[state] = jax.jit(functools.wraps(f)(
            lambda *a, **k: transformed(*a, **k)))
    return fn(*args, **kwargs)

  return run
