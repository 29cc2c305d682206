"""Native kernels' FFI handlers called on guarded buffers, and float64 references of them.

`call` runs one handler of a built native library (``tunedjax._native``)
through ``native_harness.cc``, a few lines of C++ that build the
``XLA_FFI_CallFrame`` XLA:CPU would (buffers, scalar attributes, a thread
pool) around buffers this module owns. Each output lies in a larger buffer
filled with a canary bit pattern: after the call, every element around the
output must still hold it (nothing written out of bounds) and none inside
may (every output element written). Inputs are exact-size arrays, so in a
sanitizer run (``make test-native-sanitize``) AddressSanitizer sees a read
past one as well. No XLA compilation is involved: a call takes microseconds,
so the tests can sweep every tile remainder.

The references compute each handler's documented formula in float64 with
NumPy (`depthwise_conv`, `direct_wgrad`, ...), from the same int64
geometry: output index o and window index k read input row
``(o * stride + k * rhs_dil - pad) / lhs_dil`` when that is a whole row
inside the input, zero elsewhere. Each returns the result and the same sum
of absolute values (the scale of its rounding error).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import subprocess
import tempfile
from collections.abc import Sequence

import jax
import numpy as np

from tunedjax import _native, autotune

autotune.op_families()  # each family registers its C++ sources when it loads

HARNESS_SOURCE = pathlib.Path(__file__).with_name("native_harness.cc")
GUARD = 64
"""Canary elements on each side of every output buffer."""

CANARY = {np.dtype(np.float32): np.uint32(0x7FA5A5A5),
          np.dtype(np.float64): np.uint64(0x7FF4A5A5A5A5A5A5)}
"""Signalling-NaN bit patterns no handler writes (compared as bits)."""

_FFI_DTYPE = {np.dtype(np.float32): 11, np.dtype(np.float64): 12}  # XLA_FFI_DataType
_FFI_S64 = 5
GEOMETRY = ("stride_h", "stride_w", "pad_h", "pad_w", "lhs_dil_h", "lhs_dil_w",
            "rhs_dil_h", "rhs_dil_w")


class HandlerError(RuntimeError):
  """The handler returned an XLA FFI error (its message)."""


@functools.cache
def _harness(flags: tuple[str, ...], folder: pathlib.Path) -> ctypes.CDLL:
  compiler = _native.find_compiler()
  if compiler is None:
    raise RuntimeError("no C++ compiler: the native kernels are unavailable")
  ffi_header = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
  digest = hashlib.sha256(b"\0".join(
      [HARNESS_SOURCE.read_bytes(), ffi_header.read_bytes(), compiler.version.encode(),
       " ".join(flags).encode()])).hexdigest()[:16]
  target = folder / f"native_harness-{digest}.so"
  if not target.exists():
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    command = [compiler.path, *flags, "-pthread", "-isystem", jax.ffi.include_dir(),
               str(HARNESS_SOURCE), "-o", tmp]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      os.unlink(tmp)
      raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    os.replace(tmp, target)
  lib = ctypes.CDLL(str(target))
  lib.tj_harness_call.restype = ctypes.c_int
  return lib


def harness() -> ctypes.CDLL:
  """The harness library, built with the native kernels' compiler and flags (cached)."""
  return _harness(_native.flags(), _native.build_root() / "test-harness")


def _ints(values: Sequence[int], ctype=ctypes.c_int64):
  return (ctype * max(1, len(values)))(*values)


def _buffers(arrays: Sequence[np.ndarray]):
  """dtypes, data pointers, ranks and concatenated dims of `arrays` for the harness."""
  dtypes = _ints([_FFI_DTYPE[a.dtype] for a in arrays], ctypes.c_int32)
  data = (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
  ranks = _ints([a.ndim for a in arrays])
  dims = _ints([d for a in arrays for d in a.shape])
  return dtypes, data, ranks, dims


def _attr_scalars(values: Sequence[int | float]):
  """The harness's attribute dtypes (XLA_FFI_DataType) and 8-byte value slots (their bits)."""
  dtypes, slots = [], []
  for value in values:
    if isinstance(value, np.float32):
      dtypes.append(_FFI_DTYPE[np.dtype(np.float32)])
      slots.append(int(np.array([value, 0], np.float32).view(np.int64)[0]))
    elif isinstance(value, (float, np.floating)):
      dtypes.append(_FFI_DTYPE[np.dtype(np.float64)])
      slots.append(int(np.array([value], np.float64).view(np.int64)[0]))
    else:
      dtypes.append(_FFI_S64)
      slots.append(int(value))
  return _ints(dtypes, ctypes.c_int32), _ints(slots)


def guarded(shape: Sequence[int], dtype, guard: int = GUARD) -> tuple[np.ndarray, np.ndarray]:
  """A canary-filled buffer of ``size + 2 * guard`` elements and the output view inside it."""
  dtype = np.dtype(dtype)
  size = int(np.prod(shape))
  bits = np.full(size + 2 * guard, CANARY[dtype])
  whole = bits.view(dtype)
  return whole, whole[guard:guard + size].reshape(shape)


def check_guards(name: str, whole: np.ndarray, out: np.ndarray, guard: int = GUARD) -> None:
  """Asserts the canaries around `out` are intact and none is left inside it."""
  bits = whole.view(CANARY[whole.dtype].dtype)
  canary = CANARY[whole.dtype]
  size = out.size
  changed = np.flatnonzero(np.concatenate([bits[:guard], bits[guard + size:]]) != canary)
  if changed.size:
    where = [int(i) - guard if i < guard else int(i) - guard + 1 for i in changed[:8]]
    raise AssertionError(f"{name} wrote outside its output of shape {out.shape}: at "
                         f"element offsets {where} from its ends (negative: before the start, "
                         f"positive: past the end)")
  left = np.flatnonzero(bits[guard:guard + size] == canary)
  if left.size:
    raise AssertionError(f"{name} left {left.size} of the {size} elements of its output "
                         f"{out.shape} unwritten, the first at flat index {int(left[0])}")


def call(source: str, symbol: str, args: Sequence[np.ndarray],
         out_shapes: Sequence[Sequence[int]], attrs: dict[str, int | float] | None = None, *,
         threads: int = 3) -> list[np.ndarray]:
  """Runs handler `symbol` of ``csrc/<source>.cc`` on `args`; returns its outputs.

  Args:
    source: the native source's stem (its library is built and loaded by `_native`).
    symbol: the handler's exported name, e.g. ``"TjDepthwiseConvF32"``.
    args: the operands, all of the handler's dtype (copied to exact-size C arrays).
    out_shapes: the results' shapes, in the handler's dtype.
    attrs: scalar attributes by name: an int is an int64, a float a float64 (double),
      a `np.float32` a float32.
    threads: the thread pool's size the handler sees (0: no pool).

  Returns:
    The outputs (copies), after `check_guards` passed for each.

  Raises:
    HandlerError: the handler returned an error; then no output may have changed.
    AssertionError: a write outside an output, or an output element left unwritten.
  """
  lib = _native.library(source)
  if lib is None:
    raise RuntimeError(f"the native library {source}.cc is unavailable")
  dtype = np.dtype(args[0].dtype)
  args = [np.array(a, dtype=dtype, order="C", copy=True) for a in args]
  outs = [guarded(shape, dtype) for shape in out_shapes]
  names = sorted(attrs or {})
  message = ctypes.create_string_buffer(1024)
  status = harness().tj_harness_call(
      ctypes.cast(getattr(lib, symbol), ctypes.c_void_p), ctypes.c_int64(threads),
      ctypes.c_int64(len(args)), *_buffers(args),
      ctypes.c_int64(len(outs)), *_buffers([o for _, o in outs]),
      ctypes.c_int64(len(names)),
      (ctypes.c_char_p * max(1, len(names)))(*[n.encode() for n in names]),
      *_attr_scalars([attrs[n] for n in names]), message, ctypes.c_int64(len(message)))
  if status != 0:
    for whole, _ in outs:
      if np.any(whole.view(CANARY[dtype].dtype) != CANARY[dtype]):
        raise AssertionError(f"{symbol} failed ({message.value.decode()}) but wrote output")
    raise HandlerError(message.value.decode())
  for whole, out in outs:
    check_guards(symbol, whole, out)
  return [out.copy() for _, out in outs]


# ---------------------------------------------------------------------------
# Geometry and float64 references.


def geometry(stride=(1, 1), pad=(0, 0), lhs_dil=(1, 1), rhs_dil=(1, 1)) -> dict[str, int]:
  """The conv handlers' int64 attributes from (height, width) pairs (pad: the low side)."""
  values = (*stride, *pad, *lhs_dil, *rhs_dil)
  return dict(zip(GEOMETRY, (int(v) for v in values)))


def out_size(size: int, window: int, stride: int, pad_lo: int, pad_hi: int, lhs_dil: int,
             rhs_dil: int) -> int:
  """`lax.conv_general_dilated`'s output size along one axis (0 if none)."""
  span = (size - 1) * lhs_dil + 1 + pad_lo + pad_hi - ((window - 1) * rhs_dil + 1)
  return max(0, span // stride + 1)


def taps(out: int, window: int, size: int, stride: int, pad: int, lhs_dil: int,
         rhs_dil: int) -> np.ndarray:
  """(out, window) input indices read, `size` (a zero slot) where a zero is read."""
  p = np.arange(out)[:, None] * stride + np.arange(window)[None, :] * rhs_dil - pad
  valid = (p >= 0) & (p % lhs_dil == 0) & (p // lhs_dil < size)
  return np.where(valid, p // lhs_dil, size)


def _windows(x: np.ndarray, geo: dict[str, int], out_hw, win_hw) -> np.ndarray:
  """x (A, H, W, B) -> (A, OH, KH, OW, KW, B): the input each (output, tap) reads."""
  _, h, w, _ = x.shape
  ih = taps(out_hw[0], win_hw[0], h, geo["stride_h"], geo["pad_h"], geo["lhs_dil_h"],
            geo["rhs_dil_h"])
  iw = taps(out_hw[1], win_hw[1], w, geo["stride_w"], geo["pad_w"], geo["lhs_dil_w"],
            geo["rhs_dil_w"])
  xz = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 1), (0, 1), (0, 0)))
  return xz[:, ih[:, :, None, None], iw[None, None, :, :], :]


def _with_abs(fn, *operands):
  """fn's result on the operands, and on their absolute values."""
  ops = [np.asarray(o, np.float64) for o in operands]
  return fn(*ops), fn(*[np.abs(o) for o in ops])


def depthwise_conv(x, w, geo, out_hw):
  """y (N, OH, OW, C) of x (N, H, W, C), w (KH, KW, C)."""
  return _with_abs(lambda a, b: np.einsum(
      "nahbwc,hwc->nabc", _windows(a, geo, out_hw, b.shape[:2]), b), x, w)


def depthwise_wgrad(x, g, geo, out_hw):
  """out (PH, PW, C) of x (N, H, W, C), g (N, GH, GW, C)."""
  return _with_abs(lambda a, b: np.einsum(
      "nahbwc,nhwc->abc", _windows(a, geo, out_hw, b.shape[1:3]), b), x, g)


def direct_conv(x, w, geo, out_hw):
  """y (N, OH, OW, CO) of x (N, H, W, CI), w (KH, KW, CI, CO)."""
  return _with_abs(lambda a, b: np.einsum(
      "nahbwi,hwio->nabo", _windows(a, geo, out_hw, b.shape[:2]), b), x, w)


def direct_wgrad(x, g, geo, out_hw):
  """out (PH, PW, B, F) of x (C, H, W, B), g (C, GH, GW, F)."""
  return _with_abs(lambda a, b: np.einsum(
      "cahbwi,chwf->abif", _windows(a, geo, out_hw, b.shape[1:3]), b), x, g)


def pointwise_matmul(x, w):
  """y (R, O) = x (R, I) @ w (I, O)."""
  return _with_abs(np.matmul, x, w)


def pointwise_wgrad(x, g):
  """out (I, O) = x (R, I)^T @ g (R, O)."""
  return _with_abs(lambda a, b: a.T @ b, x, g)


def batch_norm_stats(x):
  """mean (C) and biased variance (C) of x (R, C), and their error scales."""
  x = np.asarray(x, np.float64)
  mean = x.mean(0)
  return (mean, x.var(0)), (np.abs(x).mean(0), (x * x).mean(0) + mean * mean)


def batch_norm_grad_sums(x, dy, mean):
  """sum(dy) (C) and sum(dy * (x - mean)) (C), and their error scales."""
  x, dy, mean = (np.asarray(a, np.float64) for a in (x, dy, mean))
  centred = x - mean
  return ((dy.sum(0), (dy * centred).sum(0)),
          (np.abs(dy).sum(0), (np.abs(dy) * np.abs(centred)).sum(0)))


def assert_close(name: str, got: np.ndarray, want: np.ndarray, scale: np.ndarray,
                 terms: int) -> None:
  """Each element within a few roundings of a `terms`-term sum of the dtype, relative to `scale`.

  `scale` is the sum of the terms' absolute values (the reference on |operands|),
  which bounds a sum's rounding error by about ``terms * eps * scale`` in any
  order; a wrong or missing term is usually far outside that.
  """
  assert got.shape == want.shape, f"{name}: shape {got.shape}, want {want.shape}"
  eps = np.finfo(got.dtype).eps
  bound = 2 * eps * (max(terms, 1) + 2) * np.asarray(scale) + np.finfo(got.dtype).tiny
  err = np.abs(got.astype(np.float64) - want)
  bad = np.flatnonzero(~(err <= bound))
  if bad.size:
    i = np.unravel_index(int(bad[0]), got.shape)
    raise AssertionError(
        f"{name}: {bad.size} of {got.size} elements off, the first at {tuple(map(int, i))}: "
        f"got {got[i]!r}, want {want[i]!r} (error {err[i]:.3g}, bound {bound[i]:.3g})")
