"""The ``"attention"`` family's ``native_flash`` kernel: flash attention in C++ (CPU).

``native_flash(query, key, value, [mask], spec)`` has the family's contract
(`_kernels`: JAX's semantics, masked logits at ``-0.7 * finfo.max``, a row
with nothing to attend spread over every key). Its forward and backward are
handlers of ``csrc/flash_attention.cc`` (built on first use by
`tunedjax._native`), joined by a `jax.custom_vjp`:

- forward: queries and keys in blocks of 64, the online softmax over the key
  blocks, the blocks wholly above the causal diagonal skipped; it saves the
  output and each row's log-sum-exp, never the ``[T, S]`` probabilities;
- backward: the probabilities recomputed block by block from the saved
  log-sum-exp, as flash attention does; dK and dV accumulated per key block,
  dQ per chunk of key blocks and the chunks added in a fixed order.

Work is split by the shape alone (``(batch, head, query block)`` forward,
``(batch, key/value head, key chunk)`` backward) onto XLA's intra-op pool, so
results are the same bits whatever the thread count. The head dimension is
any (padded inside to the vector width); the lengths any, their tails masked
inside.

float32 or bfloat16. In float32, the logits' scale is applied to the query
in XLA, before the call (the gradient's factor after it, by the chain rule).
bfloat16 operands go to handlers of their own that read them as they are,
convert each element to float32 as they pack it, take the scale as an
attribute (times the query in float32, and dq's factor), compute in float32
as the float32 handlers do, and round only their results (the output, dq,
dk, dv) to bfloat16; the log-sum-exp stays float32. Measured against casting
to float32 in XLA around the float32 handlers (``astype`` there and back),
causal ``[2, 1024, 8, 32]`` forward and backward on 2 shared cores (load 8 to
16): 0.87-0.93x its time (the median of the per-round ratios, in each of five
runs of 9 to 21 interleaved rounds), e.g. 156 ms against 164 ms, the float32
kernel 161 ms; XLA's bfloat16 ``jax.nn.dot_product_attention`` takes 1.4 s.
Against float64 its error is below XLA's own bfloat16 error in norm
(0.67-0.91x: XLA rounds the probabilities to bfloat16 before they meet the
values, this kernel never does), its largest element error at most 1.5x
XLA's (``tests/ops/attention/test_native_flash.py``).

Applicable on CPU to float32 or bfloat16 attention without a bias, causal or
not, with grouped-query heads and at most a padding mask (a boolean mask
varying along the batch and the keys only, ``[B|1, 1, 1, S]``), where the
library builds (a C++ compiler, ``TUNEDJAX_NATIVE`` not ``0``).

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.attention._kernels import xla
  >>> rng = np.random.default_rng(0)
  >>> q, k, v = (rng.normal(size=(1, 70, 2, 32)).astype(np.float32) for _ in range(3))
  >>> spec = AttentionSpec.from_arrays(q, k, is_causal=True)
  >>> kernel = native_flash if native_flash_applicable(spec, "cpu") else xla
  >>> bool(np.allclose(kernel(q, k, v, spec), xla(q, k, v, spec), atol=1e-5))
  True
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax import _native
from tunedjax._errors import AutotuneError
from tunedjax.ops.attention._spec import AttentionSpec, split_operands

SOURCE = _native.register_source(pathlib.Path(__file__).parent / "csrc" / "flash_attention.cc")
"""The C++ file (``csrc/flash_attention.cc``) the kernel's handlers live in."""
NATIVE_SOURCES = (SOURCE,)
"""Part of the kernel's source hash (`_registry.source_hash`): a C++ edit re-tunes."""

NAME = "native_flash"


_SUFFIX = {"float32": "F32", "bfloat16": "BF16"}


def _target(handler: str, dtype: Any) -> str:
  target = _native.ffi_target(SOURCE, f"TjFlashAttn{handler}{_SUFFIX[jnp.dtype(dtype).name]}")
  if target is None:  # applicable said yes, then the library went away (tests)
    raise AutotuneError(f"attention: the {NAME} kernel is unavailable here (no library "
                        f"built from {SOURCE}.cc; see TUNEDJAX_NATIVE), so it cannot run.")
  return target


def _attrs(dtype: Any, causal: bool, scale: float) -> dict[str, Any]:
  """The handlers' attributes: the BF16 ones take the scale (the F32 ones a scaled q)."""
  attrs = {"causal": np.int64(causal)}
  if jnp.dtype(dtype) != jnp.float32:
    attrs["scale"] = np.float32(scale)
  return attrs


def forward(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, causal: bool,
            scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """The handler's forward: ``(out, lse)`` (``lse`` ``[B, N, T]`` float32, +inf on a row
  whose every visible key is masked). float32 `q` is scaled already; bfloat16 `q` is
  scaled by `scale` inside. `keep` is ``[B, S]`` float32 (1.0 attends) or has no
  elements (no mask)."""
  b, t, n, _ = q.shape
  out = (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct((b, n, t), jnp.float32))
  return jax.ffi.ffi_call(_target("Fwd", q.dtype), out, vmap_method="sequential")(
      q, k, v, keep, **_attrs(q.dtype, causal, scale))


def backward(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, out: jax.Array,
             lse: jax.Array, dout: jax.Array, causal: bool, scale: float = 1.0
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The handler's backward: ``(dq, dk, dv)``, the probabilities recomputed from `lse`."""
  shapes = tuple(jax.ShapeDtypeStruct(x.shape, q.dtype) for x in (q, k, v))
  return jax.ffi.ffi_call(_target("Bwd", q.dtype), shapes, vmap_method="sequential")(
      q, k, v, keep, out, lse, dout, **_attrs(q.dtype, causal, scale))


@functools.cache
def _flash(causal: bool, scale: float = 1.0) -> Callable[..., jax.Array]:
  """``f(q, k, v, keep)``: the custom-VJP attention (float32: of pre-scaled queries)."""

  @jax.custom_vjp
  def attend(q, k, v, keep):
    return forward(q, k, v, keep, causal, scale)[0]

  def attend_fwd(q, k, v, keep):
    out, lse = forward(q, k, v, keep, causal, scale)
    return out, (q, k, v, keep, out, lse)

  def attend_bwd(res, dout):
    q, k, v, keep, out, lse = res
    dq, dk, dv = backward(q, k, v, keep, out, lse, dout.astype(q.dtype), causal, scale)
    return dq, dk, dv, jnp.zeros_like(keep)

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def key_keep(mask: Any, spec: AttentionSpec) -> jax.Array:
  """A padding mask ``[B|1, 1, 1, S]`` as the handler's ``[B, S]`` float32 (no mask: 0 x 0)."""
  if mask is None:
    return jnp.zeros((0, 0), jnp.float32)
  flat = jnp.reshape(mask, (mask.shape[0], spec.kv_len)) != 0
  return jnp.broadcast_to(flat, (spec.batch, spec.kv_len)).astype(jnp.float32)


def native_flash(*operands: Any) -> jax.Array:
  """Flash attention in C++: causal or not, grouped heads, a padding mask (see above)."""
  *ops, spec = operands
  q, k, v, _, mask = split_operands(tuple(ops), spec)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  if q.dtype == jnp.float32:
    q = q * jnp.asarray(spec.scale, jnp.float32)
    return _flash(bool(spec.causal))(q, k, v, key_keep(mask, spec))
  return _flash(bool(spec.causal), float(spec.scale))(q, k, v, key_keep(mask, spec))


def native_flash_applicable(spec: AttentionSpec, platform: str) -> bool:
  """CPU, float32 or bfloat16, no bias, no mask or a padding mask ``[B|1, 1, 1, S]``,
  non-empty lengths, and the native library builds here."""
  if platform != "cpu" or spec.dtype not in _SUFFIX or spec.has_bias:
    return False
  if spec.has_mask:
    mb, mn, mt, ms = spec.mask_shape
    if mb not in (1, spec.batch) or (mn, mt) != (1, 1) or ms != spec.kv_len:
      return False
  return (spec.q_len >= 1 and spec.kv_len >= 1 and spec.batch >= 1
          and _native.available(SOURCE))


KERNELS = ((NAME, native_flash, native_flash_applicable),)
"""``(name, fn, applicable)`` as `_kernels.KERNELS` lists them: after them, C++ on CPU."""
