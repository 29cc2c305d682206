"""Flax attention modules on `tunedjax.attention`: the drop-in swap.

`use_tuned_attention` makes every ``flax.nnx.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention`` of a model compute its attention
with `tunedjax.attention`, whose kernel kernel selection chooses per shape
bucket. Nothing else changes: the projections, the parameters (and so the
checkpoints) and the outputs are Flax's.

* nnx: each module's ``attention_fn`` attribute (a static attribute: it lives
  in the graph definition, not in the state) is replaced, in place, by a
  function that takes Flax's ``attention_fn`` arguments.
* linen: modules are immutable and built inside their parent's methods, so
  the swap is a ``flax.linen.intercept_methods`` interceptor, active inside
  ``with swap:``: each ``MultiHeadDotProductAttention.__call__`` runs with the
  tuned function as its ``attention_fn`` for the length of the call.

A call that asks for what `tunedjax.attention` cannot do keeps Flax's own
``dot_product_attention``, and the swap records why, per module: attention
dropout while training (``dropout_rate > 0`` and not deterministic), sowing the
attention weights (``sow_weights=True``), an explicit ``precision``, linen's
custom einsums (AQT), a value head size other than the query's, a dtype
`tunedjax.attention` does not take. A module whose ``attention_fn`` is not
Flax's default (the user's own function) is left as it is.

A call whose operands do not fit (ranks, batch axes, lengths or heads that
differ, a mask that does not broadcast) raises what Flax's own function raises
for them (nnx: a `ValueError`; linen: its `AssertionError`), `tunedjax.attention`'s
`ShapeError` as its cause: a caller's ``except`` sees what it saw without the swap.

Flax's mask (``[batch..., heads or 1, q_len, kv_len]``, True or non-zero to
attend) and bias become `tunedjax.attention`'s boolean mask and float bias;
leading batch axes are flattened into one and restored. A mask that is the
causal mask, by how it was computed (``jnp.tril(jnp.ones((T, T)))``,
``make_causal_mask``, ``iota >= iota``; `_causal.py` says exactly which),
makes the call ``is_causal=True`` without a mask; one that is the AND of the
causal mask and others (``combine_masks(causal, padding)``) makes it causal
with the others as its mask. So the call's bucket is ``causal``, and the
kernels that take no mask (the block-skipping ones; on GPUs ``pallas_gpu``,
and ``cudnn`` in bfloat16 or float16) are candidates. Under a half-precision
mixed-precision policy a call runs in the compute dtype, and is recorded so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from tunedjax import _tuning
from tunedjax.ops.attention import _causal
from tunedjax.ops.attention._function import attention, half_compute_dtype
from tunedjax._errors import ShapeError, TunedJaxError, show_value

_DTYPES = ("float16", "bfloat16", "float32", "float64")

# Why a call kept Flax's own function.
DROPOUT = "attention dropout while training (dropout_rate={rate}, deterministic=False)"
SOW = "sow_weights=True: the attention weights are sown"
PRECISION = "precision={precision}: tunedjax.attention runs at the default precision"
EINSUMS = "custom einsums (qk_attn_weights_einsum / attn_weights_value_einsum, AQT)"
DOT_GENERAL = "a custom einsum_dot_general"
VALUE_DEPTH = "value head size {v} differs from query's {q}"
DTYPE = "dtype {dtype}: tunedjax.attention takes float16, bfloat16, float32, float64"
CUSTOM = "its attention_fn is not Flax's dot_product_attention: left as it is"


@dataclasses.dataclass
class _Record:
  """What one attention module's calls did (filled while programs are traced)."""

  path: str
  kind: str
  tuned: bool = False
  fallbacks: dict[str, None] = dataclasses.field(default_factory=dict)
  left_alone: str = ""
  calls: dict[tuple[Any, ...], None] = dataclasses.field(default_factory=dict)


def _sds(x: Any, dtype: Any = None) -> jax.ShapeDtypeStruct | None:
  return None if x is None else jax.ShapeDtypeStruct(tuple(x.shape), dtype or x.dtype)


def _pad_rank(x: Any, ndim: int) -> Any:
  return x.reshape((1,) * (ndim - x.ndim) + tuple(x.shape)) if x.ndim < ndim else x


def _to_one_batch_axis(x: Any, batch: tuple[int, ...]) -> Any:
  """A mask or bias ``[batch..., h, q, k]`` (leading axes may be missing or 1)
  as ``[prod(batch) or 1, h, q, k]``."""
  if x is None:
    return None
  x = _pad_rank(x, len(batch) + 3)
  lead = x.shape[:len(batch)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + tuple(x.shape[len(batch):]))
  x = jnp.broadcast_to(x, tuple(batch) + tuple(x.shape[len(batch):]))
  return x.reshape((math.prod(batch),) + tuple(x.shape[len(batch):]))


def _tuned_call(record: _Record, lock: threading.Lock, query: Any, key: Any, value: Any,
                bias: Any, mask: Any, is_causal: bool) -> jax.Array:
  """`tunedjax.attention` on Flax's operands (already promoted to one dtype); a mask
  that is, or has a part that is, the causal mask makes the call causal
  (`_causal.split_mask`)."""
  causal, mask = _causal.split_mask(mask, query.shape[-3], key.shape[-3])
  is_causal = bool(is_causal) or causal
  batch = tuple(query.shape[:-3])
  if len(batch) == 1:
    q, k, v = query, key, value
    bias4 = None if bias is None else _pad_rank(bias, 4)
    mask4 = None if mask is None else _pad_rank(mask, 4)
  else:  # no batch axis, or several: one batch axis for tunedjax.attention
    n = math.prod(batch)
    q, k, v = (x.reshape((n,) + tuple(x.shape[-3:])) for x in (query, key, value))
    bias4, mask4 = _to_one_batch_axis(bias, batch), _to_one_batch_axis(mask, batch)
  if mask4 is not None and mask4.dtype != np.dtype(bool):
    mask4 = mask4.astype(bool)  # Flax masks may be float 0/1 (nnx.make_causal_mask)
  if bias4 is not None and not jnp.issubdtype(bias4.dtype, jnp.floating):
    bias4 = bias4.astype(q.dtype)
  run_in = half_compute_dtype()  # the dtype the call is decided in (None: its own)
  with lock:
    record.tuned = True
    record.calls[(_sds(q, run_in), _sds(k, run_in), _sds(v, run_in), _sds(bias4, run_in),
                  _sds(mask4), bool(is_causal))] = None
  out = attention(q, k, v, bias4, mask4, is_causal=bool(is_causal))
  return out.reshape(tuple(batch) + tuple(out.shape[-3:]))


def _fallback_reason(query: Any, value: Any, *, dropout_rate: float, deterministic: bool,
                     module: Any, precision: Any, extras: Mapping[str, Any]) -> str | None:
  """Why this call must keep Flax's function, or None."""
  if dropout_rate > 0.0 and not deterministic:
    return DROPOUT.format(rate=dropout_rate)
  if module is not None:
    return SOW
  if precision is not None:
    return PRECISION.format(precision=show_value(precision))
  if extras.get("qk_attn_weights_einsum") or extras.get("attn_weights_value_einsum"):
    return EINSUMS
  if extras.get("einsum_dot_general") is not None:
    return DOT_GENERAL
  if np.dtype(query.dtype).name not in _DTYPES:
    return DTYPE.format(dtype=np.dtype(query.dtype).name)
  if value.shape[-1] != query.shape[-1]:
    return VALUE_DEPTH.format(v=value.shape[-1], q=query.shape[-1])
  return None


class TunedAttentionFn:
  """A Flax ``attention_fn`` that runs `tunedjax.attention` (or Flax's, and says why).

  Takes every argument Flax's ``dot_product_attention`` (nnx and linen) takes,
  by name: linen passes only the arguments an ``attention_fn`` names.
  Copies of a model share it (it is static configuration, as Flax's function is).
  """

  def __init__(self, original: Callable[..., Any], record: _Record, lock: threading.Lock,
               kind: str):
    self.original, self.record, self._lock, self.kind = original, record, lock, kind
    self._accepts = frozenset(inspect.signature(original).parameters)

  def __call__(self, query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None,
               broadcast_dropout: bool = True, dropout_rng: Any = None,
               dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
               precision: Any = None, module: Any = None, promote_dtype: Any = None,
               is_causal: bool = False, force_fp32_for_softmax: bool = False,
               einsum_dot_general: Any = None, qk_attn_weights_einsum: Any = None,
               attn_weights_value_einsum: Any = None) -> jax.Array:
    extras = {"promote_dtype": promote_dtype, "einsum_dot_general": einsum_dot_general,
              "qk_attn_weights_einsum": qk_attn_weights_einsum,
              "attn_weights_value_einsum": attn_weights_value_einsum}
    if self.kind == "nnx":
      promote = promote_dtype or nnx.nn.dtypes.promote_dtype
      q, k, v = promote((query, key, value), dtype=dtype)
    else:
      q, k, v = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
    reason = _fallback_reason(q, v, dropout_rate=dropout_rate, deterministic=deterministic,
                              module=module, precision=precision, extras=extras)
    kwargs = dict(bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
                  dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                  deterministic=deterministic, dtype=dtype, precision=precision,
                  module=module, is_causal=is_causal,
                  force_fp32_for_softmax=force_fp32_for_softmax, **extras)
    kwargs = {n: x for n, x in kwargs.items()
              if n in self._accepts and (x is not None or n in ("bias", "mask"))
              and not (n in ("is_causal", "force_fp32_for_softmax") and not x)}
    if (reason is None and self.kind == "linen" and q.ndim == k.ndim
        and q.shape[-2:-1] != k.shape[-2:-1]):  # linen's function asserts equal heads
      self._raise_as_flax(ShapeError(f"linen attention: key heads {k.shape[-2]} differ from "
                                     f"query heads {q.shape[-2]}"), query, key, value, kwargs)
    if reason is None:
      # force_fp32_for_softmax needs nothing: tunedjax.attention's softmax is float32
      # (float64 for float64 operands).
      try:
        return _tuned_call(self.record, self._lock, q, k, v, bias, mask, is_causal)
      except (ShapeError, ValueError, TypeError, IndexError) as error:  # shapes that do not fit
        self._raise_as_flax(error, query, key, value, kwargs)
    with self._lock:
      self.record.fallbacks[reason] = None
    return self.original(query, key, value, **kwargs)

  def _raise_as_flax(self, error: Exception, query: Any, key: Any, value: Any,
                     kwargs: Mapping[str, Any]) -> None:
    """Raises what Flax's own function raises for these operands (its exception,
    ours as its cause), so a caller's ``except`` sees what it saw without the swap;
    `error` itself where Flax's function raises nothing."""
    try:
      jax.eval_shape(lambda q, k, v: self.original(q, k, v, **kwargs), query, key, value)
    except Exception as flax_error:  # whatever Flax raises, as it raises it
      raise flax_error from error
    raise error

  def __deepcopy__(self, memo: dict[int, Any]) -> TunedAttentionFn:
    return self  # nnx.clone keeps sharing the record, as it shares Flax's function

  def __repr__(self) -> str:
    return f"TunedAttentionFn({self.record.path!r})"


def _path(parts: tuple[Any, ...]) -> str:
  return ".".join(str(p) for p in parts) or "<root>"


class AttentionSwap:
  """What `use_tuned_attention` swapped, and which calls kept Flax's function, and why.

  For a linen model, run its calls inside ``with swap:`` (the `Trainer` does);
  for an nnx model the swap is done in place and ``with swap:`` changes nothing.
  What the calls did is recorded while they are traced.

  Attributes:
    kind: ``"nnx"`` or ``"linen"``.
  """

  def __init__(self, kind: str):
    self.kind = kind
    self._records: dict[str, _Record] = {}
    self._lock = threading.Lock()
    self._local = threading.local()

  # --- what happened ----------------------------------------------------------

  @property
  def modules(self) -> tuple[str, ...]:
    """Paths of the attention modules found (nnx) or called (linen)."""
    with self._lock:
      return tuple(self._records)

  @property
  def tuned(self) -> tuple[str, ...]:
    """Modules with at least one traced call on `tunedjax.attention`."""
    with self._lock:
      return tuple(p for p, r in self._records.items() if r.tuned)

  @property
  def fallbacks(self) -> dict[str, tuple[str, ...]]:
    """``{module path: (reasons,)}`` for modules with calls that kept Flax's function."""
    with self._lock:
      return {p: tuple(r.fallbacks) for p, r in self._records.items() if r.fallbacks}

  @property
  def left_alone(self) -> dict[str, str]:
    """``{module path: why}`` for modules not swapped (a custom ``attention_fn``)."""
    with self._lock:
      return {p: r.left_alone for p, r in self._records.items() if r.left_alone}

  def buckets(self, *, session: _tuning.TuningSession | None = None,
              cache: Any = None) -> list[Any]:
    """The attention buckets of the recorded calls and what the tuning cache holds.

    `tunedjax.autotune.explain` over one `tunedjax.attention` call per
    (module, shape) seen: nothing runs, nothing is tuned.

    Args:
      session: the session whose in-memory choices to read too (a Trainer's).
      cache: the tuning cache (None: the config's).

    Returns:
      ``autotune.BucketChoice`` rows of the ``"attention"`` family.
    """
    from tunedjax.autotune import explain  # layer 3 -> this module, at call time
    with self._lock:
      calls = [c for r in self._records.values() for c in r.calls]
    if not calls:
      return []

    def run(*arrays: Any) -> list[jax.Array]:
      it, outs = iter(arrays), []
      for call in calls:
        q, k, v, bias, mask = (None if s is None else next(it) for s in call[:5])
        outs.append(attention(q, k, v, bias, mask, is_causal=call[5]))
      return outs

    args = [s for call in calls for s in call[:5] if s is not None]
    with _tuning.using_session(session):
      rows = explain(run, *args, cache=cache)
    return [r for r in rows if r.op == "attention"]

  def summary(self, *, session: _tuning.TuningSession | None = None,
              cache: Any = None) -> dict[str, Any]:
    """A JSON-able summary (what a Trainer puts in ``history.tuning["attention"]``)."""
    rows = self.buckets(session=session, cache=cache)
    return {
        "kind": self.kind,
        "modules": list(self.modules),
        "tuned": list(self.tuned),
        "fallbacks": {p: list(r) for p, r in self.fallbacks.items()},
        "left_alone": self.left_alone,
        "buckets": [{"bucket": r.bucket, "kernel": r.kernel, "count": r.count,
                     "candidates": list(r.candidates), "speedup": r.speedup,
                     "reason": r.reason} for r in rows],
    }

  def __repr__(self) -> str:
    return (f"AttentionSwap({self.kind}, modules={len(self.modules)}, "
            f"tuned={len(self.tuned)}, fallbacks={self.fallbacks})")

  # --- the swap ---------------------------------------------------------------

  def _record(self, path: str) -> _Record:
    with self._lock:
      record = self._records.get(path)
      if record is None:
        record = self._records[path] = _Record(path, self.kind)
      return record

  def _swap_nnx(self, model: nnx.Module) -> None:
    for parts, module in nnx.iter_modules(model):
      if not isinstance(module, nnx.MultiHeadAttention):
        continue
      fn = module.attention_fn
      path = _path(parts)
      if isinstance(fn, TunedAttentionFn):  # swapped before: share its record
        with self._lock:
          self._records[path] = fn.record
      elif fn is nnx.dot_product_attention:
        module.attention_fn = TunedAttentionFn(fn, self._record(path), self._lock, "nnx")
      else:
        self._record(path).left_alone = CUSTOM

  def _intercept(self, next_fun: Callable[..., Any], args: Any, kwargs: Any,
                 context: Any) -> Any:
    module = context.module
    if not (isinstance(module, nn.MultiHeadDotProductAttention)
            and context.method_name == "__call__"):
      return next_fun(*args, **kwargs)
    record = self._record(_path(tuple(module.path) if module.scope is not None else ()))
    fn = module.attention_fn
    if fn is not nn.dot_product_attention:
      if not isinstance(fn, TunedAttentionFn):
        record.left_alone = CUSTOM
      return next_fun(*args, **kwargs)
    tuned = TunedAttentionFn(fn, record, self._lock, "linen")
    # A linen module is a frozen dataclass: its field is set for this call only.
    object.__setattr__(module, "attention_fn", tuned)
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "attention_fn", fn)

  def __enter__(self) -> AttentionSwap:  # noqa: PYI034
    stack = self._local.__dict__.setdefault("stack", [])
    if self.kind == "linen":
      cm = nn.intercept_methods(self._intercept)
      cm.__enter__()
      stack.append(cm)
      _swapping.depth = getattr(_swapping, "depth", 0) + 1  # the route leaves it to us
    else:
      stack.append(None)
    return self

  def __exit__(self, *exc: object) -> None:
    cm = self._local.stack.pop()
    if cm is not None:
      _swapping.depth -= 1
      cm.__exit__(*exc)


def use_tuned_attention(model: Any) -> AttentionSwap:
  """Runs the attention of `model`'s Flax attention modules on `tunedjax.attention`.

  Every ``flax.nnx.MultiHeadAttention`` (its ``attention_fn``, swapped in
  place) and every ``flax.linen.MultiHeadDotProductAttention`` (intercepted
  inside ``with swap:``) whose ``attention_fn`` is Flax's
  ``dot_product_attention`` then computes attention with
  `tunedjax.attention`: the reference outside kernel selection, the kernel
  chosen for its shape bucket under `tunedjax.jit` with ``kernel.enable``.
  Parameters, state and outputs do not change. Calls that need what
  `tunedjax.attention` cannot do (attention dropout while training, sown
  weights, an explicit precision) keep Flax's function; the returned swap
  says which and why. Calling it again on the same model changes nothing.
  ``Trainer(autotune=True)`` does this for you.

  Args:
    model: a Flax ``nnx.Module`` or ``linen.Module``.

  Returns:
    An `AttentionSwap`: the modules, and after the calls are traced, which
    ran tuned and which calls fell back, and why.

  Raises:
    TunedJaxError: `model` is not a Flax module.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import tunedjax as tj
    >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
    ...                                rngs=nnx.Rngs(0))
    >>> swap = tj.use_tuned_attention(layer)
    >>> y = layer(jnp.ones((1, 4, 8)))
    >>> swap.modules, swap.tuned, swap.fallbacks
    (('<root>',), ('<root>',), {})
  """
  if isinstance(model, nnx.Module):
    swap = AttentionSwap("nnx")
    swap._swap_nnx(model)  # pylint: disable=protected-access
    return swap
  if isinstance(model, nn.Module):
    return AttentionSwap("linen")
  raise TunedJaxError(f"use_tuned_attention(model): model must be a flax nnx.Module or "
                      f"linen.Module, got {show_value(model)} (type {type(model).__name__}).")


# -- the route: tunedjax.jit's programs, with no model object at hand ----------------------------

_swapping = threading.local()  # depth of explicit linen swaps entered in this thread
_route_local = threading.local()  # depth of routes entered in this thread
_route_lock = threading.Lock()
_route_installed: dict[str, Any] = {"count": 0, "original": None}
# What the route's calls did, for all programs (`route_record`).
_ROUTE_RECORD = _Record("tunedjax.jit", "route")
_ROUTE_RECORD_LOCK = threading.Lock()


def _route_active() -> bool:
  """Inside `route_attention` in this thread, with kernel selection active."""
  if not getattr(_route_local, "depth", 0):
    return False
  from tunedjax.autotune import _select  # pylint: disable=import-outside-toplevel
  return _select.active_selection() is not None


def _nnx_routed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
  """``nnx.MultiHeadAttention.__call__`` while routed: Flax's default
  ``attention_fn`` becomes the tuned one for this call."""
  original = _route_installed["original"]
  fn = self.attention_fn
  if fn is not nnx.dot_product_attention or not _route_active():
    return original(self, *args, **kwargs)
  # attention_fn is a static attribute (graph definition, not state): set for this call only.
  object.__setattr__(self, "attention_fn",
                     TunedAttentionFn(fn, _ROUTE_RECORD, _ROUTE_RECORD_LOCK, "nnx"))
  try:
    return original(self, *args, **kwargs)
  finally:
    object.__setattr__(self, "attention_fn", fn)


def _linen_route(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
  module = context.module
  if (not isinstance(module, nn.MultiHeadDotProductAttention)
      or context.method_name != "__call__" or module.attention_fn is not nn.dot_product_attention
      or getattr(_swapping, "depth", 0) or not _route_active()):
    return next_fun(*args, **kwargs)
  tuned = TunedAttentionFn(module.attention_fn, _ROUTE_RECORD, _ROUTE_RECORD_LOCK, "linen")
  object.__setattr__(module, "attention_fn", tuned)
  try:
    return next_fun(*args, **kwargs)
  finally:
    object.__setattr__(module, "attention_fn", nn.dot_product_attention)


@contextlib.contextmanager
def route_attention() -> Iterator[None]:
  """Flax's attention modules on `tunedjax.attention` while a program is traced.

  The ``"attention"`` family's route (`tunedjax.autotune._routes`): inside it,
  with kernel selection active (`tunedjax.jit` with ``kernel.enable`` enters
  it around each trace), every ``nnx.MultiHeadAttention`` and linen
  ``MultiHeadDotProductAttention`` whose ``attention_fn`` is Flax's default
  computes its attention with `tunedjax.attention`, as `use_tuned_attention`
  makes it, without a model object: nnx by a wrapper on the class's
  ``__call__`` (installed while any thread is inside, acting only in
  threads that are), linen by an interceptor. A module swapped by
  `use_tuned_attention` keeps its swap, and calls `tunedjax.attention`
  cannot take keep Flax's function, as there. A causal mask
  (``make_causal_mask``, ``jnp.tril``, alone or combined with a padding
  mask) makes the call causal, as there.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
    ...                                rngs=nnx.Rngs(0))
    >>> with route_attention():  # kernel selection is off here: Flax's own function
    ...   y = layer(jnp.ones((1, 4, 8)))
    >>> y.shape
    (1, 4, 8)
  """
  with _route_lock:
    if _route_installed["count"] == 0:
      _route_installed["original"] = nnx.MultiHeadAttention.__call__
      nnx.MultiHeadAttention.__call__ = _nnx_routed_call
    _route_installed["count"] += 1
  _route_local.depth = getattr(_route_local, "depth", 0) + 1
  try:
    with nn.intercept_methods(_linen_route):
      yield
  finally:
    _route_local.depth -= 1
    with _route_lock:
      _route_installed["count"] -= 1
      if _route_installed["count"] == 0:
        nnx.MultiHeadAttention.__call__ = _route_installed["original"]
        _route_installed["original"] = None  # as before: no state left behind


def route_record() -> dict[str, Any]:
  """What `route_attention`'s calls did so far in this process: whether one ran
  tuned, and the reasons calls kept Flax's function."""
  with _ROUTE_RECORD_LOCK:
    return {"tuned": _ROUTE_RECORD.tuned, "fallbacks": tuple(_ROUTE_RECORD.fallbacks)}


def trainer_swap(model: Any, config: Any) -> AttentionSwap | None:
  """The `Trainer`'s swap: on when kernel selection is (``kernel.enable``), else None."""
  if not config.kernel.enable or not isinstance(model, (nnx.Module, nn.Module)):
    return None
  return use_tuned_attention(model)
