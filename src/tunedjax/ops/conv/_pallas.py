"""The ``pallas`` conv kernel: an implicit-GEMM convolution in Pallas.

Written for the GPU's Triton backend (asked for explicitly: jax 0.10 lowers
a plain ``pallas_call`` to Mosaic GPU by default, which has no rule for its
``dot``); on CPU Pallas runs only in interpret mode, 3.5-22x slower than
XLA, so the kernel is applicable on "gpu" only and its correctness is tested
on CPU with ``interpret=True``. By default the choice between Triton and
interpret mode is made when the program is lowered, for the platform it is
lowered for, so a program traced on CPU and exported for CUDA
(``tj.jit(f, platform="gpu")``, `jax.export`) holds the Triton kernel.

The input is padded (padding and lhs dilation, in plain JAX) and its spatial
dims flattened, so that every kernel tap ``(kh, kw)`` reads the input at a
fixed offset ``kh * rd_h * Wp + kw * rd_w`` of the flattened output index:
the convolution is a sum over taps of ``(BM, C) @ (C, BO)`` matrix products
with no patch matrix in memory (implicit GEMM). A strided input is first split
into its stride phases (``x[a::sh, b::sw]``), from each of which a tap reads
at stride 1. The grid runs over batch,
blocks of ``BM`` flattened output positions (full padded rows; the columns
past the output width are computed and dropped) and blocks of ``BO`` output
channels; channels are zero-padded to multiples of the (power-of-two, >= 16)
block sizes Triton needs. It handles 2-D convolutions with any dimension
numbers, padding, strides, lhs and rhs dilation, no feature or batch
groups, float32, bfloat16 or float16 operands (accumulating in float32, or
preferred_element_type), up to 49 taps. Gradients come from a custom VJP
that differentiates the XLA convolution (in a train step the backward
convolutions are equations of their own, tuned separately).

Example:
  >>> import numpy as np
  >>> from jax import lax
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> x = np.random.default_rng(0).normal(size=(1, 5, 5, 3)).astype(np.float32)
  >>> w = np.random.default_rng(1).normal(size=(3, 3, 3, 4)).astype(np.float32)
  >>> kw = dict(window_strides=(1, 1), padding="SAME",
  ...           dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> spec = ConvSpec.from_arrays(x, w, **kw)
  >>> got = conv_pallas(x, w, spec, interpret=True)
  >>> bool(np.allclose(got, lax.conv_general_dilated(x, w, **kw), atol=1e-4))
  True
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tunedjax.ops.conv import _layout as layout
from tunedjax.rewrite import _compat

if TYPE_CHECKING:
  from tunedjax.ops.conv._spec import ConvSpec

BLOCK_M = 64
MAX_TAPS = 49
DTYPES = ("float32", "bfloat16", "float16")


def _block(n: int, cap: int) -> int:
  """A power-of-two block size >= 16 and <= cap that covers n if it can."""
  return max(16, min(cap, pl.next_power_of_2(n)))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _kernel(x_ref, w_ref, o_ref, *, taps, block_m, block_c, num_c, acc):
  """One (batch, M block, O block) tile: sum over taps and channel blocks."""
  m0 = pl.program_id(1) * block_m

  def c_step(ci, total):
    c0 = pl.multiple_of(ci * block_c, block_c)
    for t, (phase, d) in enumerate(taps):
      a = x_ref[phase, pl.ds(m0 + d, block_m), pl.ds(c0, block_c)]
      b = w_ref[t, pl.ds(c0, block_c), :]
      total += jnp.dot(a, b, preferred_element_type=acc)
    return total

  total = jnp.zeros(o_ref.shape, acc)
  total = lax.fori_loop(0, num_c, c_step, total)
  o_ref[...] = total.astype(o_ref.dtype)


def _phases(x: Any, strides: tuple[int, int]) -> tuple[Any, int, int]:
  """Splits a padded (N, Hp, Wp, C) input into its stride phases.

  Phase ``(a, b)`` holds ``x[:, a::sh, b::sw]``, zero-padded to a common
  ``(Hq, Wq)``; a strided convolution reads every tap from one phase at a
  fixed offset, with stride 1.

  Returns:
    ``(phases (N, sh * sw, Hq, Wq, C), Hq, Wq)``.
  """
  sh, sw = strides
  n, hp, wp, c = x.shape
  hq, wq = -(-hp // sh), -(-wp // sw)
  if (sh, sw) == (1, 1):
    return x[:, None], hp, wp
  x = jnp.pad(x, ((0, 0), (0, hq * sh - hp), (0, wq * sw - wp), (0, 0)))
  x = x.reshape(n, hq, sh, wq, sw, c).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(n, sh * sw, hq, wq, c), hq, wq


def _forward(lhs: Any, rhs: Any, spec: ConvSpec, interpret: bool) -> Any:
  acc = layout.accumulation_dtype(spec)
  out_dtype = layout.out_dtype(spec)
  x = layout.pad_spatial(layout.lhs_to_channels_last(lhs, spec), spec, 1)
  w = layout.rhs_to_channels_last(rhs, spec)  # (KH, KW, C, O)
  n, _, _, c = x.shape
  kh, kw, _, o = w.shape
  _, ho, wo, _ = layout.out_shape_channels_last(spec)
  (rd_h, rd_w), (sh, sw) = spec.rhs_dilation, spec.window_strides
  x, hq, wq = _phases(x, (sh, sw))
  taps = tuple(
      ((i * rd_h % sh) * sw + j * rd_w % sw,
       (i * rd_h // sh) * wq + j * rd_w // sw)
      for i in range(kh) for j in range(kw))
  block_c, block_o = _block(c, 32), _block(o, 64)
  cp, op = _round_up(c, block_c), _round_up(o, block_o)
  m_total = ho * wq
  num_m = pl.cdiv(m_total, BLOCK_M)
  length = num_m * BLOCK_M + max(d for _, d in taps)
  x = x.reshape(n, sh * sw, hq * wq, c)
  x = jnp.pad(x, ((0, 0), (0, 0), (0, length - hq * wq), (0, cp - c)))
  w = jnp.pad(w.reshape(kh * kw, c, o), ((0, 0), (0, cp - c), (0, op - o)))
  kernel = functools.partial(
      _kernel, taps=taps, block_m=BLOCK_M, block_c=block_c,
      num_c=cp // block_c, acc=acc)
  y = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((n, num_m * BLOCK_M, op), out_dtype),
      grid=(n, num_m, op // block_o),
      in_specs=[
          pl.BlockSpec((None, sh * sw, length, cp),
                       lambda b, m, j: (b, 0, 0, 0)),
          pl.BlockSpec((kh * kw, cp, block_o), lambda b, m, j: (0, 0, j)),
      ],
      out_specs=pl.BlockSpec((None, BLOCK_M, block_o),
                             lambda b, m, j: (b, m, j)),
      interpret=interpret,
      compiler_params=None if interpret else _compat.triton_compiler_params(),
      name="tunedjax_conv_implicit_gemm",
  )(x, w)
  y = y[:, :m_total].reshape(n, ho, wq, op)[:, :, :wo, :o]
  return layout.out_from_channels_last(y, spec)


def _forward_for_platform(lhs: Any, rhs: Any, spec: ConvSpec, interpret: bool | None) -> Any:
  """`_forward`, with ``interpret=None`` decided by the platform lowered for."""
  if interpret is not None:
    return _forward(lhs, rhs, spec, interpret)
  compiled = functools.partial(_forward, spec=spec, interpret=False)
  return lax.platform_dependent(
      lhs, rhs, cuda=compiled, rocm=compiled,
      default=functools.partial(_forward, spec=spec, interpret=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(lhs, rhs, spec, interpret):
  return _forward_for_platform(lhs, rhs, spec, interpret)


def _conv_fwd(lhs, rhs, spec, interpret):
  return _forward_for_platform(lhs, rhs, spec, interpret), (lhs, rhs)


def _conv_bwd(spec, interpret, residuals, cot):
  del interpret
  lhs, rhs = residuals
  params = spec.params()
  _, vjp = jax.vjp(
      lambda l, r: lax.conv_general_dilated_p.bind(l, r, **params), lhs, rhs)
  return vjp(cot)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv_pallas(lhs: Any, rhs: Any, spec: ConvSpec, *,
                interpret: bool | None = None) -> Any:
  """The convolution by the Pallas implicit-GEMM kernel.

  Args:
    lhs: the equation's input.
    rhs: the equation's kernel.
    spec: the convolution (must be `applicable` apart from the platform).
    interpret: run Pallas in interpret mode (True) or compile it with Triton
      (False); default: Triton when the program is lowered for a GPU
      (CUDA or ROCm), interpret mode elsewhere.

  Returns:
    The equation's output.
  """
  return _conv(lhs, rhs, spec, None if interpret is None else bool(interpret))


def supports(spec: ConvSpec) -> bool:
  """The convolutions the kernel computes, on any platform (interpret mode)."""
  return (spec.num_spatial == 2
          and spec.lhs_dtype == spec.rhs_dtype
          and spec.lhs_dtype in DTYPES
          and spec.feature_group_count == 1
          and spec.batch_group_count == 1
          and layout.window_count(spec) <= MAX_TAPS
          and math.prod(spec.lhs_shape) < 2**31)


def applicable(spec: ConvSpec, platform: str) -> bool:
  """On "gpu" only: 2-D, no groups, f32/bf16/f16, <= 49 taps."""
  return platform == "gpu" and supports(spec)


KERNELS = (("pallas", conv_pallas, applicable),)
