"""The ``"attention"`` family's kernels: scaled dot-product attention, JAX's semantics.

Each kernel is ``fn(query, key, value, [bias], [mask], spec) -> out`` (the
operands as `_attn_spec.split_operands` reads them) computing exactly what
``jax.nn.dot_product_attention(implementation="xla")`` computes: logits
``q k^T * scale`` in float32 (float64 for float64 inputs), plus the bias, the
masked logits (boolean mask, causal) replaced by ``-0.7 * finfo.max`` (so a
fully masked row attends every key evenly, as JAX's does), a float32
softmax (float64 for float64 inputs, where JAX's casts to float32), the probabilities cast to the value's dtype, times the value.
Grouped-query attention: query head ``n`` reads key/value head ``n // G``.

- ``xla``: `jax.nn.dot_product_attention(implementation="xla")`. The reference
  (``einsum`` for float64, which JAX's would softmax in float32).
- ``einsum``: the formula written out (``einsum, softmax, einsum``), grouped
  heads as an extra axis instead of JAX's `vmap`.
- ``blocked_128``, ``blocked_256``, ``blocked_512``: online-softmax (flash)
  attention in plain JAX, a `lax.scan` over key blocks, with a `custom_vjp`
  whose backward recomputes each block's probabilities: no more than one
  ``[q_len, block]`` block of scores per head is ever held, forward or
  backward. Applicable from two blocks of keys.
- ``blocked_causal_128``, ``blocked_causal_256``:
  causal attention that skips the masked blocks: queries and keys in blocks,
  query block ``i`` against key blocks ``0..i`` only (about half the work of
  ``blocked``), the pairs walked one diagonal at a time (one batched `einsum`
  per diagonal), a `custom_vjp` whose backward recomputes per diagonal too.
  Causal without bias or boolean mask (grouped heads are fine); from two
  query blocks. Where one applies, ``blocked_*`` and ``query_chunked`` (which
  compute every block) do not.
- ``query_chunked``: ``einsum`` attention on chunks of 256 queries in turn
  (`lax.map`), each chunk rematerialised in the backward. From two chunks.
- ``cudnn`` (GPU): `jax.nn.dot_product_attention(implementation="cudnn")`,
  float16/bfloat16, no boolean mask.
- ``pallas_gpu`` (GPU): the Pallas/Triton flash attention JAX ships
  (`jax.experimental.pallas.ops.gpu.attention.mha`): no bias, mask or grouped
  heads, lengths multiples of 128.
- ``pallas_tpu`` (TPU): the Pallas/Mosaic TPU flash attention
  (`jax.experimental.pallas.ops.tpu.flash_attention`), same limits.

The GPU and TPU kernels are checked by lowering them from a CPU
(``tests/test_cross_lowering.py``), and ``pallas_gpu`` in Pallas's interpret
mode; where a device is present the tuner checks each against ``xla`` first.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.attention._spec import AttentionSpec
  >>> rng = np.random.default_rng(0)
  >>> q, k, v = (rng.normal(size=(1, 6, 2, 4)).astype(np.float32) for _ in range(3))
  >>> spec = AttentionSpec.from_arrays(q, k, is_causal=True)
  >>> bool(np.allclose(einsum(q, k, v, spec), xla(q, k, v, spec), atol=1e-5))
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunedjax._errors import AutotuneError
from tunedjax.ops.attention._spec import AttentionSpec, split_operands
from tunedjax.rewrite import _compat


def xla(*operands: Any) -> jax.Array:
  """The reference: `jax.nn.dot_product_attention` with ``implementation="xla"``.

  For float16 on CPU, whose `dot_general` rejects the ``F16_F16_F32`` precision
  JAX asks for (under `jax.jit`; eagerly JAX falls back), the same formula
  without it (`einsum`), chosen when lowered (`lax.platform_dependent`). For
  float64, `einsum` too: JAX's casts the logits to float32 for its softmax,
  and float64 stays float64 here.
  """
  *ops, spec = operands
  q = ops[0]
  if q.dtype == jnp.float64:
    return einsum(*ops, spec)

  def jax_attention(*ops):
    q, k, v, bias, mask = split_operands(ops, spec)
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=spec.scale,
                                        is_causal=spec.causal, implementation="xla")

  if q.dtype != jnp.float16:
    return jax_attention(*ops)
  return jax.lax.platform_dependent(*ops, cpu=lambda *o: einsum(*o, spec),
                                    default=jax_attention)


def logits_dtype(dtype: Any) -> Any:
  """The dtype logits and softmax are computed in: float32, or float64 for float64."""
  return jnp.promote_types(dtype, jnp.float32)


def large_negative(dtype: Any) -> jax.Array:
  """What a masked logit becomes: JAX's ``-0.7 * finfo.max``, within float32's range."""
  big = min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
  return jnp.asarray(-0.7 * big, dtype)


def grouped(t: Any, spec: AttentionSpec) -> Any:
  """A 4-D bias or mask ``[b, n, t, s]`` as ``[b, K|1, G|1, t, s]`` (n is 1 or N)."""
  if t is None:
    return None
  b, n, tq, s = t.shape
  if n == 1:
    return t[:, :, None]
  return t.reshape(b, spec.kv_heads, spec.groups, tq, s)


def causal_mask(q_start: Any, q_len: int, k_start: Any, k_len: int) -> jax.Array:
  """``[q_len, k_len]``: query ``q_start + i`` may attend key ``k_start + j``."""
  qi = q_start + jnp.arange(q_len)[:, None]
  kj = k_start + jnp.arange(k_len)[None, :]
  return kj <= qi


def masked_logits(qg: Any, k: Any, bias: Any, mask: Any, causal: Any, spec: AttentionSpec,
                  dt: Any) -> tuple[jax.Array, Any]:
  """Scaled logits ``[b, K, G, t, s]`` of grouped queries `qg` against keys `k`, with
  `bias` added and masked entries at `large_negative`; and the keep mask (None: all).

  `mask` and `causal` (a ``[t, s]`` keep matrix or None) combine; `bias` and
  `mask` are the slices for these queries and keys, in the caller's layout.
  """
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=dt)
  s = s * jnp.asarray(spec.scale, dt)
  if bias is not None:
    s = (s + grouped(bias, spec)).astype(dt)
  keep = None if mask is None else grouped(mask, spec)
  if causal is not None:
    keep = causal if keep is None else jnp.logical_and(keep, causal)
  if keep is not None:
    s = jnp.where(keep, s, large_negative(dt))
  return s, keep


def einsum(*operands: Any) -> jax.Array:
  """``softmax(q k^T * scale + bias, masked) v`` written out, grouped heads as an axis."""
  *ops, spec = operands
  q, k, v, bias, mask = split_operands(tuple(ops), spec)
  b, t, _, h = q.shape
  dt = logits_dtype(q.dtype)
  qg = q.reshape(b, t, spec.kv_heads, spec.groups, h)
  causal = causal_mask(0, t, 0, spec.kv_len) if spec.causal else None
  logits, _ = masked_logits(qg, k, bias, mask, causal, spec, dt)
  probs = jax.nn.softmax(logits.astype(jnp.promote_types(dt, jnp.float32)), axis=-1)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v)
  return out.reshape(q.shape).astype(q.dtype)


def always(spec: Any, platform: str) -> bool:
  del spec, platform
  return True


# -- blocked online-softmax attention (flash attention in plain JAX) -----------


def _pad_axis(x: Any, axis: int, to: int, value: Any = 0) -> Any:
  """`x` padded at the end of `axis` to length `to` (with `value`)."""
  extra = to - x.shape[axis]
  if extra <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _key_blocks(x: Any, axis: int, block: int, n_blocks: int, value: Any = 0) -> Any:
  """`x`'s `axis` padded to ``n_blocks * block`` and split: ``[n_blocks, ..., block, ...]``."""
  x = _pad_axis(x, axis, n_blocks * block, value)
  shape = x.shape[:axis] + (n_blocks, block) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblock(x: Any, axis: int, length: int) -> Any:
  """The inverse of `_key_blocks` (the block axis first, then `axis` of the rest): unpadded."""
  x = jnp.moveaxis(x, 0, axis)
  shape = x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:]
  return jax.lax.slice_in_dim(x.reshape(shape), 0, length, axis=axis)


def _reduce_to(x: Any, shape: tuple[int, ...]) -> Any:
  """`x` summed over the axes where `shape` (same rank) is 1, keeping them."""
  axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _with_vjp(forward: Callable[..., tuple[jax.Array, Any]],
              backward: Callable[[tuple[Any, ...], jax.Array], tuple[Any, ...]]):
  """``f(*operands) = forward(*operands)[0]`` with `backward` as its custom VJP.

  `forward` returns the output and the statistics the backward needs; the
  residuals are ``(*operands, out, stats)``, and `backward` maps them and the
  output's cotangent to one cotangent per operand.
  """

  @jax.custom_vjp
  def attend(*operands):
    return forward(*operands)[0]

  def attend_fwd(*operands):
    out, stats = forward(*operands)
    return out, (*operands, out, stats)

  attend.defvjp(attend_fwd, backward)
  return attend


@dataclasses.dataclass(frozen=True)
class _Blocked:
  """The stages of online-softmax attention over key blocks (`_blocked_attention`).

  Attributes:
    block: keys per block.
    spec: the attention.
    n_blocks: key blocks, the last zero-padded.
    dt: the logits' dtype (`logits_dtype`).
    scale: the logits' scale, in `dt`.
    bias_split: whether the bias varies along the keys (split into blocks) or
      not (closed over); likewise `mask_split` for the mask.
    mask_split: see `bias_split`.
  """

  block: int
  spec: AttentionSpec
  n_blocks: int
  dt: Any
  scale: jax.Array
  bias_split: bool
  mask_split: bool

  @classmethod
  def of(cls, block: int, spec: AttentionSpec) -> _Blocked:
    """The constants for key blocks of `block` in `spec`."""
    dt = logits_dtype(spec.dtype)
    return cls(block=block, spec=spec, n_blocks=-(-spec.kv_len // block), dt=dt,
               scale=np.asarray(spec.scale, np.dtype(dt)),  # NumPy: see _CausalBlocks.of
               bias_split=spec.has_bias and spec.bias_shape[3] != 1,
               mask_split=spec.has_mask and spec.mask_shape[3] != 1)

  def split(self, q, k, v, bias, mask):
    """Grouped queries ``[b, t, K, G, h]`` and the scan's inputs, one key block a step."""
    block, n_blocks, spec = self.block, self.n_blocks, self.spec
    b, t, _, h = q.shape
    qg = q.reshape(b, t, spec.kv_heads, spec.groups, h)
    xs = {"k": _key_blocks(k, 1, block, n_blocks), "v": _key_blocks(v, 1, block, n_blocks),
          "start": jnp.arange(n_blocks) * block}
    if self.bias_split:
      xs["bias"] = _key_blocks(bias, 3, block, n_blocks)
    if self.mask_split:
      xs["mask"] = _key_blocks(mask, 3, block, n_blocks, False)
    return qg, xs

  def scores(self, qg, x, bias, mask):
    """One key block's logits ``[b, K, G, t, block]`` (masked, padded keys -inf) and keep."""
    block, spec = self.block, self.spec
    causal = causal_mask(0, qg.shape[1], x["start"], block) if spec.causal else None
    s, keep = masked_logits(qg, x["k"], x.get("bias", bias), x.get("mask", mask), causal,
                            spec, self.dt)
    valid = x["start"] + jnp.arange(block) < spec.kv_len
    s = jnp.where(valid, s, -jnp.inf)
    return s, keep

  def forward(self, q, k, v, bias, mask):
    """The output and the row statistics ``(m, l)``: the online softmax over the blocks."""
    dt = self.dt
    qg, xs = self.split(q, k, v, bias, mask)
    b, t, kh, g, h = qg.shape

    def step(carry, x):
      m, l, acc = carry
      s, _ = self.scores(qg, x, bias, mask)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = alpha * l + jnp.sum(p, axis=-1)
      pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(x["v"].dtype), x["v"],
                      preferred_element_type=dt)
      return (m_new, l, alpha[..., None] * acc + pv), None

    init = (jnp.full((b, kh, g, t), -jnp.inf, dt), jnp.zeros((b, kh, g, t), dt),
            jnp.zeros((b, kh, g, t, h), dt))
    (m, l, acc), _ = jax.lax.scan(step, init, xs)
    out = acc / l[..., None]
    # m and l apart, not m + log(l): for a fully masked row m is -0.7 * finfo.max, which
    # absorbs log(l) in float32.
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(q.shape).astype(q.dtype), (m, l)

  def backward(self, res, dout):
    """The operands' cotangents: the blocks walked again, each one's probabilities
    recomputed from the saved row maxima and sums (the mask's cotangent None)."""
    block, dt, scale, bias_split, kv_len = (self.block, self.dt, self.scale, self.bias_split,
                                            self.spec.kv_len)
    q, k, v, bias, mask, out, (m, l) = res
    inv_l = 1 / l
    qg, xs = self.split(q, k, v, bias, mask)
    b, t, kh, g, h = qg.shape
    as_groups = lambda x: jnp.transpose(x.reshape(b, t, kh, g, h), (0, 2, 3, 1, 4))
    do = as_groups(dout).astype(dt)
    delta = jnp.sum(do * as_groups(out).astype(dt), axis=-1)  # [b, K, G, t]
    bias_shape = None if bias is None else bias.shape[:3] + (
        block if bias_split else 1,)

    def step(carry, x):
      dq, dbias_acc = carry
      s, keep = self.scores(qg, x, bias, mask)
      p = jnp.exp(s - m[..., None]) * inv_l[..., None]
      dv = jnp.einsum("bkgts,bkgth->bskh", p.astype(dt), do)
      dp = jnp.einsum("bkgth,bskh->bkgts", do, x["v"], preferred_element_type=dt)
      ds = p * (dp - delta[..., None])
      if keep is not None:
        ds = jnp.where(keep, ds, 0)
      out = {"dk": None, "dv": dv.astype(v.dtype), "dbias": None}
      if bias is not None:
        dsb = _reduce_to(ds.reshape(b, kh * g, t, block), bias_shape)
        if bias_split:
          out["dbias"] = dsb.astype(bias.dtype)
        else:
          dbias_acc = dbias_acc + dsb
      ds = ds * scale
      dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, x["k"], preferred_element_type=dt)
      out["dk"] = jnp.einsum("bkgts,btkgh->bskh", ds, qg,
                             preferred_element_type=dt).astype(k.dtype)
      return (dq, dbias_acc), out

    dbias0 = jnp.zeros(bias_shape, dt) if bias is not None and not bias_split else None
    (dq, dbias_acc), outs = jax.lax.scan(step, (jnp.zeros(qg.shape, dt), dbias0), xs)
    dk, dv = _unblock(outs["dk"], 1, kv_len), _unblock(outs["dv"], 1, kv_len)
    dbias = None
    if bias is not None:
      dbias = (_unblock(outs["dbias"], 3, kv_len) if bias_split
               else dbias_acc.astype(bias.dtype))
    return dq.reshape(q.shape).astype(q.dtype), dk, dv, dbias, None


def _blocked_attention(block: int, spec: AttentionSpec):
  """The custom-VJP attention ``f(q, k, v, bias, mask)`` over key blocks of `block`.

  The forward keeps a running maximum, sum and weighted sum per query (the
  online softmax) while a `lax.scan` walks the key blocks; the backward walks
  them again, recomputing each block's probabilities from the saved
  row maxima and sums. Neither holds more than one ``[q_len, block]`` block of scores
  per head. The stages are `_Blocked`'s methods.
  """
  stages = _Blocked.of(block, spec)
  return _with_vjp(stages.forward, stages.backward)


def blocked(block: int) -> Callable[..., jax.Array]:
  """The kernel of online-softmax attention over key blocks of `block`."""

  def kernel(*operands: Any) -> jax.Array:
    *ops, spec = operands
    q, k, v, bias, mask = split_operands(tuple(ops), spec)
    return _blocked_attention(block, spec)(q, k, v, bias, mask)

  kernel.__name__ = kernel.__qualname__ = f"blocked_{block}"
  return kernel


def causal_skips(spec: AttentionSpec) -> bool:
  """Whether a `blocked_causal_*` kernel applies: causal, no bias or mask, two blocks.

  There, the kernels that compute every block pair (`blocked_*`,
  `query_chunked`) do the same work twice over and hold more: they are left out,
  so that a bucket's tuning budget goes to the candidates that can win.
  """
  return spec.causal and spec.mask_kind == "none" and spec.q_len >= 2 * min(CAUSAL_BLOCKS)


def blocked_applicable(block: int) -> Callable[[AttentionSpec, str], bool]:
  """At least two key blocks (shorter keys are one block of `einsum`), and not where a
  `blocked_causal_*` kernel applies (`causal_skips`)."""

  def applicable(spec: AttentionSpec, platform: str) -> bool:
    del platform
    return spec.kv_len >= 2 * block and not causal_skips(spec)

  return applicable


# -- causal block-skipping attention ----------------------------------------------

# Blocks of 512 lost to 128 and 256 (fwd+bwd 2.0x xla against 3.2x at 2,048 tokens).
CAUSAL_BLOCKS = (128, 256)



def _causal_groups(q_blocks: int, k_blocks: int) -> list[list[tuple[int, int, int]]]:
  """The block pairs a causal attention computes, in groups of `q_blocks` pairs.

  The pairs ``(i, j)``, ``j <= i``, in diagonal order (``d = i - j`` = 0, 1, ...),
  cut into groups of `q_blocks` (the last may be shorter); each group as its
  pieces ``(d, i0, n)``: the pairs ``(i0 + a, i0 + a - d)`` for ``a < n``, one
  contiguous run of query blocks and of key blocks each.

  Example:
    >>> _causal_groups(3, 3)
    [[(0, 0, 3)], [(1, 1, 2), (2, 2, 1)]]
  """
  pairs = [(d, i) for d in range(q_blocks) for i in range(d, min(q_blocks, k_blocks + d))]
  groups = []
  for start in range(0, len(pairs), q_blocks):
    pieces: list[tuple[int, int, int]] = []
    for d, i in pairs[start:start + q_blocks]:
      if pieces and pieces[-1][0] == d and pieces[-1][1] + pieces[-1][2] == i:
        pieces[-1] = (d, pieces[-1][1], pieces[-1][2] + 1)
      else:
        pieces.append((d, i, 1))
    groups.append(pieces)
  return groups


def _causal_schedule(q_blocks: int, k_blocks: int) -> dict[str, np.ndarray]:
  """`_causal_groups` as arrays for a `lax.scan`, each group padded to `q_blocks` pairs.

  ``q``/``k``: each pair's query and key block (a padding pair: block 0, and
  ``pad`` set); ``diagonal``: whether ``i == j`` (only those pairs need the
  causal mask); ``lanes[o]``: the pair's query block where this is the row's
  ``o``-th pair in its group, else ``q_blocks`` (a scratch row), so that each
  lane writes distinct rows; ``row``/``col``: the query and key blocks, padding
  pairs sent to the scratch row ``q_blocks`` / column ``k_blocks``.

  Example:
    >>> s = _causal_schedule(3, 3)
    >>> s["q"].tolist(), s["k"].tolist()
    ([[0, 1, 2], [1, 2, 2]], [[0, 1, 2], [0, 1, 0]])
    >>> s["lanes"][1].tolist()  # step 1 has query block 2 twice: a second lane
    [[1, 2, 3], [3, 3, 2]]
  """
  groups = _causal_groups(q_blocks, k_blocks)
  pairs = [[(i0 + a, i0 + a - d) for d, i0, n in pieces for a in range(n)]
           for pieces in groups]
  lane_count = max(max(sum(r == i for r, _ in g) for i in range(q_blocks)) for g in pairs)
  n, p = len(pairs), q_blocks
  out = {"q": np.zeros((n, p), np.int32), "k": np.zeros((n, p), np.int32),
         "pad": np.ones((n, p), bool), "diagonal": np.zeros((n, p), bool),
         "row": np.full((n, p), q_blocks, np.int32), "col": np.full((n, p), k_blocks, np.int32),
         "lanes": np.full((n, lane_count, p), q_blocks, np.int32)}
  for g, group in enumerate(pairs):
    seen: dict[int, int] = {}
    for a, (i, j) in enumerate(group):
      out["q"][g, a], out["k"][g, a], out["pad"][g, a] = i, j, False
      out["diagonal"][g, a], out["row"][g, a], out["col"][g, a] = i == j, i, j
      out["lanes"][g, seen.get(i, 0), a] = i
      seen[i] = seen.get(i, 0) + 1
  return out


@dataclasses.dataclass(frozen=True)
class _CausalBlocks:
  """The stages of causal attention that skips the masked key blocks (`_causal_blocks`).

  Attributes:
    block: queries and keys per block.
    spec: the attention.
    kv_used: the keys attended (none past the last query).
    nq: query blocks, the last zero-padded.
    nk: key blocks of the `kv_used` keys, the last zero-padded.
    dt: the logits' dtype (`logits_dtype`).
    scale: the logits' scale, in `dt`.
    schedule: the groups of block pairs, one a scan step (`_causal_schedule`).
    inside: ``[block, block]``: the causal mask of a block pair on the diagonal.
  """

  block: int
  spec: AttentionSpec
  kv_used: int
  nq: int
  nk: int
  dt: Any
  scale: jax.Array
  schedule: dict[str, np.ndarray]
  inside: jax.Array

  @classmethod
  def of(cls, block: int, spec: AttentionSpec) -> _CausalBlocks:
    """The constants for blocks of `block` in `spec`."""
    kv_used = min(spec.kv_len, spec.q_len)  # keys past the last query are never attended
    nq, nk = -(-spec.q_len // block), -(-kv_used // block)
    dt = logits_dtype(spec.dtype)
    return cls(block=block, spec=spec, kv_used=kv_used, nq=nq, nk=nk, dt=dt,
               # NumPy, not jax arrays: made while a program is traced, a jax array
               # would be that trace's tracer, closed over by the custom VJP's rules.
               scale=np.asarray(spec.scale, np.dtype(dt)), schedule=_causal_schedule(nq, nk),
               inside=np.arange(block)[:, None] >= np.arange(block)[None, :])

  def split(self, q, k, v):
    """q ``[b, K, G, nq, B, h]``; k, v ``[b, K, nk, B, h]`` (zero-padded)."""
    block, nq, nk, kv_used = self.block, self.nq, self.nk, self.kv_used
    kh, g = self.spec.kv_heads, self.spec.groups
    b, _, _, h = q.shape
    qb = _pad_axis(q, 1, nq * block).reshape(b, nq, block, kh, g, h)
    kb, vb = (_pad_axis(x[:, :kv_used], 1, nk * block).reshape(b, nk, block, kh, h)
              for x in (k, v))
    return (jnp.transpose(qb, (0, 3, 4, 1, 2, 5)), jnp.transpose(kb, (0, 3, 1, 2, 4)),
            jnp.transpose(vb, (0, 3, 1, 2, 4)))

  def scores(self, qg, kg, x):
    """A group's logits ``[b, K, G, P, B, B]``: masked (causal, padded keys) -inf."""
    s = jnp.einsum("bkgith,bkish->bkgits", qg, kg, preferred_element_type=self.dt) * self.scale
    key = x["k"][:, None, None] * self.block + jnp.arange(self.block)
    keep = (key < self.kv_used) & ~x["pad"][:, None, None]
    keep = keep & (~x["diagonal"][:, None, None] | self.inside)
    return jnp.where(keep, s, -jnp.inf)

  def forward(self, q, k, v):
    """The output and the row statistics ``(m, l)``: each group's online-softmax
    statistics merged into the running ones, one lane of distinct rows at a time."""
    block, nq, dt, q_len = self.block, self.nq, self.dt, self.spec.q_len
    kh, g = self.spec.kv_heads, self.spec.groups
    qb, kb, vb = self.split(q, k, v)
    b, _, _, _, _, h = qb.shape
    stats = (b, kh, g, nq + 1, block)  # a scratch row last

    def step(carry, x):
      m, l, acc = carry
      qg, kg, vg = jnp.take(qb, x["q"], axis=3), jnp.take(kb, x["k"], axis=2), jnp.take(
          vb, x["k"], axis=2)
      s = self.scores(qg, kg, x)
      m_g = jnp.max(s, axis=-1)
      p = jnp.exp(s - jnp.where(jnp.isfinite(m_g), m_g, 0)[..., None])
      l_g = jnp.sum(p, axis=-1)
      acc_g = jnp.einsum("bkgits,bkish->bkgith", p.astype(vg.dtype), vg,
                         preferred_element_type=dt)
      for lane in range(x["lanes"].shape[0]):
        rows = x["lanes"][lane]
        m_p = jnp.full(stats, -jnp.inf, dt).at[:, :, :, rows].set(m_g)
        l_p = jnp.zeros(stats, dt).at[:, :, :, rows].set(l_g)
        acc_p = jnp.zeros(stats + (h,), dt).at[:, :, :, rows].set(acc_g)
        m_new = jnp.maximum(m, m_p)
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
        alpha, beta = jnp.exp(m - safe), jnp.exp(m_p - safe)
        m, l = m_new, alpha * l + beta * l_p
        acc = alpha[..., None] * acc + beta[..., None] * acc_p
      return (m, l, acc), None

    init = (jnp.full(stats, -jnp.inf, dt), jnp.zeros(stats, dt), jnp.zeros(stats + (h,), dt))
    (m, l, acc), _ = jax.lax.scan(step, init, self.schedule)
    m, l, acc = m[:, :, :, :nq], l[:, :, :, :nq], acc[:, :, :, :nq]
    out = acc / l[..., None]  # [b, K, G, nq, B, h]
    out = jnp.transpose(out, (0, 3, 4, 1, 2, 5)).reshape(b, nq * block, kh * g, h)
    return out[:, :q_len].astype(q.dtype), (m, l)

  def backward(self, res, dout):
    """The cotangents of q, k, v: the groups walked again, the probabilities recomputed
    from the saved row maxima and sums, the blocks' gradients scatter-added."""
    block, nq, nk, dt, scale = self.block, self.nq, self.nk, self.dt, self.scale
    kh, g, q_len, kv_used = self.spec.kv_heads, self.spec.groups, self.spec.q_len, self.kv_used
    q, k, v, out, (m, l) = res
    b, _, _, h = q.shape
    qb, kb, vb = self.split(q, k, v)
    as_blocks = lambda x: jnp.transpose(
        _pad_axis(x, 1, nq * block).reshape(b, nq, block, kh, g, h), (0, 3, 4, 1, 2, 5))
    do = as_blocks(dout).astype(dt)
    delta = jnp.sum(do * as_blocks(out).astype(dt), axis=-1)  # [b, K, G, nq, B]
    inv_l = 1 / l

    def step(carry, x):
      dq, dk, dv = carry
      rows = lambda t: jnp.take(t, x["q"], axis=3)
      qg, kg, vg = rows(qb), jnp.take(kb, x["k"], axis=2), jnp.take(vb, x["k"], axis=2)
      s = self.scores(qg, kg, x)
      p = jnp.exp(s - rows(m)[..., None]) * rows(inv_l)[..., None]
      do_g = rows(do)
      dv_g = jnp.einsum("bkgits,bkgith->bkish", p.astype(dt), do_g)
      dp = jnp.einsum("bkgith,bkish->bkgits", do_g, vg.astype(dt), preferred_element_type=dt)
      ds = p * (dp - rows(delta)[..., None]) * scale
      dq_g = jnp.einsum("bkgits,bkish->bkgith", ds, kg.astype(dt))
      dk_g = jnp.einsum("bkgits,bkgith->bkish", ds, qg.astype(dt))
      return (dq.at[:, :, :, x["row"]].add(dq_g), dk.at[:, :, x["col"]].add(dk_g),
              dv.at[:, :, x["col"]].add(dv_g)), None

    scratch = lambda x, axis: jnp.zeros(x.shape[:axis] + (x.shape[axis] + 1,)
                                        + x.shape[axis + 1:], dt)
    (dq, dk, dv), _ = jax.lax.scan(step, (scratch(qb, 3), scratch(kb, 2), scratch(vb, 2)),
                                   self.schedule)
    dq = jnp.transpose(dq[:, :, :, :nq], (0, 3, 4, 1, 2, 5)).reshape(b, nq * block, kh * g, h)
    unkey = lambda x, like: _pad_axis(
        jnp.transpose(x[:, :, :nk], (0, 2, 3, 1, 4)).reshape(b, nk * block, kh, h)[:, :kv_used],
        1, self.spec.kv_len).astype(like.dtype)
    return dq[:, :q_len].astype(q.dtype), unkey(dk, k), unkey(dv, v)


def _causal_blocks(block: int, spec: AttentionSpec):
  """The custom-VJP causal attention ``f(q, k, v)`` that skips the masked key blocks.

  Queries and keys are cut into blocks of `block`; query block ``i`` attends key
  blocks ``0..i`` only (JAX's causal mask is top-left aligned: query ``i`` sees
  keys ``j <= i``, so keys from ``q_len`` on are never seen and are dropped, their
  gradients zero). The block pairs, in diagonal order, are cut into groups of
  as many pairs as there are query blocks (`_causal_schedule`), and a
  `lax.scan` walks the groups: each step gathers its pairs' query and key
  blocks and computes their scores in one batched `einsum` (``[q_len, block]``
  per head, what a step of `blocked` holds), masking only the pairs on the
  diagonal and the padded keys. The forward merges the step's online-softmax
  statistics (row maximum, sum, weighted values) into the running ones, one
  lane of distinct rows at a time; the backward walks the groups again,
  recomputing the probabilities from the saved row maxima and sums, and
  scatter-adds the gradients of the blocks. About half the score blocks of
  `blocked` are computed. The stages are `_CausalBlocks`'s methods.
  """
  stages = _CausalBlocks.of(block, spec)
  return _with_vjp(stages.forward, stages.backward)


def blocked_causal(block: int) -> Callable[..., jax.Array]:
  """The kernel of causal attention over blocks of `block`, the masked blocks skipped."""

  def kernel(*operands: Any) -> jax.Array:
    *ops, spec = operands
    q, k, v, _, _ = split_operands(tuple(ops), spec)
    return _causal_blocks(block, spec)(q, k, v)

  kernel.__name__ = kernel.__qualname__ = f"blocked_causal_{block}"
  return kernel


def blocked_causal_applicable(block: int) -> Callable[[AttentionSpec, str], bool]:
  """Causal, no bias or boolean mask (grouped heads are fine), two query blocks or more.

  A boolean mask could leave a row nothing to attend among the keys it may see,
  and JAX then spreads it over every key, the skipped ones too.
  """

  def applicable(spec: AttentionSpec, platform: str) -> bool:
    del platform
    return spec.causal and spec.mask_kind == "none" and spec.q_len >= 2 * block

  return applicable


# -- query-chunked attention -------------------------------------------------

QUERY_CHUNK = 256


def query_chunked_attention(chunk: int, q: Any, k: Any, v: Any, bias: Any, mask: Any,
                            spec: AttentionSpec) -> jax.Array:
  """`einsum` attention on query chunks of `chunk` rows in turn (`lax.map`).

  Each chunk's scores are ``[chunk, kv_len]`` per head; the chunk's function
  is rematerialised (`jax.checkpoint`), so the backward recomputes a chunk's
  scores instead of saving every chunk's.
  """
  b, t, n, h = q.shape
  n_chunks = -(-t // chunk)
  xs = {"q": _key_blocks(q, 1, chunk, n_chunks), "start": jnp.arange(n_chunks) * chunk}
  bias_split = bias is not None and bias.shape[2] != 1
  mask_split = mask is not None and mask.shape[2] != 1
  if bias_split:
    xs["bias"] = _key_blocks(bias, 2, chunk, n_chunks)
  if mask_split:
    xs["mask"] = _key_blocks(mask, 2, chunk, n_chunks, True)

  @jax.checkpoint
  def one(x):
    qc = x["q"]
    dt = logits_dtype(qc.dtype)
    qg = qc.reshape(b, chunk, spec.kv_heads, spec.groups, h)
    causal = causal_mask(x["start"], chunk, 0, spec.kv_len) if spec.causal else None
    s, _ = masked_logits(qg, k, x.get("bias", bias), x.get("mask", mask), causal, spec, dt)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v)
    return o.reshape(b, chunk, n, h).astype(q.dtype)

  return _unblock(jax.lax.map(one, xs), 1, t)


def query_chunked(*operands: Any) -> jax.Array:
  """Attention over query chunks of `QUERY_CHUNK` rows (`lax.map`), each rematerialised."""
  *ops, spec = operands
  q, k, v, bias, mask = split_operands(tuple(ops), spec)
  return query_chunked_attention(QUERY_CHUNK, q, k, v, bias, mask, spec)


def query_chunked_applicable(spec: AttentionSpec, platform: str) -> bool:
  """At least two query chunks, and not where a `blocked_causal_*` kernel applies."""
  del platform
  return spec.q_len >= 2 * QUERY_CHUNK and not causal_skips(spec)


# -- GPU and TPU kernels ------------------------------------------------------


def cudnn(*operands: Any) -> jax.Array:
  """cuDNN's fused flash attention: `jax.nn.dot_product_attention(implementation="cudnn")`."""
  *ops, spec = operands
  q, k, v, bias, mask = split_operands(tuple(ops), spec)
  return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=spec.scale,
                                      is_causal=spec.causal, implementation="cudnn")


def cudnn_applicable(spec: AttentionSpec, platform: str) -> bool:
  """GPU, float16/bfloat16, head dim <= 128 and a multiple of 8, no boolean mask (cuDNN
  turns it into a finite bias, so a fully masked row differs), a bias over the full
  ``[q_len, kv_len]`` with even lengths, causal only for equal lengths."""
  if platform != "gpu" or spec.dtype not in ("float16", "bfloat16") or spec.has_mask:
    return False
  if not (spec.head_dim <= 128 and spec.head_dim % 8 == 0):
    return False
  if spec.has_bias and (spec.bias_shape[2:] != (spec.q_len, spec.kv_len)
                        or spec.q_len % 2 or spec.kv_len % 2):
    return False
  return not spec.causal or spec.q_len == spec.kv_len


PALLAS_BLOCK = 128


def pallas_gpu(*operands: Any, interpret: bool = False) -> jax.Array:
  """JAX's Pallas (Triton) flash attention, `jax.experimental.pallas.ops.gpu.attention.mha`.

  Same layout as ours, forward and backward kernels of its own; no bias, mask
  or grouped heads. ``interpret=True`` runs it on any platform (for tests).
  """
  *ops, spec = operands
  q, k, v, _, _ = split_operands(tuple(ops), spec)
  attention = _compat.pallas_gpu_attention()
  if attention is None:
    raise AutotuneError(f"attention: the pallas_gpu kernel needs JAX's Pallas GPU attention "
                        f"(jax.experimental.pallas.ops.gpu.attention), which jax "
                        f"{jax.__version__} does not ship (it is not a candidate there)")
  return attention.mha(q, k, v, None, sm_scale=spec.scale, causal=spec.causal,
                       interpret=interpret)


def pallas_gpu_applicable(spec: AttentionSpec, platform: str) -> bool:
  """GPU, no bias or mask, as many key/value heads as query heads, float16/bfloat16/
  float32, head dim 16..128 and a multiple of 16, lengths multiples of 128; a JAX
  that ships the kernel (0.12.1 removed it)."""
  return (platform == "gpu" and _compat.pallas_gpu_attention() is not None and spec.mask_kind == "none" and spec.kv_heads == spec.heads
          and spec.dtype in ("float16", "bfloat16", "float32")
          and 16 <= spec.head_dim <= 128 and spec.head_dim % 16 == 0
          and spec.q_len % PALLAS_BLOCK == 0 and spec.kv_len % PALLAS_BLOCK == 0)


def pallas_tpu(*operands: Any) -> jax.Array:
  """JAX's Pallas (Mosaic) TPU flash attention, in its ``[batch, heads, tokens, dim]`` layout."""
  *ops, spec = operands
  q, k, v, _, _ = split_operands(tuple(ops), spec)
  from jax.experimental.pallas.ops.tpu import flash_attention  # pylint: disable=import-outside-toplevel
  heads_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  out = flash_attention.flash_attention(heads_first(q), heads_first(k), heads_first(v),
                                        causal=spec.causal, sm_scale=spec.scale)
  return heads_first(out)


def pallas_tpu_applicable(spec: AttentionSpec, platform: str) -> bool:
  """TPU, no bias or mask, as many key/value heads as query heads, float32/bfloat16,
  head dim 64, 128 or 256, lengths multiples of 128."""
  return (platform == "tpu" and spec.mask_kind == "none" and spec.kv_heads == spec.heads
          and spec.dtype in ("float32", "bfloat16") and spec.head_dim in (64, 128, 256)
          and spec.q_len % PALLAS_BLOCK == 0 and spec.kv_len % PALLAS_BLOCK == 0)


BLOCKS = (128, 256, 512)

# (name, fn, applicable), the default first.
KERNELS = (
    ("xla", xla, always),
    ("einsum", einsum, always),
    *((f"blocked_{n}", blocked(n), blocked_applicable(n)) for n in BLOCKS),
    ("query_chunked", query_chunked, query_chunked_applicable),
    *((f"blocked_causal_{n}", blocked_causal(n), blocked_causal_applicable(n))
      for n in CAUSAL_BLOCKS),
    ("cudnn", cudnn, cudnn_applicable),
    ("pallas_gpu", pallas_gpu, pallas_gpu_applicable),
    ("pallas_tpu", pallas_tpu, pallas_tpu_applicable),
)
